//! Sampling transforms: logits -> the explicit distribution a token is drawn from.
//!
//! Order: temperature, then top-k, then top-p (over what top-k kept), then min-p, then renormalise.
//! The target's p and the draft's q are both produced here, so "the distribution the token was drawn
//! from" is one definition shared by the edge and the cloud.

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use thiserror::Error;
use utoipa::ToSchema;

use crate::dist::SparseDist;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    #[error("`{name}` is {value}: {expected}")]
    InvalidParam { name: &'static str, value: f64, expected: &'static str },
    #[error("no finite logit: the model produced NaN or infinite values everywhere")]
    NoFiniteLogit,
    #[error("logit of token {token} is {value}: logits must be finite or -inf")]
    InvalidLogit { token: u32, value: f32 },
    #[error("`logit_bias` names token {token}, outside the vocabulary of {vocab_size} tokens")]
    BiasOutOfVocab { token: u32, vocab_size: u32 },
}

impl SamplingError {
    /// The request field at fault, for a request that nests the parameters under `parent` (the
    /// verifier's `sampling`) or keeps them at the top level (`None`: the OpenAI API).
    pub fn param(&self, parent: Option<&str>) -> Option<String> {
        match (self, parent) {
            (Self::InvalidParam { name, .. }, None) => Some(name.to_string()),
            (Self::InvalidParam { name, .. }, Some(parent)) => Some(format!("{parent}.{name}")),
            (Self::BiasOutOfVocab { .. }, None) => Some("logit_bias".into()),
            (Self::BiasOutOfVocab { .. }, Some(parent)) => Some(format!("{parent}.logit_bias")),
            (_, parent) => parent.map(str::to_string),
        }
    }
}

/// How a token is chosen from a model's logits. Temperature 0 means greedy (argmax, ties to the lowest id).
// A field left out takes its value from `Default`: the one place the defaults are written.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it. Range [0, 2].
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most probable tokens whose mass is >= top_p. (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep the k most probable tokens. 0 = off.
    pub top_k: u32,
    /// Drop tokens whose probability is below min_p times the largest. [0, 1]; 0 = off.
    pub min_p: f32,
}

/// The OpenAI API's defaults: sampling at temperature 1 from the whole distribution.
impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: 0, min_p: 0.0 }
    }
}

