//! Speed of the patched quantized kernels (patches/candle-core+0.10.2.patch) by number of activation
//! rows, on the Qwen pair's shapes: what a verify block's extra rows cost over a single step.
//!
//! - "tiles": one thread through `vec_dot_rows` directly, one weight pass per tile, for several ways
//!   of splitting the rows into tiles (5 rows as one tile of 5 or as 4 + 1, …);
//! - "matmul": the patched `k_quants::matmul` as the models call it (its own tiles, rayon's pool);
//! - "VNNI": where the CPU has AVX-VNNI or AVX512-VNNI, the matmul's time with each over its time with
//!   AVX2 alone (the patch picks one at run time; the results are bit-identical, which this checks too).
//!
//! Each figure is the fastest of 25 repetitions, the variants interleaved, as a multiple of one
//! row's time, so a shared machine's drifting speed mostly drops out.
//!
//!   RAYON_NUM_THREADS=1 taskset -c 1 cargo run --example kernel_speed -p spade-engine

use std::time::Instant;

#[cfg(target_feature = "avx2")]
use candle_core::quantized::avx;
use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType};

const REPS: usize = 25;

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ seed;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Rows `row0..row0 + R` of `ys` times every weight row, in one pass over the weights.
fn tile<T: GgmlType, const R: usize>(
    k: usize,
    weights: &[T],
    ys: &[Vec<T::VecDotType>],
    row0: usize,
) -> f32 {
    let blocks = k / T::BLCK_SIZE;
    let rows: [&[T::VecDotType]; R] = std::array::from_fn(|r| ys[row0 + r].as_slice());
    // A sum of the results keeps the compiler from dropping the work.
    weights.chunks(blocks).map(|w| T::vec_dot_rows::<R>(k, w, rows).iter().sum::<f32>()).sum()
}

fn run_plan<T: GgmlType>(
    k: usize,
    weights: &[T],
    ys: &[Vec<T::VecDotType>],
    plan: &[usize],
) -> f32 {
    let mut row0 = 0;
    let mut sum = 0.0;
    for &rows in plan {
        sum += match rows {
            1 => tile::<T, 1>(k, weights, ys, row0),
            2 => tile::<T, 2>(k, weights, ys, row0),
            3 => tile::<T, 3>(k, weights, ys, row0),
            4 => tile::<T, 4>(k, weights, ys, row0),
            5 => tile::<T, 5>(k, weights, ys, row0),
            6 => tile::<T, 6>(k, weights, ys, row0),
            8 => tile::<T, 8>(k, weights, ys, row0),
            _ => unreachable!("no tile of {rows} rows here"),
        };
        row0 += rows;
    }
    sum
}

fn report<T: GgmlType>(name: &str, k: usize, n: usize) {
    let mut weights = vec![T::zeros(); n * k / T::BLCK_SIZE];
    T::from_float(&values(n * k, 1), &mut weights);
    let ys: Vec<Vec<T::VecDotType>> = (0..8)
        .map(|r| {
            let mut y = vec![T::VecDotType::zeros(); k / T::BLCK_SIZE];
            T::VecDotType::from_float(&values(k, 7 + r), &mut y);
            y
        })
        .collect();
    let plans: [&[usize]; 9] = [&[1], &[2], &[3], &[4], &[5], &[4, 1], &[3, 2], &[6], &[8]];
    let lhs = values(8 * k, 3);
    let mut dst = vec![0f32; 8 * n];
    let matmul_rows = [1usize, 4, 5, 6, 8];
    let mut best_plan = [f64::INFINITY; 9];
    let mut best_matmul = [f64::INFINITY; 5];
    let mut sink = 0.0;
    for _ in 0..REPS {
        for (best, plan) in best_plan.iter_mut().zip(plans) {
            let started = Instant::now();
            sink += run_plan(k, &weights, &ys, plan);
            *best = best.min(started.elapsed().as_secs_f64() * 1e3);
        }
        for (best, &m) in best_matmul.iter_mut().zip(&matmul_rows) {
            let started = Instant::now();
            k_quants::matmul::<T>((m, k, n), &lhs[..m * k], &weights, &mut dst[..m * n])
                .expect("matmul shapes");
            *best = best.min(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let tiles: Vec<String> = plans
        .iter()
        .zip(&best_plan)
        .skip(1)
        .map(|(plan, t)| {
            let plan: Vec<String> = plan.iter().map(usize::to_string).collect();
            format!("{}: {:.2}x", plan.join("+"), t / best_plan[0])
        })
        .collect();
    let matmul: Vec<String> = matmul_rows
        .iter()
        .zip(&best_matmul)
        .skip(1)
        .map(|(m, t)| format!("{m}: {:.2}x", t / best_matmul[0]))
        .collect();
    println!("{name} {n}x{k} (checksum {sink:.3e})");
    println!("  tiles:  1 row {:.3} ms; {}", best_plan[0], tiles.join("  "));
    println!("  matmul: 1 row {:.3} ms; {}", best_matmul[0], matmul.join("  "));
    #[cfg(target_feature = "avx2")]
    vnni_report(k, n, &weights, &lhs);
}

/// The matmul's time with each VNNI encoding the CPU offers over its time with AVX2 alone, for 1 and
/// 5 rows, interleaved.
#[cfg(target_feature = "avx2")]
fn vnni_report<T: GgmlType>(k: usize, n: usize, weights: &[T], lhs: &[f32]) {
    let all = [
        (avx::AVX2, "AVX2"),
        (avx::AVX_VNNI, "AVX-VNNI (VEX)"),
        (avx::AVX512_VNNI, "AVX512-VNNI (EVEX)"),
    ];
    let kinds: Vec<(u8, &str)> =
        all.into_iter().filter(|&(kind, _)| avx::allow_vnni(kind) == kind).collect();
    let mut lines = vec![Vec::new(); kinds.len()];
    for m in [1usize, 5] {
        let mut best = vec![f64::INFINITY; kinds.len()];
        let mut out = vec![vec![0f32; m * n]; kinds.len()];
        for _ in 0..REPS {
            for ((&(kind, _), best), dst) in kinds.iter().zip(best.iter_mut()).zip(out.iter_mut()) {
                avx::allow_vnni(kind);
                let started = Instant::now();
                k_quants::matmul::<T>((m, k, n), &lhs[..m * k], weights, dst)
                    .expect("matmul shapes");
                *best = best.min(started.elapsed().as_secs_f64() * 1e3);
            }
        }
        for at in 1..kinds.len() {
            let same = out[0].iter().zip(&out[at]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{} and AVX2 results differ ({m} rows)", kinds[at].1);
            let rows = format!("{m} row{}", if m > 1 { "s" } else { "" });
            lines[at].push(format!(
                "{rows}: {:.3} / {:.3} ms = {:.2}x",
                best[at],
                best[0],
                best[at] / best[0]
            ));
        }
    }
    avx::allow_vnni(avx::AVX512_VNNI);
    for ((_, name), line) in kinds.iter().zip(&lines).skip(1) {
        println!("  {name} / AVX2 alone (bit-identical): {}", line.join("  "));
    }
}

fn main() {
    println!("time for m activation rows as a multiple of one row's (one pass over the weights)");
    report::<BlockQ4K>("Q4_K (1.5B ffn_gate/up)", 1536, 8960);
    report::<BlockQ6K>("Q6_K (1.5B ffn_down in half the layers)", 8960, 1536);
    report::<BlockQ5_0>("Q5_0 (0.5B ffn_gate/up)", 896, 4864);
    report::<BlockQ8_0>("Q8_0 (the 0.5B output layer's type, ffn_up's shape)", 896, 4864);
}
