//! The arithmetic of [`attend`]: blocks of queries scored against a few keys at a time, softmax, and
//! the weighted values added, each sum as it would be for one query alone.

use std::ops::Range;

use spade_core::fastmath;

use super::super::model::dot;

/// Queries a kernel call works on at once: 6 queries times 2 keys (or 16 value lanes) are 12
/// accumulators, which with their operands fill AVX2's 16 vector registers.
const QUERY_BLOCK: usize = 6;
/// Keys scored per pass over a block of queries, so that they are read from L1 by every block.
const KEY_BLOCK: usize = 16;
/// Positions whose values are added per pass over the queries' outputs (16 KiB of values at 128
/// dimensions), so that they are read from L1 by every block.
const VALUE_BLOCK: usize = 32;

/// Attention outputs `[query][hd]` of `queries` (each: how many positions it sees, its vector) over
/// kv head `g` of the cache.
///
/// The arithmetic per (query, position) is fixed: the score is [`dot`] times the scale, the weight
/// the exponential of the score less the query's maximum over its sum taken in order, and each output
/// lane adds `weight * value` for positions in ascending order. Which queries and positions are
/// worked on together (blocks of up to [`QUERY_BLOCK`] queries, the positions all of them see, then
/// each one's own) changes only how many independent sums are in flight, not any sum.
pub(super) fn attend(
    queries: &[(usize, &[f32])],
    keys: &[f32],
    values: &[f32],
    nkv: usize,
    g: usize,
    hd: usize,
) -> Vec<f32> {
    let scale = 1.0 / (hd as f32).sqrt();
    let key = |j: usize| &keys[(j * nkv + g) * hd..][..hd];
    let value = |j: usize| &values[(j * nkv + g) * hd..][..hd];
    let seen = queries.iter().map(|&(n, _)| n).max().unwrap_or(0);
    let blocks: Vec<(usize, usize)> = (0..queries.len())
        .step_by(QUERY_BLOCK)
        .map(|a| (a, (a + QUERY_BLOCK).min(queries.len())))
        .collect();
    let shared = |(a, b): (usize, usize)| queries[a..b].iter().map(|&(n, _)| n).min().unwrap_or(0);

    let mut scores: Vec<Vec<f32>> = queries.iter().map(|&(n, _)| vec![0f32; n]).collect();
    for j0 in (0..seen).step_by(KEY_BLOCK) {
        let j1 = (j0 + KEY_BLOCK).min(seen);
        for &(a, b) in &blocks {
            let common = shared((a, b)).clamp(j0, j1);
            score_block(&queries[a..b], &mut scores[a..b], key, j0..common, scale);
            for (&(n, qv), s) in queries[a..b].iter().zip(&mut scores[a..b]) {
                let end = n.min(j1);
                let own = common.min(end)..end;
                for (j, s) in own.clone().zip(&mut s[own]) {
                    *s = dot(qv, key(j)) * scale;
                }
            }
        }
    }
    for &(a, b) in &blocks {
        normalize_block(&mut scores[a..b]);
    }

    let mut out = vec![0f32; queries.len() * hd];
    for j0 in (0..seen).step_by(VALUE_BLOCK) {
        let j1 = (j0 + VALUE_BLOCK).min(seen);
        for &(a, b) in &blocks {
            let o = &mut out[a * hd..b * hd];
            let (weights, common) = (&scores[a..b], shared((a, b)).clamp(j0, j1));
            weigh_block(weights, value, j0..common, o, hd);
            for (q, w) in weights.iter().enumerate() {
                let own = &mut o[q * hd..][..hd];
                weigh_block(
                    std::slice::from_ref(w),
                    value,
                    common..w.len().clamp(common, j1),
                    own,
                    hd,
                );
            }
        }
    }
    out
}

/// Softmax of each query's scores in place: the maximum subtracted, the exponentials, their sum in
/// order, each divided by it. The block's sums are taken side by side, each still in order.
fn normalize_block(scores: &mut [Vec<f32>]) {
    let mut sums = [0f32; QUERY_BLOCK];
    for s in scores.iter_mut() {
        // The maximum is the same in any order.
        let mut lanes = [f32::NEG_INFINITY; 8];
        let chunks = s.chunks_exact(8);
        let rest = chunks.remainder().iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        for c in chunks {
            for i in 0..8 {
                lanes[i] = lanes[i].max(c[i]);
            }
        }
        let max = lanes.iter().cloned().fold(rest, f32::max);
        s.iter_mut().for_each(|x| *x = fastmath::exp(*x - max));
    }
    let longest = scores.iter().map(Vec::len).max().unwrap_or(0);
    for j in 0..longest {
        for (s, sum) in scores.iter().zip(&mut sums) {
            if let Some(x) = s.get(j) {
                *sum += x;
            }
        }
    }
    for (s, sum) in scores.iter_mut().zip(sums) {
        s.iter_mut().for_each(|x| *x /= sum);
    }
}

