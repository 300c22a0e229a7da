//! Quantized CPU kernels (patches/candle-core+0.10.2.patch): the multi-row quantized matmul must give
//! every activation row bit-identical results whether computed alone or in a block of rows (the
//! verifier's losslessness depends on it), and the AVX2 dot products added by the patch must agree
//! with candle's scalar reference. Runs on any target: without AVX2 both checks still hold (the
//! per-row path and the scalar kernels are used). Where the CPU has AVX-VNNI or AVX512-VNNI, the
//! kernels that use it must give the AVX2 kernels' results bit for bit.

use candle_core::quantized::k_quants::*;
use candle_core::quantized::{GgmlDType, GgmlType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

/// Deterministic pseudo-random values in [-1, 1) with per-32-block magnitudes spanning ~3 decades
/// (so block scales differ) and a few outliers.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut out = Vec::with_capacity(len);
    let mut scale = 1.0;
    for i in 0..len {
        if i % 32 == 0 {
            scale = 10f32.powf(-3.0 * next());
        }
        let mut v = (2.0 * next() - 1.0) * scale;
        if next() < 0.01 {
            v *= 20.0;
        }
        out.push(v);
    }
    out
}

const DTYPES: [GgmlDType; 10] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Row lengths: a few blocks (even block counts for the 32-element types, whose scalar kernels
/// assert it), including the real 896.
fn ks(dtype: GgmlDType) -> Vec<usize> {
    if dtype.block_size() == 256 {
        vec![256, 768, 1280]
    } else {
        vec![64, 192, 896]
    }
}

#[test]
fn qmatmul_rows_are_bit_identical_alone_or_in_blocks() {
    let dev = Device::Cpu;
    for dtype in DTYPES {
        for k in ks(dtype) {
            for n in [1usize, 7, 67, 129] {
                let w = Tensor::from_vec(values(n * k, (n * k) as u64), (n, k), &dev).unwrap();
                let mm = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap();
                let mmax = 13;
                let x = values(mmax * k, 7 + k as u64);
                // Each row alone.
                let single: Vec<Vec<f32>> = (0..mmax)
                    .map(|r| {
                        let xt =
                            Tensor::from_vec(x[r * k..(r + 1) * k].to_vec(), (1, k), &dev).unwrap();
                        mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap()
                    })
                    .collect();
                for m in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 13] {
                    // Rows 0..m, and a block starting at an offset (rows land in other tile slots).
                    for start in [0usize, mmax - m] {
                        let xt =
                            Tensor::from_vec(x[start * k..(start + m) * k].to_vec(), (m, k), &dev)
                                .unwrap();
                        let got: Vec<f32> =
                            mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                        for r in 0..m {
                            let row = &got[r * n..(r + 1) * n];
                            let want = &single[start + r];
                            let same =
                                row.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{dtype:?} n={n} k={k} m={m} start={start} row {r}: {row:?} != {want:?}");
                        }
                    }
                }
                // A batched (b, m, k) input is the same rows again.
                let xt = Tensor::from_vec(x[..6 * k].to_vec(), (2, 3, k), &dev).unwrap();
                let got: Vec<f32> =
                    mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let want: Vec<f32> = single[..6].concat();
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?} batched"
                );
            }
        }
    }
}

