//! Quantized weight matrices with a multi-row matmul.
//!
//! candle's stock CPU quantized matmul is a loop of per-row GEMVs: scoring k positions reads every
//! weight k times. With patches/candle-core+0.10.2.patch, `k_quants::matmul` is a multi-row matmul:
//! activation rows are quantized once (`from_float`), weight rows are split in chunks over rayon's
//! threads, and each weight row is dotted with even tiles of up to 6 activation rows through
//! `GgmlType::vec_dot_rows`, which unpacks every weight block once per tile. Per (row, column) it
//! runs exactly the single-row `vec_dot`, so a row's result does not depend on how many rows are
//! in the block: scoring a block gives bit-identical logits to scoring its positions one at a time,
//! and the same logits as candle's `QMatMul` (which calls the same function).

use candle_core::quantized::k_quants::*;
use candle_core::quantized::{GgmlDType, GgmlType, QTensor};

use crate::EngineError;

trait Kernel: Send + Sync {
    /// dst[r * n + c] = lhs_row(r) . weight_row(c), for m rows of length k.
    fn matmul(&self, lhs: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]);
    fn dequantize_row(&self, row: usize, k: usize, out: &mut [f32]);
}

struct Blocks<T: GgmlType>(Vec<T>);

impl<T: GgmlType> Kernel for Blocks<T> {
    fn matmul(&self, lhs: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]) {
        // The patched candle multi-row matmul (tiles of `vec_dot_rows`); it only fails on a length
        // mismatch, which `QWeight::forward` rules out.
        candle_core::quantized::k_quants::matmul((m, k, n), lhs, &self.0, dst)
            .expect("quantized matmul shapes");
    }

    fn dequantize_row(&self, row: usize, k: usize, out: &mut [f32]) {
        let kb = k / T::BLCK_SIZE;
        T::to_float(&self.0[row * kb..(row + 1) * kb], out);
    }
}

fn blocks<T: GgmlType + 'static>(bytes: &[u8]) -> Box<dyn Kernel> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v: Vec<T> = Vec::with_capacity(n);
    // SAFETY: GGUF tensor data is a packed array of `T` blocks (plain-old-data, repr(C)); the Vec
    // gives correct alignment and we copy exactly n * size_of::<T>() bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            v.as_mut_ptr() as *mut u8,
            n * std::mem::size_of::<T>(),
        );
        v.set_len(n);
    }
    Box::new(Blocks(v))
}

/// An `[n, k]` weight matrix (n output features, k inputs) in its GGUF quantization.
pub struct QWeight {
    n: usize,
    k: usize,
    kernel: Box<dyn Kernel>,
}

impl QWeight {
    pub fn from_qtensor(t: &QTensor) -> Result<Self, EngineError> {
        let dims = t.shape().dims();
        let (n, k) = match dims {
            [n, k] => (*n, *k),
            [k] => (1, *k),
            _ => return Err(EngineError::Unsupported(format!("weight of shape {dims:?}"))),
        };
        let dtype = t.dtype();
        if k % dtype.block_size() != 0 {
            return Err(EngineError::Unsupported(format!(
                "row length {k} is not a multiple of the {dtype:?} block"
            )));
        }
        let data = t.data()?;
        let kernel = match dtype {
            GgmlDType::F32 => blocks::<f32>(&data),
            GgmlDType::F16 => blocks::<half::f16>(&data),
            GgmlDType::BF16 => blocks::<half::bf16>(&data),
            GgmlDType::Q4_0 => blocks::<BlockQ4_0>(&data),
            GgmlDType::Q4_1 => blocks::<BlockQ4_1>(&data),
            GgmlDType::Q5_0 => blocks::<BlockQ5_0>(&data),
            GgmlDType::Q5_1 => blocks::<BlockQ5_1>(&data),
            GgmlDType::Q8_0 => blocks::<BlockQ8_0>(&data),
            GgmlDType::Q8_1 => blocks::<BlockQ8_1>(&data),
            GgmlDType::Q2K => blocks::<BlockQ2K>(&data),
            GgmlDType::Q3K => blocks::<BlockQ3K>(&data),
            GgmlDType::Q4K => blocks::<BlockQ4K>(&data),
            GgmlDType::Q5K => blocks::<BlockQ5K>(&data),
            GgmlDType::Q6K => blocks::<BlockQ6K>(&data),
            GgmlDType::Q8K => blocks::<BlockQ8K>(&data),
        };
        Ok(Self { n, k, kernel })
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    /// `xs` is `[m, k]` row-major; returns `[m, n]`.
    pub fn forward(&self, xs: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(xs.len(), m * self.k);
        let mut out = vec![0f32; m * self.n];
        self.kernel.matmul(xs, m, self.k, self.n, &mut out);
        out
    }

    /// Row `row` as floats (embedding lookup).
    pub fn row(&self, row: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.k];
        self.kernel.dequantize_row(row, self.k, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The multi-row kernel must agree bit for bit with candle's own quantized matmul, row by row.
    #[test]
    fn matches_candle_qmatmul_bitwise() {
        let dev = Device::Cpu;
        let (n, k, m) = (96, 512, 5);
        let w: Vec<f32> =
            (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 498.0 - 1.0).collect();
        let wt = Tensor::from_vec(w, (n, k), &dev).unwrap();
        for dtype in
            [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0, GgmlDType::Q5_0, GgmlDType::Q4_1]
        {
            let q = QTensor::quantize(&wt, dtype).unwrap();
            let ours = QWeight::from_qtensor(&q).unwrap();
            let reference = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
            let xt = Tensor::from_vec(x.clone(), (m, k), &dev).unwrap();
            let want: Vec<f32> = candle_core::Module::forward(&reference, &xt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(ours.forward(&x, m), want, "{dtype:?}");
            // And each row alone equals that row in the block, bit for bit.
            for r in 0..m {
                let alone = ours.forward(&x[r * k..(r + 1) * k], 1);
                let same = alone
                    .iter()
                    .zip(&want[r * n..(r + 1) * n])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} row {r} alone differs from the block");
            }
        }
    }
}