/// Scores `dot(q, key(j)) * scale` of a block of queries for the positions in `range`, two keys at
/// a time.
fn score_block<'k>(
    queries: &[(usize, &[f32])],
    scores: &mut [Vec<f32>],
    key: impl Fn(usize) -> &'k [f32] + Copy,
    range: Range<usize>,
    scale: f32,
) {
    match queries.len() {
        1 => score_n::<1>(queries, scores, key, range, scale),
        2 => score_n::<2>(queries, scores, key, range, scale),
        3 => score_n::<3>(queries, scores, key, range, scale),
        4 => score_n::<4>(queries, scores, key, range, scale),
        5 => score_n::<5>(queries, scores, key, range, scale),
        6 => score_n::<6>(queries, scores, key, range, scale),
        n => unreachable!("a block of {n} queries"),
    }
}

fn score_n<'k, const Q: usize>(
    queries: &[(usize, &[f32])],
    scores: &mut [Vec<f32>],
    key: impl Fn(usize) -> &'k [f32],
    range: Range<usize>,
    scale: f32,
) {
    let qs: [&[f32]; Q] = std::array::from_fn(|q| queries[q].1);
    let mut j = range.start;
    while j + 2 <= range.end {
        let d = dots::<Q, 2>(qs, [key(j), key(j + 1)]);
        for (s, d) in scores.iter_mut().zip(d) {
            s[j] = d[0] * scale;
            s[j + 1] = d[1] * scale;
        }
        j += 2;
    }
    if j < range.end {
        let d = dots::<Q, 1>(qs, [key(j)]);
        for (s, d) in scores.iter_mut().zip(d) {
            s[j] = d[0] * scale;
        }
    }
}

/// [`dot`] of each of `Q` queries with each of `K` keys, each with the same arithmetic as alone: per
/// lane of 8, products added in order, the lanes summed in `dot`'s tree, then the dimensions past
/// the last multiple of 8. The `Q * K` sums are independent, so they are in flight together.
#[inline(always)]
fn dots<const Q: usize, const K: usize>(qs: [&[f32]; Q], ks: [&[f32]; K]) -> [[f32; K]; Q] {
    let hd = ks[0].len();
    let body = hd / 8 * 8;
    assert!(qs.iter().chain(&ks).all(|v| v.len() == hd));
    let mut sums = lane_sums::<Q, K>(qs, ks, body);
    for (s, q) in sums.iter_mut().zip(qs) {
        for (s, k) in s.iter_mut().zip(ks) {
            for i in body..hd {
                *s += q[i] * k[i];
            }
        }
    }
    sums
}

/// [`dots`] over the first `body` dimensions (a multiple of 8, at most every vector's length).
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
#[inline(always)]
fn lane_sums<const Q: usize, const K: usize>(
    qs: [&[f32]; Q],
    ks: [&[f32]; K],
    body: usize,
) -> [[f32; K]; Q] {
    use std::arch::x86_64::*;
    // SAFETY: AVX is enabled at compile time (the cfg above), and every load reads 8 floats at
    // offset c + 8 <= body <= len of the vector it reads from (checked by `dots`).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); K]; Q];
        for c in (0..body).step_by(8) {
            let k: [__m256; K] = std::array::from_fn(|k| _mm256_loadu_ps(ks[k].as_ptr().add(c)));
            for (q, acc) in qs.iter().zip(&mut acc) {
                let x = _mm256_loadu_ps(q.as_ptr().add(c));
                for (acc, k) in acc.iter_mut().zip(k) {
                    // A multiply and an add, each rounded, as `dot`'s scalar code: not a fused one.
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, k));
                }
            }
        }
        // `dot`'s tree, four sums at a time: a_i + a_(i+4), then (x0 + x1) + (x2 + x3) by two
        // horizontal adds.
        let mut flat = [_mm256_setzero_ps(); 24];
        for (i, a) in acc.iter().flatten().enumerate() {
            flat[i] = *a;
        }
        let half = |a: __m256| _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let mut sums = [0f32; 24];
        for (f, s) in flat.chunks_exact(4).zip(sums.chunks_exact_mut(4)).take((Q * K).div_ceil(4)) {
            let low = _mm_hadd_ps(half(f[0]), half(f[1]));
            let high = _mm_hadd_ps(half(f[2]), half(f[3]));
            _mm_storeu_ps(s.as_mut_ptr(), _mm_hadd_ps(low, high));
        }
        std::array::from_fn(|q| std::array::from_fn(|k| sums[q * K + k]))
    }
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
#[inline(always)]
fn lane_sums<const Q: usize, const K: usize>(
    qs: [&[f32]; Q],
    ks: [&[f32]; K],
    body: usize,
) -> [[f32; K]; Q] {
    let mut acc = [[[0f32; 8]; K]; Q];
    for c in (0..body).step_by(8) {
        for (q, acc) in qs.iter().zip(&mut acc) {
            for (acc, k) in acc.iter_mut().zip(&ks) {
                for i in 0..8 {
                    acc[i] += q[c + i] * k[c + i];
                }
            }
        }
    }
    acc.map(|acc| acc.map(|a| ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))))
}

