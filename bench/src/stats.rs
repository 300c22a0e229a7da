//! Medians and ranges over repetitions. Timings on a shared 2-core machine are noisy; a median of
//! the repetitions, with the range beside it, says both what is typical and how much it moved.

use serde::Serialize;

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
/// NaNs sort last and so only matter if they are the majority.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

/// A figure measured once per repetition.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub reps: usize,
}

impl Spread {
    pub fn of(values: &[f64]) -> Option<Self> {
        Some(Self {
            median: median(values)?,
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            reps: values.len(),
        })
    }
}

/// `num / den`, or `None` when the denominator is 0 (a ratio of nothing is not 0).
pub fn ratio(num: f64, den: f64) -> Option<f64> {
    (den != 0.0).then(|| num / den)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn spread_keeps_the_range() {
        let s = Spread::of(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.reps), (3.0, 1.0, 5.0, 3));
        assert!(Spread::of(&[]).is_none());
    }

    #[test]
    fn ratio_refuses_zero_denominators() {
        assert_eq!(ratio(1.0, 4.0), Some(0.25));
        assert_eq!(ratio(1.0, 0.0), None);
    }
}