impl SamplingParams {
    /// The parameters a request set, the defaults for those it left out.
    pub fn with_defaults(
        temperature: Option<f32>,
        top_p: Option<f32>,
        top_k: Option<u32>,
        min_p: Option<f32>,
    ) -> Self {
        let d = Self::default();
        Self {
            temperature: temperature.unwrap_or(d.temperature),
            top_p: top_p.unwrap_or(d.top_p),
            top_k: top_k.unwrap_or(d.top_k),
            min_p: min_p.unwrap_or(d.min_p),
        }
    }

    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// How the draft should sample for a request with these target parameters: the same transform,
    /// with at most `max_k` tokens kept. Any q is lossless; truncating it bounds the bytes sent per
    /// draft token (a full-vocabulary q is megabytes) and costs little acceptance, since the mass
    /// beyond the top few dozen draft tokens is small.
    pub fn for_draft(&self, max_k: u32) -> Self {
        if self.is_greedy() || max_k == 0 {
            return *self;
        }
        let top_k = if self.top_k == 0 { max_k } else { self.top_k.min(max_k) };
        Self { top_k, ..*self }
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |name, value: f32, expected| SamplingError::InvalidParam {
            name,
            value: value as f64,
            expected,
        };
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(bad("temperature", self.temperature, "must be between 0 and 2"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p, "must be greater than 0 and at most 1"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", self.min_p, "must be between 0 and 1"));
        }
        Ok(())
    }
}

/// Entries sorted first when looking for the top-p nucleus (more when their mass falls short).
const TOP_P_FIRST_GUESS: usize = 256;

/// Most probable first; ties broken by lower token id, so every truncation is deterministic.
fn by_weight_desc(a: &(u32, f64), b: &(u32, f64)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The distribution that `params` defines over `logits` (index = token id).
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Result<SparseDist, SamplingError> {
    params.validate()?;
    let mut best: Option<(u32, f32)> = None;
    for (token, &l) in logits.iter().enumerate() {
        if l.is_nan() || l == f32::INFINITY {
            return Err(SamplingError::InvalidLogit { token: token as u32, value: l });
        }
        if l.is_finite() && best.is_none_or(|(_, b)| l > b) {
            best = Some((token as u32, l));
        }
    }
    let (argmax, max) = best.ok_or(SamplingError::NoFiniteLogit)?;
    if params.is_greedy() {
        return Ok(SparseDist::point(argmax));
    }

    let inv_t = 1.0 / params.temperature as f64;
    let mut weights: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(t, &l)| (t as u32, ((l as f64 - max as f64) * inv_t).exp()))
        .filter(|&(_, w)| w > 0.0)
        .collect();

    let k = params.top_k as usize;
    if k > 0 && k < weights.len() {
        weights.select_nth_unstable_by(k - 1, by_weight_desc);
        weights.truncate(k);
    }
    if params.top_p < 1.0 {
        let total: f64 = weights.iter().map(|w| w.1).sum();
        let need = params.top_p as f64 * total;
        // The nucleus is a prefix of the weights sorted most probable first, and usually a short
        // one: sort only the `m` largest (selected in linear time), growing m until their mass
        // reaches `need`, instead of sorting all 150k entries of every row.
        let mut m = TOP_P_FIRST_GUESS.min(weights.len());
        loop {
            if m < weights.len() {
                weights.select_nth_unstable_by(m - 1, by_weight_desc);
            }
            weights[..m].sort_unstable_by(by_weight_desc);
            let mut acc = 0.0;
            let reached = weights[..m].iter().position(|&(_, w)| {
                acc += w;
                acc >= need
            });
            if let Some(i) = reached {
                weights.truncate(i + 1);
                break;
            }
            if m == weights.len() {
                break;
            }
            m = (m * 8).min(weights.len());
        }
    }
    if params.min_p > 0.0 {
        // The argmax has weight exp(0) = 1 and survives every step above.
        let floor = params.min_p as f64;
        weights.retain(|&(_, w)| w >= floor);
    }
    Ok(SparseDist::from_weights(weights))
}

/// How sure the draft was of `token`, which it drew from `q` over `logits`: its probability under `q`,
/// or, when `q` puts all its mass on it (greedy decoding, `top_k` 1), under the softmax of `logits` at
/// temperature 1. A point mass says nothing about how likely the target is to agree, the softmax does:
/// the draft-length control stops a block early on an unsure token under greedy decoding too.
pub fn confidence(logits: &[f32], q: &SparseDist, token: u32) -> f32 {
    let p = q.prob(token);
    if p < 1.0 {
        return p as f32;
    }
    let Some(&at) = logits.get(token as usize).filter(|l| l.is_finite()) else { return 1.0 };
    // Runs at every draft step over the whole vocabulary (152k entries for Qwen), so both passes work
    // in 8 independent lanes, which the compiler turns into SIMD ([`crate::fastmath::exp`]); libm's
    // `expf`, one call per entry, cost ~2% of a 0.5B draft step.
    const LANES: usize = 8;
    let finite_or = |l: f32, otherwise: f32| if l.is_finite() { l } else { otherwise };
    let (chunks, rest) = logits.as_chunks::<LANES>();
    let mut lane_max = [at; LANES];
    for chunk in chunks {
        for (m, &l) in lane_max.iter_mut().zip(chunk) {
            *m = m.max(finite_or(l, at));
        }
    }
    let max = lane_max.into_iter().chain(rest.iter().map(|&l| finite_or(l, at))).fold(at, f32::max);
    let weight = |l: f32| if l.is_finite() { crate::fastmath::exp(l - max) } else { 0.0 };
    let mut lane_sum = [0f32; LANES];
    for chunk in chunks {
        for (s, &l) in lane_sum.iter_mut().zip(chunk) {
            *s += weight(l);
        }
    }
    let total: f64 =
        lane_sum.into_iter().chain(rest.iter().map(|&l| weight(l))).map(f64::from).sum();
    (f64::from(crate::fastmath::exp(at - max)) / total) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_is_q_or_under_a_point_mass_the_softmax() {
        let logits = [2.0f32, 1.0, f32::NEG_INFINITY, 0.0];
        let sampled = distribution(&logits, &params(1.0, 0, 1.0, 0.0)).unwrap();
        assert_eq!(confidence(&logits, &sampled, 1), sampled.prob(1) as f32);
        let greedy = distribution(&logits, &SamplingParams::greedy()).unwrap();
        let e = |x: f32| x.exp();
        let softmax = e(0.0) / (e(0.0) + e(-1.0) + e(-2.0));
        assert!((confidence(&logits, &greedy, 0) - softmax).abs() < 1e-6);
        // Not a token of the logits (a forced token): no information beyond q.
        assert_eq!(confidence(&logits, &SparseDist::point(2), 2), 1.0);
        assert_eq!(confidence(&logits, &SparseDist::point(9), 9), 1.0);
    }

    #[test]
    fn confidence_over_a_vocabulary_matches_the_f64_softmax() {
        // Not a multiple of the lanes, with masked entries and the argmax in the remainder.
        let mut logits: Vec<f32> =
            (0..1_003).map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0).collect();
        logits[17] = f32::NEG_INFINITY;
        logits[1_001] = 11.0;
        let reference = softmax(&logits, 1.0);
        for token in [1_001u32, 0, 500] {
            let got = confidence(&logits, &SparseDist::point(token), token) as f64;
            let want = reference[token as usize];
            assert!((got - want).abs() < 1e-6 * want.max(1e-3), "token {token}: {got} vs {want}");
        }
    }

