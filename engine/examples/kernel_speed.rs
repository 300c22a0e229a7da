//! Speed of the patched quantized matmul (patches/candle-core+0.10.2.patch) by number of activation
//! rows, on the 1.5B's shapes: how much a verify block's extra rows cost over a single step. The
//! fastest of many repetitions per figure, so a shared machine's noise mostly drops out.
//!
//!   RAYON_NUM_THREADS=1 taskset -c 1 cargo run --example kernel_speed -p spade-engine [-- MAX_ROWS]

use std::time::Instant;

use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType};

fn values(len: usize) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Milliseconds for an (m × k) by (k × n) product, fastest of `reps`.
fn time<T: GgmlType>(m: usize, k: usize, n: usize, reps: usize) -> f64 {
    let weights = values(n * k);
    let mut blocks = vec![T::zeros(); n * k / T::BLCK_SIZE];
    T::from_float(&weights, &mut blocks);
    let lhs = values(m * k);
    let mut dst = vec![0f32; m * n];
    (0..reps)
        .map(|_| {
            let started = Instant::now();
            k_quants::matmul::<T>((m, k, n), &lhs, &blocks, &mut dst).unwrap();
            started.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn report<T: GgmlType>(name: &str, k: usize, n: usize, max_rows: usize) {
    let reps = 20;
    let one = time::<T>(1, k, n, reps);
    let mut line = format!("{name:>5} {n:>5}x{k:<5} 1 row {one:6.2} ms;");
    for m in 2..=max_rows {
        let t = time::<T>(m, k, n, reps);
        line += &format!(" {m}: {:.2}x", t / one);
    }
    println!("{line}");
}

fn main() {
    let max_rows = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(8);
    println!("time of m rows as a multiple of one row's (one weight pass would be 1.00x)");
    report::<BlockQ4K>("Q4_K", 1536, 8960, max_rows);
    report::<BlockQ6K>("Q6_K", 8960, 1536, max_rows);
    report::<BlockQ5_0>("Q5_0", 896, 4864, max_rows);
    report::<BlockQ8_0>("Q8_0", 896, 4864, max_rows);
}
