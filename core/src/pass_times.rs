//! A forward pass's time by the rows it scores, learnt as each size's own time times a pace all share.
//!
//! The verifier publishes its pass times this way ([`crate::batching::PassTimes`]) and a gateway models
//! the verifier's cost this way ([`crate::draft_control::Estimates::verify_time`]). A shared host's slow
//! stretches and the load of other work move every size alike, while which sizes are timed follows what
//! gateways draft. Learnt apart, the sizes timed lately followed the host and the others kept their old
//! times (a gateway was once seeded with 3 rows costing more than 4), and a size that met a few slow
//! calls looked costlier than its neighbours for as long as that kept it from being drafted, which
//! left `auto` behind a fixed length (measured: see docs/benchmarks.md, adaptive draft length).

/// How fast a [`PacedTimes`] learns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gains {
    /// Weight of a pass in the pace every size shares.
    pub pace: f64,
    /// Weight of a pass in its own size's time, relative to the others: below `pace`, so that a host
    /// that slows while one size is timed moves every size's time.
    pub shape: f64,
    /// A pass is read as at most this factor off its size's modelled time either way.
    pub max_ratio: f64,
}

/// Times by rows: a size's own time at pace 1 (its shape) times the pace.
#[derive(Clone, Debug, PartialEq)]
pub struct PacedTimes {
    /// Seconds at pace 1, indexed by rows; None: never timed.
    shape: Vec<Option<f64>>,
    pace: f64,
    gains: Gains,
}

impl PacedTimes {
    pub fn new(gains: Gains) -> Self {
        Self { shape: Vec::new(), pace: 1.0, gains }
    }

    /// Seconds a pass of `rows` rows takes now; None for a size never timed.
    pub fn get(&self, rows: usize) -> Option<f64> {
        self.shape.get(rows).copied().flatten().map(|shape| shape * self.pace)
    }

    /// One past the most rows timed.
    pub fn len(&self) -> usize {
        self.shape.len()
    }

    /// Whether no size was timed (a size's slot exists only once it is).
    pub fn is_empty(&self) -> bool {
        self.shape.is_empty()
    }

    /// The factor every size's time is read at.
    pub fn pace(&self) -> f64 {
        self.pace
    }

    /// A pass of `rows` rows took `seconds`: the first of a size is its time at the current pace; a later
    /// one moves the pace, and its size's own time by less. Nonsense (not finite, not positive) is skipped.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        if self.shape.len() <= rows {
            self.shape.resize(rows + 1, None);
        }
        match self.shape[rows] {
            None => self.shape[rows] = Some(seconds / self.pace),
            Some(shape) => {
                let modelled = shape * self.pace;
                let seconds =
                    seconds.clamp(modelled / self.gains.max_ratio, modelled * self.gains.max_ratio);
                self.pace += self.gains.pace * (seconds / shape - self.pace);
                self.shape[rows] = Some(shape + self.gains.shape * (seconds / self.pace - shape));
            }
        }
    }

    /// Sets the time of a size never timed, as [`PacedTimes::observe`] does; whether it set one.
    pub fn observe_if_untimed(&mut self, rows: usize, seconds: f64) -> bool {
        let untimed = self.get(rows).is_none();
        if untimed {
            self.observe(rows, seconds);
        }
        untimed && self.get(rows).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GAINS: Gains = Gains { pace: 0.1, shape: 0.02, max_ratio: f64::INFINITY };

    fn timed(ms: &[f64]) -> PacedTimes {
        let mut times = PacedTimes::new(GAINS);
        for (i, ms) in ms.iter().enumerate() {
            times.observe(i + 1, ms / 1e3);
        }
        times
    }

    fn ms(times: &PacedTimes) -> Vec<f64> {
        (1..times.len()).map(|rows| times.get(rows).unwrap_or(f64::NAN) * 1e3).collect()
    }

    #[test]
    fn a_slower_host_moves_every_size_and_a_sizes_own_passes_correct_its_shape() {
        // The host slows by a third while only 5-row passes run: every size follows, mostly through the pace.
        let mut times = timed(&[100.0, 160.0, 210.0, 250.0, 290.0]);
        for _ in 0..60 {
            times.observe(5, 0.290 * 4.0 / 3.0);
        }
        let now = ms(&times);
        assert!((now[4] - 290.0 * 4.0 / 3.0).abs() < 1.0, "{now:?}");
        assert!(now.windows(2).all(|w| w[0] < w[1]) && now[2] > 210.0 * 1.25, "{now:?}");
        // A size timed 10% low at first comes to its passes' time while the others keep theirs.
        let mut times = timed(&[100.0, 160.0, 210.0, 250.0, 290.0]);
        for _ in 0..400 {
            for (rows, ms) in [(2, 160.0), (3, 231.0), (5, 290.0)] {
                times.observe(rows, ms / 1e3);
            }
        }
        let now = ms(&times);
        assert!(
            (now[2] - 231.0).abs() < 3.0
                && (now[1] - 160.0).abs() < 3.0
                && (now[4] - 290.0).abs() < 3.0,
            "{now:?}"
        );
        assert!((now[0] - 100.0).abs() < 5.0 && (now[3] - 250.0).abs() < 10.0, "{now:?}");
    }

    #[test]
    fn a_pass_is_read_at_most_max_ratio_off_and_nonsense_is_skipped() {
        let mut times = PacedTimes::new(Gains { max_ratio: 1.15, ..GAINS });
        times.observe(2, 0.1);
        times.observe(2, 1.0);
        assert!((times.pace() - (1.0 + 0.1 * 0.15)).abs() < 1e-12, "{times:?}");
        let before = times.clone();
        for bad in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            times.observe(2, bad);
            times.observe(3, bad);
        }
        assert_eq!(times, before);
        assert!(PacedTimes::new(GAINS).is_empty() && !times.is_empty());
    }

    #[test]
    fn only_untimed_sizes_take_a_first_time() {
        let mut times = timed(&[100.0]);
        assert!(
            !times.observe_if_untimed(1, 0.5)
                && times.observe_if_untimed(3, 0.3)
                && !times.observe_if_untimed(4, f64::NAN)
        );
        assert_eq!(times.get(1), Some(0.1));
        assert_eq!(times.get(2), None);
        assert_eq!(times.get(3), Some(0.3));
    }
}