    #[test]
    fn draft_sampling_caps_top_k_only() {
        let p = SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 0, min_p: 0.05 };
        assert_eq!(p.for_draft(32), SamplingParams { top_k: 32, ..p });
        assert_eq!(SamplingParams { top_k: 5, ..p }.for_draft(32).top_k, 5);
        assert_eq!(SamplingParams::greedy().for_draft(32), SamplingParams::greedy());
        assert_eq!(p.for_draft(0), p);
    }
    use proptest::prelude::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p }
    }

    fn mass_sum(d: &SparseDist) -> f64 {
        d.entries().iter().map(|&(_, p)| p as f64).sum()
    }

    /// Full softmax at temperature t, as f64, for reference.
    fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / t).exp()).collect();
        let s: f64 = w.iter().sum();
        w.into_iter().map(|x| x / s).collect()
    }

    #[test]
    fn greedy_is_point_mass_at_lowest_argmax() {
        let d =
            distribution(&[1.0, 3.0, 3.0, f32::NEG_INFINITY], &SamplingParams::greedy()).unwrap();
        assert_eq!(d.entries(), &[(1, 1.0)]);
    }

    #[test]
    fn plain_temperature_is_softmax() {
        let logits = [0.5, -1.0, 2.0, 0.0];
        let d = distribution(&logits, &params(0.7, 0, 1.0, 0.0)).unwrap();
        for (t, want) in softmax(&logits, 0.7).into_iter().enumerate() {
            assert!((d.prob(t as u32) - want).abs() < 1e-6);
        }
    }

    #[test]
    fn rejects_bad_params_and_logits() {
        let l = [0.0, 1.0];
        assert!(matches!(
            distribution(&l, &params(-0.1, 0, 1.0, 0.0)),
            Err(SamplingError::InvalidParam { name: "temperature", .. })
        ));
        assert!(matches!(
            distribution(&l, &params(2.5, 0, 1.0, 0.0)),
            Err(SamplingError::InvalidParam { name: "temperature", .. })
        ));
        assert!(matches!(
            distribution(&l, &params(f32::NAN, 0, 1.0, 0.0)),
            Err(SamplingError::InvalidParam { .. })
        ));
        assert!(matches!(
            distribution(&l, &params(1.0, 0, 0.0, 0.0)),
            Err(SamplingError::InvalidParam { name: "top_p", .. })
        ));
        assert!(matches!(
            distribution(&l, &params(1.0, 0, 1.0, 1.5)),
            Err(SamplingError::InvalidParam { name: "min_p", .. })
        ));
        assert_eq!(
            distribution(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0, 0.0)),
            Err(SamplingError::NoFiniteLogit)
        );
        assert!(matches!(
            distribution(&[0.0, f32::NAN], &params(1.0, 0, 1.0, 0.0)),
            Err(SamplingError::InvalidLogit { token: 1, .. })
        ));
        assert!(matches!(
            distribution(&[], &SamplingParams::greedy()),
            Err(SamplingError::NoFiniteLogit)
        ));
    }

    #[test]
    fn top_p_keeps_smallest_prefix() {
        // probs 0.5, 0.3, 0.2 -> top_p 0.8 keeps exactly the first two.
        let logits = [0.5f64.ln() as f32, 0.3f64.ln() as f32, 0.2f64.ln() as f32];
        let d = distribution(&logits, &params(1.0, 0, 0.75, 0.0)).unwrap();
        assert_eq!(d.len(), 2);
        assert!((d.prob(0) - 0.625).abs() < 1e-6);
    }

    proptest! {
        #[test]
        fn transforms_give_a_normalised_distribution(
            logits in prop::collection::vec(-10.0f32..10.0, 1..200),
            temperature in 0.5f32..2.0,
            top_k in 0u32..50,
            top_p in 0.05f32..=1.0,
            min_p in 0.0f32..0.5,
        ) {
            let p = params(temperature, top_k, top_p, min_p);
            let d = distribution(&logits, &p).unwrap();
            prop_assert!((mass_sum(&d) - 1.0).abs() < 1e-5);
            prop_assert!(d.entries().iter().all(|&(t, q)| q > 0.0 && (t as usize) < logits.len()));
            // The argmax always survives.
            let argmax = distribution(&logits, &SamplingParams::greedy()).unwrap().argmax();
            prop_assert!(d.prob(argmax) > 0.0);
        }

        #[test]
        fn top_k_keeps_exactly_k(logits in prop::collection::vec(-10.0f32..10.0, 1..200), k in 1u32..60) {
            let d = distribution(&logits, &params(1.0, k, 1.0, 0.0)).unwrap();
            prop_assert_eq!(d.len(), (k as usize).min(logits.len()));
            // Every kept token is at least as likely as every dropped one.
            let kept_min = d.entries().iter().map(|&(t, _)| logits[t as usize]).fold(f32::INFINITY, f32::min);
            for (t, &l) in logits.iter().enumerate() {
                if d.prob(t as u32) == 0.0 { prop_assert!(l <= kept_min); }
            }
        }

        #[test]
        fn top_p_is_minimal(logits in prop::collection::vec(-5.0f32..5.0, 1..100), top_p in 0.05f32..0.999) {
            let d = distribution(&logits, &params(1.0, 0, top_p, 0.0)).unwrap();
            let full = softmax(&logits, 1.0);
            let mut kept: Vec<f64> = d.entries().iter().map(|&(t, _)| full[t as usize]).collect();
            kept.sort_by(|a, b| b.total_cmp(a));
            let mass: f64 = kept.iter().sum();
            prop_assert!(mass >= top_p as f64 - 1e-9, "kept mass {} < top_p {}", mass, top_p);
            // Without its least likely token the kept set would fall short of top_p.
            prop_assert!(mass - kept[kept.len() - 1] < top_p as f64 + 1e-9);
            // Nothing dropped is more likely than anything kept.
            let kept_min = kept[kept.len() - 1];
            for (t, &p) in full.iter().enumerate() {
                if d.prob(t as u32) == 0.0 { prop_assert!(p <= kept_min + 1e-12); }
            }
        }

        #[test]
        fn min_p_drops_only_unlikely(logits in prop::collection::vec(-5.0f32..5.0, 1..100), min_p in 0.01f32..1.0) {
            let d = distribution(&logits, &params(1.0, 0, 1.0, min_p)).unwrap();
            let full = softmax(&logits, 1.0);
            let pmax = full.iter().cloned().fold(0.0, f64::max);
            for (t, &p) in full.iter().enumerate() {
                let kept = d.prob(t as u32) > 0.0;
                if p >= min_p as f64 * pmax * (1.0 + 1e-6) { prop_assert!(kept); }
                if p < min_p as f64 * pmax * (1.0 - 1e-6) { prop_assert!(!kept); }
            }
        }
    }

    /// The nucleus found by partial selection is the one a full sort finds, entry for entry,
    /// whether it is short (peaked logits) or most of the vocabulary (flat ones).
    #[test]
    fn top_p_by_partial_selection_equals_a_full_sort() {
        let full_sort = |logits: &[f32], p: &SamplingParams| -> Vec<u32> {
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let inv_t = 1.0 / p.temperature as f64;
            let mut w: Vec<(u32, f64)> = logits
                .iter()
                .enumerate()
                .map(|(t, &l)| (t as u32, ((l as f64 - max) * inv_t).exp()))
                .collect();
            let total: f64 = w.iter().map(|x| x.1).sum();
            w.sort_unstable_by(by_weight_desc);
            let mut acc = 0.0;
            let keep = w.iter().position(|x| {
                acc += x.1;
                acc >= p.top_p as f64 * total
            });
            w.truncate(keep.map_or(w.len(), |i| i + 1));
            let mut kept: Vec<u32> = w.into_iter().map(|x| x.0).collect();
            kept.sort_unstable();
            kept
        };
        let mut state = 12345u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for (spread, top_p) in [(12.0, 0.9), (12.0, 0.5), (0.5, 0.95), (0.01, 0.999), (3.0, 0.99)] {
            let mut logits: Vec<f32> = (0..20_000).map(|_| next() * spread).collect();
            logits[7] = logits[8]; // a tie
            let p = params(1.0, 0, top_p, 0.0);
            let kept: Vec<u32> =
                distribution(&logits, &p).unwrap().entries().iter().map(|e| e.0).collect();
            let want = full_sort(&logits, &p);
            assert_eq!(kept, want, "spread {spread}, top_p {top_p}");
            assert!(!kept.is_empty());
        }
    }
}
