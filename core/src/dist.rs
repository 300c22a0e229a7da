//! Sparse probability distributions over token ids.
//!
//! Both sides of the protocol use this one type: the draft samples from a `SparseDist` and sends exactly
//! its entries as q; the verifier builds p as a `SparseDist` from the target's logits. Sampling uses the
//! stored `f32` values (normalised by their `f64` sum), so what is sent is exactly what was drawn from.

use thiserror::Error;

/// How far the sum of a distribution may stray from 1 (f32 rounding over a 150k-token vocabulary).
pub const SUM_TOLERANCE: f64 = 1e-3;

/// Units of a quantised distribution: every probability a multiple of 1/4096. Exact in `f32`, so
/// a quantised q drawn from, sent as counts and rebuilt on the verifier is the same q.
pub const Q_UNITS: u32 = 4096;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum DistError {
    #[error("distribution is empty")]
    Empty,
    #[error("probability of token {token} is {prob}: must be finite and non-negative")]
    InvalidProb { token: u32, prob: f32 },
    #[error("token {token} appears more than once")]
    Duplicate { token: u32 },
    #[error("token {token} is outside the vocabulary of {vocab_size} tokens")]
    OutOfVocab { token: u32, vocab_size: u32 },
    #[error("probabilities sum to {sum}, not 1 (tolerance {SUM_TOLERANCE})")]
    NotNormalized { sum: f64 },
}

/// A probability distribution on its support: `(token, prob)` entries sorted by token id, every prob > 0,
/// summing to 1 within [`SUM_TOLERANCE`].
#[derive(Debug, Clone, PartialEq)]
pub struct SparseDist {
    entries: Vec<(u32, f32)>,
    total: f64,
}