/// vec_dot (SIMD where available) vs the scalar vec_dot_unopt, and vec_dot_rows vs vec_dot.
fn check_kernels<T: GgmlType>(k: usize) {
    let nb = k / T::BLCK_SIZE;
    let wf = values(k, 11 * k as u64 + T::BLCK_SIZE as u64);
    let mut w = vec![T::zeros(); nb];
    T::from_float(&wf, &mut w);
    let mut wd = vec![0f32; k];
    T::to_float(&w, &mut wd);
    let ys: Vec<(Vec<T::VecDotType>, Vec<f32>)> = (0..6)
        .map(|r| {
            let xf = values(k, 1000 + r as u64 * 31 + k as u64);
            let mut y = vec![T::VecDotType::zeros(); nb];
            T::VecDotType::from_float(&xf, &mut y);
            (y, xf) // (Q8_1 has no to_float; the unquantized values serve for the magnitude.)
        })
        .collect();
    for (y, xf) in &ys {
        let fast = T::vec_dot(k, &w, y);
        let slow = T::vec_dot_unopt(k, &w, y);
        // Both sum exact integer block dot products scaled by f32 factors, in different orders.
        let mag: f32 = wd.iter().zip(xf).map(|(a, b)| (a * b).abs()).sum();
        assert!(
            (fast - slow).abs() <= 1e-5 * mag + 1e-30,
            "{:?} k={k}: simd {fast} vs scalar {slow} (magnitude {mag})",
            T::DTYPE
        );
    }
    let single: Vec<f32> = ys.iter().map(|(y, _)| T::vec_dot(k, &w, y)).collect();
    let r1 = T::vec_dot_rows::<1>(k, &w, [&ys[0].0]);
    let r2 = T::vec_dot_rows::<2>(k, &w, [&ys[0].0, &ys[1].0]);
    let r3 = T::vec_dot_rows::<3>(k, &w, [&ys[0].0, &ys[1].0, &ys[2].0]);
    let r4 = T::vec_dot_rows::<4>(k, &w, [&ys[0].0, &ys[1].0, &ys[2].0, &ys[3].0]);
    let r5 = T::vec_dot_rows::<5>(k, &w, std::array::from_fn(|r| ys[r].0.as_slice()));
    let r6 = T::vec_dot_rows::<6>(k, &w, std::array::from_fn(|r| ys[r].0.as_slice()));
    for got in [&r1[..], &r2[..], &r3[..], &r4[..], &r5[..], &r6[..]] {
        for (r, v) in got.iter().enumerate() {
            assert_eq!(
                v.to_bits(),
                single[r].to_bits(),
                "{:?} k={k} vec_dot_rows row {r}",
                T::DTYPE
            );
        }
    }
}

#[test]
fn simd_dot_products_match_scalar_reference() {
    for k in [64, 896, 4864] {
        check_kernels::<BlockQ4_0>(k);
        check_kernels::<BlockQ4_1>(k);
        check_kernels::<BlockQ5_0>(k);
        check_kernels::<BlockQ5_1>(k);
        check_kernels::<BlockQ8_0>(k);
    }
    for k in [256, 1536, 8960] {
        check_kernels::<BlockQ2K>(k);
        check_kernels::<BlockQ3K>(k);
        check_kernels::<BlockQ4K>(k);
        check_kernels::<BlockQ5K>(k);
        check_kernels::<BlockQ6K>(k);
    }
}

/// The patch picks VNNI's dot products at run time where the CPU has them (AVX512-VNNI's EVEX
/// encoding, or else AVX-VNNI's VEX one), in every multi-row kernel: each type's matmul must give
/// exactly the AVX2 path's bits with every encoding the CPU offers, alone and in blocks. Other
/// tests in this binary may run meanwhile with any path: by this very property their results do
/// not change.
#[cfg(target_feature = "avx2")]
#[test]
fn vnni_kernels_equal_the_avx2_ones_bit_for_bit() {
    use candle_core::quantized::avx::{allow_vnni, AVX2, AVX512_VNNI, AVX_VNNI};
    let kinds: Vec<u8> =
        [AVX_VNNI, AVX512_VNNI].into_iter().filter(|&kind| allow_vnni(kind) == kind).collect();
    if kinds.is_empty() {
        eprintln!("this CPU has neither AVX-VNNI nor AVX512-VNNI: only the AVX2 kernels run here");
    }
    let dev = Device::Cpu;
    for dtype in DTYPES {
        for k in ks(dtype) {
            let n = 67;
            let w = Tensor::from_vec(values(n * k, (n * k) as u64 + 1), (n, k), &dev).unwrap();
            let mm = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap();
            for m in [1usize, 2, 5, 6, 13] {
                let xt = Tensor::from_vec(values(m * k, 11 + m as u64), (m, k), &dev).unwrap();
                let run = |most: u8| -> Vec<f32> {
                    assert_eq!(allow_vnni(most), most);
                    mm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap()
                };
                let avx2 = run(AVX2);
                for &kind in &kinds {
                    let vnni = run(kind);
                    let same = avx2.iter().zip(&vnni).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype:?} k={k} m={m}: VNNI kind {kind} {vnni:?} != AVX2 {avx2:?}"
                    );
                }
            }
        }
    }
    allow_vnni(AVX512_VNNI);
}
