//! The verifier's time by block size: measured per size from its calls ([`crate::pass_times`]), seeded
//! from the verifier's own pass times, and a decayed least-squares line `a + b * rows` for the sizes
//! not seen yet.

use crate::pass_times::Gains;

use super::estimates::{Estimates, MAX_SAMPLE_S, TIME_GAIN};
use super::MAX_POSITIONS;

/// Per-observation decay of the verifier-time fit's sums (a memory of ~20 calls): slower than [`TIME_GAIN`]
/// because a two-parameter fit needs a few distinct block sizes in its memory, while calls of one size vary
/// by ±25% on a shared host (measured: see docs/benchmarks.md, adaptive draft length).
const FIT_DECAY: f64 = 0.95;
/// Pull of the fitted per-row time towards its previous value, in observations' weight. It makes the fit fall
/// back to the previous (at first, prior) `b` when all remembered blocks have the same size, and is negligible otherwise.
const FIT_RIDGE: f64 = 0.05;
/// A verifier-time sample is read at most this factor off its block size's modelled time either way: a
/// size timed during a slow stretch of a shared host, then left, must not keep that time; a verifier that
/// got 50% slower is still believed within about ten calls (measured: see docs/benchmarks.md, adaptive
/// draft length).
const MAX_VERIFY_SAMPLE_RATIO: f64 = 1.15;
/// How the verifier's time by block size is learnt ([`crate::pass_times`]): a call moves the pace every
/// size shares at [`TIME_GAIN`] and its own size's time at 0.05, so a size that met a few slow calls does
/// not look costly until it is drafted again, which its cost would keep it from (measured: see
/// docs/benchmarks.md, adaptive draft length).
pub(super) const VERIFY_GAINS: Gains =
    Gains { pace: TIME_GAIN, shape: 0.05, max_ratio: MAX_VERIFY_SAMPLE_RATIO };

