//! Quantized weight matrices with a multi-row matmul.
//!
//! candle's CPU quantized matmul is a loop of per-row GEMVs: scoring k positions reads every weight
//! k times. Here each weight row is dotted with all k activation rows while it is in cache, so a block
//! costs about one weight pass. The per-element arithmetic is candle's own (`GgmlType::vec_dot` on
//! activations quantized by `from_float`), so a row's result does not depend on how many rows are in
//! the block: scoring a block gives bit-identical logits to scoring its positions one at a time.

use candle_core::quantized::k_quants::*;
use candle_core::quantized::{GgmlDType, GgmlType, QTensor};
use rayon::prelude::*;

use crate::EngineError;

/// Weight rows processed per parallel task.
const ROWS_PER_TASK: usize = 64;

trait Kernel: Send + Sync {
    /// dst[r * n + c] = lhs_row(r) . weight_row(c), for m rows of length k.
    fn matmul(&self, lhs: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]);
    fn dequantize_row(&self, row: usize, k: usize, out: &mut [f32]);
}

struct Blocks<T: GgmlType>(Vec<T>);

impl<T: GgmlType> Kernel for Blocks<T> {
    fn matmul(&self, lhs: &[f32], m: usize, k: usize, n: usize, dst: &mut [f32]) {
        let kb = k / T::BLCK_SIZE;
        let mut lhs_q = vec![T::VecDotType::zeros(); m * kb];
        if T::DIRECT_COPY {
            T::VecDotType::direct_copy(lhs, &mut lhs_q);
        } else {
            for r in 0..m {
                T::VecDotType::from_float(&lhs[r * k..(r + 1) * k], &mut lhs_q[r * kb..(r + 1) * kb]);
            }
        }
        // Column-major scratch so each task owns a contiguous slice, then transpose.
        let mut dst_t = vec![0f32; n * m];
        dst_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(task, chunk)| {
            for (j, out) in chunk.chunks_mut(m).enumerate() {
                let c = task * ROWS_PER_TASK + j;
                let w = &self.0[c * kb..(c + 1) * kb];
                for (r, o) in out.iter_mut().enumerate() {
                    *o = T::vec_dot(k, w, &lhs_q[r * kb..(r + 1) * kb]);
                }
            }
        });
        for r in 0..m {
            for c in 0..n {
                dst[r * n + c] = dst_t[c * m + r];
            }
        }
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
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>());
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
            return Err(EngineError::Unsupported(format!("row length {k} is not a multiple of the {dtype:?} block")));
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
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 498.0 - 1.0).collect();
        let wt = Tensor::from_vec(w, (n, k), &dev).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0, GgmlDType::Q5_0, GgmlDType::Q4_1] {
            let q = QTensor::quantize(&wt, dtype).unwrap();
            let ours = QWeight::from_qtensor(&q).unwrap();
            let reference = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
            let xt = Tensor::from_vec(x.clone(), (m, k), &dev).unwrap();
            let want: Vec<f32> = candle_core::Module::forward(&reference, &xt).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(ours.forward(&x, m), want, "{dtype:?}");
            // And one row alone equals that row in the block.
            assert_eq!(ours.forward(&x[2 * k..3 * k], 1), want[2 * n..3 * n].to_vec(), "{dtype:?} single row");
        }
    }
}