impl SparseDist {
    /// Validates and builds a distribution from entries in any order. Zero entries are dropped
    /// (a token of probability 0 is outside the support). `vocab_size`, when given, bounds the ids.
    pub fn new(mut entries: Vec<(u32, f32)>, vocab_size: Option<u32>) -> Result<Self, DistError> {
        for &(token, prob) in &entries {
            if !prob.is_finite() || prob < 0.0 {
                return Err(DistError::InvalidProb { token, prob });
            }
            if let Some(vocab_size) = vocab_size {
                if token >= vocab_size {
                    return Err(DistError::OutOfVocab { token, vocab_size });
                }
            }
        }
        entries.retain(|&(_, p)| p > 0.0);
        if entries.is_empty() {
            return Err(DistError::Empty);
        }
        entries.sort_unstable_by_key(|&(t, _)| t);
        if let Some(w) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(DistError::Duplicate { token: w[0].0 });
        }
        let total: f64 = entries.iter().map(|&(_, p)| p as f64).sum();
        if (total - 1.0).abs() > SUM_TOLERANCE {
            return Err(DistError::NotNormalized { sum: total });
        }
        Ok(Self { entries, total })
    }

    /// Builds from unnormalised non-negative weights (already validated by the caller's arithmetic),
    /// normalising them to sum to 1.
    pub(crate) fn from_weights(weights: Vec<(u32, f64)>) -> Self {
        let sum: f64 = weights.iter().map(|&(_, w)| w).sum();
        let mut entries: Vec<(u32, f32)> = weights
            .into_iter()
            .map(|(t, w)| (t, (w / sum) as f32))
            .filter(|&(_, p)| p > 0.0)
            .collect();
        entries.sort_unstable_by_key(|&(t, _)| t);
        let total = entries.iter().map(|&(_, p)| p as f64).sum();
        Self { entries, total }
    }

    /// All mass on one token (greedy decoding).
    pub fn point(token: u32) -> Self {
        Self { entries: vec![(token, 1.0)], total: 1.0 }
    }

    /// Entries sorted by token id.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Normalised probability of `token` (0 outside the support).
    pub fn prob(&self, token: u32) -> f64 {
        match self.entries.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.entries[i].1 as f64 / self.total,
            Err(_) => 0.0,
        }
    }

    /// The most probable token; ties go to the lowest id.
    pub fn argmax(&self) -> u32 {
        let mut best = self.entries[0];
        for &e in &self.entries[1..] {
            if e.1 > best.1 {
                best = e;
            }
        }
        best.0
    }

    /// Inverse-CDF sample for a uniform `u` in [0, 1). Never returns a token outside the support.
    pub fn sample(&self, u: f64) -> u32 {
        let target = u * self.total;
        let mut acc = 0.0;
        for &(token, p) in &self.entries {
            acc += p as f64;
            if target < acc {
                return token;
            }
        }
        self.entries[self.entries.len() - 1].0
    }

    /// The nearest distribution whose probabilities are multiples of 1/[`Q_UNITS`] (largest
    /// remainder rounding; ties to the lower id). Entries that round to 0 leave the support, so what
    /// is drawn from and sent is small and exact; a dropped entry costs at most 1/4096 of acceptance.
    pub fn quantized(&self) -> Self {
        let units = Q_UNITS as f64;
        let scaled: Vec<(u32, f64)> =
            self.entries.iter().map(|&(t, p)| (t, p as f64 / self.total * units)).collect();
        let mut counts: Vec<(u32, u32)> =
            scaled.iter().map(|&(t, x)| (t, x.floor() as u32)).collect();
        let short = Q_UNITS - counts.iter().map(|c| c.1).sum::<u32>();
        let mut by_remainder: Vec<usize> = (0..scaled.len()).collect();
        by_remainder.sort_by(|&a, &b| {
            (scaled[b].1 - scaled[b].1.floor())
                .total_cmp(&(scaled[a].1 - scaled[a].1.floor()))
                .then(a.cmp(&b))
        });
        for &i in by_remainder.iter().take(short as usize) {
            counts[i].1 += 1;
        }
        Self::from_counts(counts)
    }

    /// Probabilities `count / Q_UNITS` from counts summing to [`Q_UNITS`] (zero counts dropped).
    fn from_counts(counts: Vec<(u32, u32)>) -> Self {
        let entries: Vec<(u32, f32)> = counts
            .into_iter()
            .filter(|c| c.1 > 0)
            .map(|(t, c)| (t, c as f32 / Q_UNITS as f32))
            .collect();
        Self { entries, total: 1.0 }
    }

    /// The counts of a quantised distribution (None if some probability is not a multiple of 1/4096).
    pub fn counts(&self) -> Option<Vec<(u32, u32)>> {
        let counts: Vec<(u32, u32)> = self
            .entries
            .iter()
            .map(|&(t, p)| {
                let c = p * Q_UNITS as f32;
                (c.fract() == 0.0 && c >= 1.0).then_some((t, c as u32))
            })
            .collect::<Option<_>>()?;
        (counts.iter().map(|c| c.1).sum::<u32>() == Q_UNITS).then_some(counts)
    }

    /// The `n` most probable entries, most probable first (ties: lowest id first).
    pub fn top(&self, n: usize) -> Vec<(u32, f32)> {
        let mut v = self.entries.clone();
        v.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_malformed() {
        assert_eq!(SparseDist::new(vec![], None), Err(DistError::Empty));
        assert_eq!(SparseDist::new(vec![(1, 0.0)], None), Err(DistError::Empty));
        assert!(matches!(
            SparseDist::new(vec![(1, f32::NAN)], None),
            Err(DistError::InvalidProb { .. })
        ));
        assert!(matches!(
            SparseDist::new(vec![(1, f32::INFINITY)], None),
            Err(DistError::InvalidProb { .. })
        ));
        assert!(matches!(
            SparseDist::new(vec![(1, -0.5), (2, 1.5)], None),
            Err(DistError::InvalidProb { .. })
        ));
        assert_eq!(
            SparseDist::new(vec![(3, 0.5), (3, 0.5)], None),
            Err(DistError::Duplicate { token: 3 })
        );
        assert!(matches!(
            SparseDist::new(vec![(1, 0.5), (2, 0.4)], None),
            Err(DistError::NotNormalized { .. })
        ));
        assert_eq!(
            SparseDist::new(vec![(10, 1.0)], Some(10)),
            Err(DistError::OutOfVocab { token: 10, vocab_size: 10 })
        );
    }

    #[test]
    fn quantised_distributions_are_exact_multiples_and_close() {
        let d = SparseDist::new(vec![(1, 0.5), (4, 0.3), (9, 0.1999), (12, 0.0001)], None).unwrap();
        let q = d.quantized();
        let counts = q.counts().unwrap();
        assert_eq!(counts.iter().map(|c| c.1).sum::<u32>(), Q_UNITS);
        assert_eq!(
            counts.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![1, 4, 9],
            "0.0001 rounds to no units"
        );
        for &(t, _) in q.entries() {
            assert!((q.prob(t) - d.prob(t)).abs() <= 1.0 / Q_UNITS as f64);
        }
        assert_eq!(q.quantized(), q, "quantising is idempotent");
        assert_eq!(SparseDist::from_counts(counts), q);
        assert_eq!(SparseDist::point(3).counts(), Some(vec![(3, Q_UNITS)]));
        assert_eq!(d.counts(), None);
        // Validation accepts it as it is: the sum is exactly 1.
        assert_eq!(SparseDist::new(q.entries().to_vec(), None).unwrap(), q);
    }

    #[test]
    fn lookup_sample_and_top() {
        let d = SparseDist::new(vec![(7, 0.25), (2, 0.5), (9, 0.25)], Some(10)).unwrap();
        assert_eq!(d.entries(), &[(2, 0.5), (7, 0.25), (9, 0.25)]);
        assert_eq!(d.prob(2), 0.5);
        assert_eq!(d.prob(3), 0.0);
        assert_eq!(d.argmax(), 2);
        assert_eq!(d.sample(0.0), 2);
        assert_eq!(d.sample(0.49), 2);
        assert_eq!(d.sample(0.5), 7);
        assert_eq!(d.sample(0.999_999), 9);
        assert_eq!(d.top(2), vec![(2, 0.5), (7, 0.25)]);
    }
}