/// Exponentially decayed sums of the weighted least-squares fit `V(rows) = a + b * rows`.
#[derive(Clone, Debug, Default)]
pub(super) struct Fit {
    pub(super) w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Estimates {
    /// Modelled verifier compute for a block of `rows` scored rows, in seconds: the measured time of that
    /// size where one was seen, interpolated between the nearest sizes seen on either side, and
    /// extrapolated from the nearest with the fit's per-row slope `b` beyond them (the fit `a + b * rows`
    /// alone before any). A verifier's time is not linear in rows: a CPU kernel scores up to 6 rows in one
    /// pass over the weights and 7 in two, so one 7-row block made the fit's slope 70 ms a row where the
    /// blocks of 2-6 rows cost 35-40 more per row, and `auto` kept to 1-2 drafts for dozens of rounds.
    pub fn verify_time(&self, rows: usize) -> f64 {
        let measured = |r: usize| self.verify_by_rows.get(r).map(|v| (r, v));
        let below = (0..=rows.min(self.verify_by_rows.len())).rev().find_map(measured);
        let above = (rows..self.verify_by_rows.len()).find_map(measured);
        let b = self.verify_b_s;
        match (below, above) {
            (Some((r0, v0)), Some((r1, v1))) if r1 > r0 => {
                v0 + (v1 - v0) * (rows - r0) as f64 / (r1 - r0) as f64
            }
            (Some((r0, v0)), _) => v0 + b * (rows - r0) as f64,
            (None, Some((r1, v1))) => (v1 - b * (r1 - rows) as f64).max(0.0),
            (None, None) => self.verify_a_s + b * rows as f64,
        }
    }

    /// Adds `(rows, seconds)` to the verifier's time for blocks of `rows` (see [`Estimates::verify_time`]).
    pub(super) fn measure_verify(&mut self, rows: usize, seconds: f64) {
        if rows <= MAX_POSITIONS + 1 {
            self.verify_by_rows.observe(rows, seconds);
        }
    }

    /// Adds `(rows, seconds)` to the decayed least-squares fit of `V` and refits `a, b >= 0`.
    pub(super) fn fit_verify(&mut self, rows: f64, seconds: f64) {
        self.fit.decay();
        self.fit.add(rows, seconds);
        (self.verify_a_s, self.verify_b_s) = self.fit.solve(self.verify_b_s);
    }

    /// Takes the verifier's own pass times (`/v1/info`'s `pass_ms` in seconds: entry `i` for `i + 1`
    /// rows) as what this gateway has not measured yet: block sizes it has not timed take them, and a
    /// fit that has seen no call starts from them, as if they had been observed. Without them a fresh
    /// gateway starts from the prior `V(rows) = 80 ms + 8 ms * rows`, about right for a GPU, while a CPU
    /// verifier's block costs ~40 ms a row: `auto` then sent blocks of 5-7 drafts at RTT 0 for the dozen
    /// rounds its fit took to learn the slope, ~15% of a 128-token generation's time. Calling it again
    /// (each health check) changes nothing the gateway has measured. Returns how many sizes it seeded.
    ///
    /// The times are taken as never falling with rows (their closest such fit, [`never_falling`]): a pass
    /// of more rows does all the work of one of fewer, and a verifier's times that fall are noise of its
    /// timing, which would make a block look cheaper than both its neighbours (measured: see
    /// docs/benchmarks.md, adaptive draft length).
    pub fn seed_verifier_passes(&mut self, pass_s: &[f64]) -> usize {
        let timed: Vec<(usize, f64)> = pass_s
            .iter()
            .take(MAX_POSITIONS + 1)
            .enumerate()
            .filter(|(_, s)| s.is_finite() && **s > 0.0 && **s <= MAX_SAMPLE_S)
            .map(|(i, &s)| (i + 1, s))
            .collect();
        let timed = never_falling(timed);
        let mut seeded = 0;
        for &(rows, seconds) in &timed {
            if self.verify_by_rows.observe_if_untimed(rows, seconds) {
                seeded += 1;
            }
        }
        if self.fit.w == 0.0 {
            for &(rows, seconds) in &timed {
                self.fit.add(rows as f64, seconds);
            }
            if self.fit.w > 0.0 {
                (self.verify_a_s, self.verify_b_s) = self.fit.solve(self.verify_b_s);
            }
        }
        seeded
    }
}

/// The closest values (least squares) to `points`' that never fall from one point to the next: each run
/// of points that falls is replaced by its mean (pool adjacent violators). Points in order of `rows`.
fn never_falling(points: Vec<(usize, f64)>) -> Vec<(usize, f64)> {
    // Runs of pooled points: (mean, count).
    let mut runs: Vec<(f64, usize)> = Vec::with_capacity(points.len());
    for &(_, value) in &points {
        let mut run = (value, 1);
        while let Some((mean, count)) = runs.last().copied().filter(|&(mean, _)| mean > run.0) {
            runs.pop();
            run = (
                (mean * count as f64 + run.0 * run.1 as f64) / (count + run.1) as f64,
                count + run.1,
            );
        }
        runs.push(run);
    }
    let means = runs.into_iter().flat_map(|(mean, count)| std::iter::repeat_n(mean, count));
    points.iter().zip(means).map(|(&(rows, _), mean)| (rows, mean)).collect()
}

impl Fit {
    fn decay(&mut self) {
        for s in [&mut self.w, &mut self.x, &mut self.y, &mut self.xx, &mut self.xy] {
            *s *= FIT_DECAY;
        }
    }

    fn add(&mut self, rows: f64, seconds: f64) {
        self.w += 1.0;
        self.x += rows;
        self.y += seconds;
        self.xx += rows * rows;
        self.xy += rows * seconds;
    }