/// Adds `weights[q][j] * value(j)` to each query's output (`o`, `[query][hd]`) for the positions in
/// `range`, in ascending order: 16 lanes at a time, then 8, then one.
fn weigh_block<'v>(
    weights: &[Vec<f32>],
    value: impl Fn(usize) -> &'v [f32] + Copy,
    range: Range<usize>,
    o: &mut [f32],
    hd: usize,
) {
    if range.is_empty() {
        return;
    }
    let mut d = 0;
    while d < hd {
        let width = match hd - d {
            16.. => 16,
            8.. => 8,
            _ => 1,
        };
        macro_rules! weigh {
            ($w:literal) => {
                match weights.len() {
                    1 => weigh_n::<1, $w>(weights, value, range.clone(), o, hd, d),
                    2 => weigh_n::<2, $w>(weights, value, range.clone(), o, hd, d),
                    3 => weigh_n::<3, $w>(weights, value, range.clone(), o, hd, d),
                    4 => weigh_n::<4, $w>(weights, value, range.clone(), o, hd, d),
                    5 => weigh_n::<5, $w>(weights, value, range.clone(), o, hd, d),
                    6 => weigh_n::<6, $w>(weights, value, range.clone(), o, hd, d),
                    n => unreachable!("a block of {n} queries"),
                }
            };
        }
        match width {
            16 => weigh!(2),
            8 => weigh!(1),
            _ => weigh_lane(weights, value, range.clone(), o, hd, d),
        }
        d += width;
    }
}

/// [`weigh_block`] for `8 * V` lanes from `d0` of `Q` queries: `o += w * v`, a multiply and an add
/// each rounded, positions in order.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
fn weigh_n<'v, const Q: usize, const V: usize>(
    weights: &[Vec<f32>],
    value: impl Fn(usize) -> &'v [f32],
    range: Range<usize>,
    o: &mut [f32],
    hd: usize,
    d0: usize,
) {
    use std::arch::x86_64::*;
    let ws: [&[f32]; Q] = std::array::from_fn(|q| &weights[q][range.clone()]);
    assert!(o.len() >= Q * hd && d0 + 8 * V <= hd);
    // SAFETY: AVX is enabled at compile time (the cfg above); every load and store touches 8 floats
    // at d0 + 8 * i + 8 <= hd within a row of `o` (Q rows of hd, asserted) or of a value (hd long,
    // asserted per position).
    unsafe {
        let mut acc: [[__m256; V]; Q] = std::array::from_fn(|q| {
            std::array::from_fn(|i| _mm256_loadu_ps(o.as_ptr().add(q * hd + d0 + 8 * i)))
        });
        for (t, j) in range.enumerate() {
            let value = value(j);
            assert!(value.len() == hd);
            let v: [__m256; V] =
                std::array::from_fn(|i| _mm256_loadu_ps(value.as_ptr().add(d0 + 8 * i)));
            for (acc, w) in acc.iter_mut().zip(&ws) {
                let w = _mm256_set1_ps(w[t]);
                for (acc, v) in acc.iter_mut().zip(v) {
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(w, v));
                }
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            for (i, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(q * hd + d0 + 8 * i), *acc);
            }
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
fn weigh_n<'v, const Q: usize, const V: usize>(
    weights: &[Vec<f32>],
    value: impl Fn(usize) -> &'v [f32] + Copy,
    range: Range<usize>,
    o: &mut [f32],
    hd: usize,
    d0: usize,
) {
    for lane in d0..d0 + 8 * V {
        weigh_lane(&weights[..Q], value, range.clone(), o, hd, lane);
    }
}

/// [`weigh_block`] for the one lane `d` of every query.
fn weigh_lane<'v>(
    weights: &[Vec<f32>],
    value: impl Fn(usize) -> &'v [f32],
    range: Range<usize>,
    o: &mut [f32],
    hd: usize,
    d: usize,
) {
    for j in range {
        let v = value(j)[d];
        for (q, w) in weights.iter().enumerate() {
            o[q * hd + d] += w[j] * v;
        }
    }
}