    /// `(a, b)`, both `>= 0`, of the weighted least-squares line, pulled towards `previous_b` by [`FIT_RIDGE`].
    fn solve(&self, previous_b: f64) -> (f64, f64) {
        let (mean_x, mean_y) = (self.x / self.w, self.y / self.w);
        let sxx = (self.xx - self.x * mean_x).max(0.0);
        let sxy = self.xy - self.x * mean_y;
        let mut b = (sxy + FIT_RIDGE * previous_b) / (sxx + FIT_RIDGE);
        let mut a = mean_y - b * mean_x;
        if b < 0.0 {
            (a, b) = (mean_y, 0.0);
        }
        if a < 0.0 {
            (a, b) = (0.0, (self.xy / self.xx).max(0.0));
        }
        (a, b)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::draft_control::estimates::{Rate, RoundObservation};
    use crate::draft_control::round_model::BlockKind;
    use crate::draft_control::testing::{close, est};
    use crate::draft_control::DraftController;

    #[test]
    fn verifier_time_fit_recovers_a_and_b_and_keeps_b_when_rows_never_vary() {
        let mut e = Estimates::default();
        for drafted in [0, 3, 7, 1, 5, 2, 6, 4, 0, 8].into_iter().cycle().take(40) {
            let v = 0.05 + 0.012 * (drafted + 1) as f64;
            e.observe(&RoundObservation {
                drafted,
                accepted: drafted,
                verifier_time: Some(Duration::from_secs_f64(v)),
                ..Default::default()
            });
        }
        assert!((e.verify_a_s - 0.05).abs() < 1e-6 && (e.verify_b_s - 0.012).abs() < 1e-7, "{e:?}");
        let mut same = Estimates::default();
        for _ in 0..20 {
            same.observe(&RoundObservation {
                drafted: 4,
                verifier_time: Some(Duration::from_millis(200)),
                ..Default::default()
            });
        }
        assert!(
            close(same.verify_b_s, 0.008) && close(same.verify_a_s, 0.2 - 5.0 * 0.008),
            "{same:?}"
        );
    }

    #[test]
    fn the_verifiers_pass_times_seed_what_the_gateway_has_not_measured() {
        // A CPU verifier: 10 ms + 40 ms a row, as /v1/info reports it for 1-9 rows.
        let cpu: Vec<f64> = (1..=9).map(|rows| 0.010 + 0.040 * rows as f64).collect();
        let mut e = Estimates { alpha: vec![Rate::prior(0.8)], rtt_s: 0.0, ..Estimates::default() };
        let prior_choice = DraftController::new(8, true, e.clone()).choice().draft_ahead;
        assert_eq!(e.seed_verifier_passes(&cpu), 9);
        // The fit is pulled a little towards the prior slope (FIT_RIDGE).
        assert!(
            (e.verify_a_s - 0.010).abs() < 2e-4 && (e.verify_b_s - 0.040).abs() < 1e-4,
            "{e:?}"
        );
        assert!(close(e.verify_time(5), 0.210) && (e.verify_time(12) - 0.490).abs() < 1e-3);
        // The prior (8 ms a row) sends long blocks at RTT 0; the verifier's own times do not.
        let seeded_choice = DraftController::new(8, true, e.clone()).choice().draft_ahead;
        assert!(seeded_choice < prior_choice, "prior {prior_choice}, seeded {seeded_choice}");
        // What the gateway measured stays; a later seed fills only sizes it has not timed.
        e.observe(&RoundObservation {
            drafted: 1,
            accepted: 1,
            verifier_time: Some(Duration::from_millis(150)),
            ..Default::default()
        });
        let (measured, a, b) = (e.verify_time(2), e.verify_a_s, e.verify_b_s);
        assert_eq!(e.seed_verifier_passes(&[0.5; 9]), 0);
        assert!(
            close(e.verify_time(2), measured)
                && close(e.verify_time(3), 0.130 * e.verify_by_rows.pace()),
            "{e:?}"
        );
        assert!(close(e.verify_a_s, a) && close(e.verify_b_s, b));
        // Nonsense entries are skipped, not learned.
        let mut odd = Estimates::default();
        assert_eq!(odd.seed_verifier_passes(&[f64::NAN, -1.0, 0.0, f64::INFINITY, 1e9]), 0);
        assert!(
            odd.verify_by_rows.is_empty() && odd.fit.w == 0.0 && close(odd.verify_b_s, 0.008),
            "{odd:?}"
        );
    }

    #[test]
    fn the_verifiers_pass_times_are_seeded_as_never_falling_with_rows() {
        let fit = |values: &[f64]| {
            never_falling(values.iter().enumerate().map(|(i, &v)| (i + 1, v)).collect())
                .into_iter()
                .map(|(_, v)| v)
                .collect::<Vec<_>>()
        };
        assert_eq!(fit(&[1.0, 2.0, 2.0, 3.0]), vec![1.0, 2.0, 2.0, 3.0]);
        assert_eq!(fit(&[1.0, 4.0, 2.0, 3.0, 5.0]), vec![1.0, 3.0, 3.0, 3.0, 5.0]);
        assert_eq!(fit(&[3.0, 2.0, 1.0]), vec![2.0, 2.0, 2.0]);
        assert!(fit(&[]).is_empty());
        // A verifier's pass times as one benchmark gateway was seeded with them (milliseconds).
        let mut e = Estimates::default();
        let seeded: Vec<f64> = [95.0, 161.0, 244.0, 231.0, 322.0, 399.0, 479.0, 457.0, 493.0]
            .map(|ms| ms / 1e3)
            .to_vec();
        assert_eq!(e.seed_verifier_passes(&seeded), 9);
        let v: Vec<f64> = (1..=9).map(|rows| e.verify_time(rows)).collect();
        assert!(
            close(v[2], 0.2375) && close(v[3], 0.2375) && close(v[6], 0.468) && close(v[7], 0.468),
            "{v:?}"
        );
        assert!(close(v[0], 0.095) && close(v[4], 0.322) && close(v[8], 0.493), "{v:?}");
        // Skipped entries leave the sizes around them in order of rows.
        let mut gaps = Estimates::default();
        assert_eq!(gaps.seed_verifier_passes(&[0.1, f64::NAN, 0.3, 0.2]), 3);
        assert!(
            close(gaps.verify_time(3), 0.25)
                && close(gaps.verify_time(4), 0.25)
                && close(gaps.verify_time(2), 0.175),
            "{gaps:?}"
        );
    }

    #[test]
    fn one_slow_call_does_not_make_its_block_size_costly_for_good() {
        let mut e = Estimates::default();
        e.seed_verifier_passes(&[0.05, 0.10, 0.15, 0.16, 0.17]);
        let slow = RoundObservation {
            drafted: 4,
            accepted: 4,
            verifier_time: Some(Duration::from_millis(250)),
            ..Default::default()
        };
        e.observe(&slow);
        // Read as 15% over the size's time, not 47%, and mostly as the verifier's pace: every size
        // moves about as much, so the slow size does not look costlier than its neighbours.
        let pace = 1.0 + TIME_GAIN * 0.15;
        assert!(
            close(e.verify_by_rows.pace(), pace) && close(e.verify_time(4), 0.16 * pace),
            "{e:?}"
        );
        assert!(e.verify_time(5) > 0.17 * pace && e.verify_time(5) < 0.17 * pace * 1.01, "{e:?}");
        // A verifier that stays slower is believed within a few more calls.
        for _ in 0..8 {
            e.observe(&slow);
        }
        assert!(e.verify_time(5) > 0.235, "{}", e.verify_time(5));
    }

    #[test]
    fn a_block_size_that_met_slow_calls_is_not_left_costlier_than_its_neighbours() {
        // 3 and 5 rows cost what they were seeded with; 4 rows met two calls 40% slow (a busy host),
        // then only the other sizes are drafted, at their normal times.
        let mut e = Estimates::default();
        e.seed_verifier_passes(&[0.10, 0.16, 0.21, 0.25, 0.29]);
        let call = |e: &mut Estimates, drafted: usize, seconds: f64| {
            e.observe(&RoundObservation {
                drafted,
                accepted: drafted,
                verifier_time: Some(Duration::from_secs_f64(seconds)),
                ..Default::default()
            })
        };
        call(&mut e, 3, 0.35);
        call(&mut e, 3, 0.35);
        for _ in 0..20 {
            call(&mut e, 2, 0.21);
            call(&mut e, 4, 0.29);
        }
        // 4 rows is read within 2% of its true 250 ms, between its neighbours, not the 9% over it that
        // its own calls alone left it at while it was not drafted.
        let v: Vec<f64> = (1..=5).map(|rows| e.verify_time(rows)).collect();
        assert!((v[3] / 0.25 - 1.0).abs() < 0.02 && v[2] < v[3] && v[3] < v[4], "{v:?}");
    }

    #[test]
    fn a_costlier_block_size_does_not_make_the_sizes_below_it_look_costly() {
        // A CPU verifier: one pass over the weights up to 6 rows (200 ms + 40 ms a row), two beyond.
        let v = |rows: usize| 0.2 + 0.04 * rows as f64 + if rows > 6 { 0.25 } else { 0.0 };
        let observe = |e: &mut Estimates, drafted: usize| {
            e.observe(&RoundObservation {
                drafted,
                accepted: drafted,
                verifier_time: Some(Duration::from_secs_f64(v(drafted + 1))),
                ..Default::default()
            })
        };
        let mut e = est(0.95, 30.0, 0.0, 80.0, 8.0);
        for drafted in [2, 6, 2, 2, 3] {
            observe(&mut e, drafted);
        }
        // Sizes seen are their own measurements; between them, interpolated; beyond, the fit's slope.
        assert!(close(e.verify_time(3), v(3)) && close(e.verify_time(7), v(7)), "{e:?}");
        assert!(close(e.verify_time(5), v(4) + (v(7) - v(4)) / 3.0), "{}", e.verify_time(5));
        assert!(
            close(e.verify_time(9), v(7) + 2.0 * e.verify_b_s)
                && close(e.verify_time(1), v(3) - 2.0 * e.verify_b_s)
        );
        // Once every size is seen, the choice is the longest block of one pass (hand-computed with
        // alpha 0.95: 10.18 tokens/s at d = 5, 7.26 at d = 6).
        for drafted in (1..=6).cycle().take(30) {
            observe(&mut e, drafted);
        }
        let e = Estimates { alpha: vec![Rate::prior(0.95)], ..e };
        assert_eq!(
            DraftController::with_estimates(8, true, e.clone()).choose(BlockKind::Serial),
            5,
            "{e:?}"
        );
    }
}
