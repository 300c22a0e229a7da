//! What one round showed ([`RoundObservation`]) and the online estimates learnt from it ([`Estimates`]):
//! acceptance by position, pooled and by the draft's confidence, the bonus guess's, and the draft's and
//! the link's times. The verifier's time by block size is learnt in [`super::verify_time`].

use std::time::Duration;

use serde::Serialize;

use super::verify_time::{Fit, VERIFY_GAINS};
use super::MAX_POSITIONS;
use crate::pass_times::PacedTimes;

/// Buckets of the acceptance-by-confidence table, of equal width over `[0, 1]`.
pub(super) const BUCKETS: usize = 10;
/// Weight of a new acceptance outcome (by position, by confidence, bonus guess) once a rate has seen enough
/// (a memory of ~17 outcomes): a faster one let single rejections swing the chosen length where it turns
/// on small differences of `alpha` (measured: see docs/benchmarks.md, adaptive draft length).
const ACCEPT_GAIN: f64 = 0.06;
/// Outcomes a generation's copy of the gateway-wide rates counts theirs as: it learns its own text from
/// there (gains 1/9, 1/10, …), moving half-way to its own rate within ~8 outcomes.
pub(super) const SEED_OUTCOMES: u32 = 4;
/// Outcomes a rate's prior is worth: its first outcomes are averaged with the prior as with this many
/// earlier ones (gains 1/5, 1/6, … down to the rate's constant gain), so a fresh gateway learns a text's
/// acceptance within a few rounds instead of the ~15 a constant gain needs to leave the prior.
const PRIOR_OUTCOMES: f64 = 4.0;
/// Weight of a new outcome in the acceptance pooled over positions once it has seen enough (a memory of
/// ~50 outcomes, 10-15 rounds): it sees every position's outcomes, several a round, so it can average
/// over more of them than one position's rate while following the text as quickly.
const POOLED_GAIN: f64 = 0.02;
/// Outcomes the pooled acceptance counts as in a position's `alpha_i` (against the position's own
/// outcomes): a position with few outcomes reads mostly the pooled rate, and one rejection
/// at a position rarely reached does not decide the length for the rounds after it.
const POOLED_OUTCOMES: f64 = 16.0;
/// Standard errors the pooled acceptance is read above its estimate (see the `draft_control` docs): one made the
/// first blocks of a fresh gateway 8 drafts long where a 6th verify row cost more than the 5th.
const OPTIMISM: f64 = 0.5;
/// Weight of a new timing sample (RTT, draft step): links change abruptly, and 0.3 closes 97% of a step in 10 rounds.
pub(super) const TIME_GAIN: f64 = 0.3;
/// Longest timing sample believed, in seconds: a longer call or draft is an outage, not a round to model.
pub(super) const MAX_SAMPLE_S: f64 = 600.0;
/// A drafting-time sample moves its estimate at most this factor either way: one block that waited on
/// something else (the draft model's prompt processing, another generation's round) must not set the
/// step time for many rounds, which it would when no drafting follows to correct it (a length of 0).
const MAX_DRAFT_SAMPLE_RATIO: f64 = 4.0;
/// Prior of the acceptance pooled over positions (from which each position starts) and of the confidence table.
const ALPHA_PRIOR: f64 = 0.7;

/// What one round showed, reported by the gateway after each `/verify` call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoundObservation {
    /// Tokens in the block sent.
    pub drafted: usize,
    /// Leading drafts the verifier accepted (clamped to `drafted`).
    pub accepted: usize,
    /// The draft's confidence in each drafted token ([`crate::sampling::confidence`]: `q(token)`, or its
    /// softmax probability under greedy decoding); missing or NaN entries are not learned from.
    pub confidences: Vec<f32>,
    /// The draft model's time per token in this block, between its first and last token; zero: not measured.
    pub draft_step: Duration,
    /// The block's time to its first token beyond one step (starting a draft request, catching up on
    /// committed tokens); zero: not measured.
    pub draft_start: Duration,
    /// Wall time of the `/verify` call; zero is not a sample.
    pub call_latency: Duration,
    /// The verifier's own compute time, when it reported one; without it the RTT is latency minus modelled `V`.
    pub verifier_time: Option<Duration>,
    /// `Some(matched)` when a guess of the verifier's token was drafted ahead and all drafts (possibly
    /// none: see [`DraftController`](super::DraftController)'s probe) were accepted.
    pub ahead_guess: Option<bool>,
}

/// Online estimates of the round model's inputs. `Default` holds the priors a fresh gateway starts from:
/// `alpha_i = 0.7`, `beta = 0.6`, `t_draft = 30 ms`, `t_start = 30 ms`, `rtt = 10 ms`, `V(rows) = 80 ms + 8 ms * rows`, and an
/// acceptance by confidence of `(0.7 + bucket centre) / 2`: draft confidence tends to track acceptance, but a
/// fresh gateway should not trust it fully before it has seen outcomes.
#[derive(Clone, Debug, Serialize)]
pub struct Estimates {
    /// `P(position i accepted | all before accepted)` from position `i`'s own outcomes (see [`Estimates::alpha`]).
    pub(super) alpha: Vec<Rate>,
    /// The same over every position's outcomes.
    pub(super) pooled: Rate,
    /// P(the drafted-ahead bonus guess equals the verifier's bonus | all drafts accepted).
    pub(super) beta: Rate,
    /// P(a draft is accepted | all before accepted, its confidence in bucket k).
    pub(super) by_confidence: [Rate; BUCKETS],
    /// The same over every bucket: what a bucket's rate is read against (see [`Estimates::acceptance_at`]).
    pub(super) any_confidence: Rate,
    pub(super) t_draft_s: f64,
    pub(super) t_start_s: f64,
    pub(super) rtt_s: f64,
    pub(super) verify_a_s: f64,
    pub(super) verify_b_s: f64,
    /// RTT samples seen: the first replaces the prior, the next few are averaged with it.
    #[serde(skip)]
    pub(super) rtt_samples: u32,
    /// The verifier's time by scored rows ([`VERIFY_GAINS`](super::verify_time::VERIFY_GAINS)).
    #[serde(skip)]
    pub(super) verify_by_rows: PacedTimes,
    /// Rounds observed, priors excluded.
    pub(super) rounds: u64,
    #[serde(skip)]
    pub(super) fit: Fit,
}

impl Default for Estimates {
    fn default() -> Self {
        let by_confidence = std::array::from_fn(|k| {
            Rate::prior(0.5 * ALPHA_PRIOR + 0.5 * (k as f64 + 0.5) / BUCKETS as f64)
        });
        Self {
            alpha: Vec::new(),
            pooled: Rate::prior(ALPHA_PRIOR),
            beta: Rate::prior(0.6),
            by_confidence,
            any_confidence: Rate::prior(ALPHA_PRIOR),
            t_draft_s: 0.030,
            t_start_s: 0.030,
            rtt_s: 0.010,
            verify_a_s: 0.080,
            verify_b_s: 0.008,
            rtt_samples: 0,
            verify_by_rows: PacedTimes::new(VERIFY_GAINS),
            rounds: 0,
            fit: Fit::default(),
        }
    }
}

/// A probability learned from outcomes: the running average of its first ones (the prior counted as
/// [`PRIOR_OUTCOMES`]), then an exponentially weighted one (gain [`ACCEPT_GAIN`], or the gain given).
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(into = "f64")]
pub(crate) struct Rate {
    pub(crate) value: f64,
    pub(crate) outcomes: u32,
}

impl Rate {
    pub(crate) const fn prior(value: f64) -> Self {
        Self { value, outcomes: 0 }
    }

    /// The rate as a generation's starting point ([`SEED_OUTCOMES`]).
    pub(super) fn as_seed(self) -> Self {
        Self { outcomes: self.outcomes.min(SEED_OUTCOMES), ..self }
    }

    pub(crate) fn learn(&mut self, outcome: f64) {
        self.learn_at(outcome, ACCEPT_GAIN);
    }

    pub(crate) fn learn_at(&mut self, outcome: f64, gain: f64) {
        let gain = (1.0 / (f64::from(self.outcomes) + 1.0 + PRIOR_OUTCOMES)).max(gain);
        self.outcomes = self.outcomes.saturating_add(1);
        ew(&mut self.value, outcome, gain);
    }

    /// The rate plus `z` standard errors of a mean of its outcomes and its prior's (at most 1).
    fn upper(self, z: f64) -> f64 {
        let variance =
            self.value * (1.0 - self.value) / (f64::from(self.outcomes) + PRIOR_OUTCOMES);
        (self.value + z * variance.max(0.0).sqrt()).min(1.0)
    }
}

impl From<Rate> for f64 {
    fn from(rate: Rate) -> f64 {
        rate.value
    }
}

/// Moves `estimate` a `gain` of the way towards `sample`.
fn ew(estimate: &mut f64, sample: f64, gain: f64) {
    *estimate += gain * (sample - *estimate);
}

/// [`ew`] at [`TIME_GAIN`] for a time, with the sample bounded to `max_ratio` of the estimate either way.
fn ew_bounded(estimate: &mut f64, sample: f64, max_ratio: f64) {
    let anchor = estimate.max(1e-4);
    ew(estimate, sample.clamp(anchor / max_ratio, anchor * max_ratio), TIME_GAIN);
}

/// The confidence bucket of `c`, or `None` for NaN.
fn bucket(c: f32) -> Option<usize> {
    (!c.is_nan()).then(|| ((c.clamp(0.0, 1.0) as f64 * BUCKETS as f64) as usize).min(BUCKETS - 1))
}

impl Estimates {
    /// `alpha_i`, the acceptance of draft position `i` given all before it were accepted: the position's
    /// own rate averaged with the pooled one ([`Estimates::acceptance`]), counted as [`POOLED_OUTCOMES`].
    pub fn alpha(&self, i: usize) -> f64 {
        let pooled = self.pooled.value;
        match self.alpha.get(i) {
            Some(own) => {
                let own_weight = f64::from(own.outcomes);
                (own_weight * own.value + POOLED_OUTCOMES * pooled) / (own_weight + POOLED_OUTCOMES)
            }
            None => pooled,
        }
    }

    /// The acceptance of a draft given all before it were accepted, over every position: the plain estimate.
    pub fn acceptance(&self) -> f64 {
        self.pooled.value
    }

    /// Estimated acceptance of a draft at `position` that the draft model gave probability `confidence`:
    /// `alpha_position`, scaled by how much more or less often drafts of that confidence are accepted than
    /// drafts in general. Under greedy decoding the confidence is the draft's softmax probability of its
    /// argmax ([`crate::sampling::confidence`]), not q's point mass.
    /// NaN: no information.
    pub fn acceptance_at(&self, position: usize, confidence: f32) -> f64 {
        let alpha = self.alpha(position);
        match bucket(confidence) {
            Some(k) if self.any_confidence.value > 0.0 => {
                (alpha * self.by_confidence[k].value / self.any_confidence.value).clamp(0.0, 1.0)
            }
            _ => alpha,
        }
    }

    /// The estimates a length is chosen with: the pooled acceptance read [`OPTIMISM`] standard errors high
    /// (see the `draft_control` docs).
    pub(super) fn optimistic(&self) -> Self {
        let mut view = self.clone();
        view.pooled.value = self.pooled.upper(OPTIMISM);
        view
    }

    /// Learns from one round. Used both by a generation's controller and by the gateway-wide estimates.
    pub fn observe(&mut self, round: &RoundObservation) {
        let accepted = round.accepted.min(round.drafted);
        // Positions before the first rejection were accepted, the first rejection was rejected, the rest unseen.
        for i in 0..round.drafted.min(accepted.saturating_add(1)).min(MAX_POSITIONS) {
            let outcome = if i < accepted { 1.0 } else { 0.0 };
            self.position(i).learn(outcome);
            self.pooled.learn_at(outcome, POOLED_GAIN);
            if let Some(k) = round.confidences.get(i).copied().and_then(bucket) {
                self.by_confidence[k].learn(outcome);
                self.any_confidence.learn(outcome);
            }
        }
        if let Some(matched) = round.ahead_guess.filter(|_| accepted == round.drafted) {
            let outcome = if matched { 1.0 } else { 0.0 };
            self.beta.learn(outcome);
            // The guess is what the draft would have drafted at position `drafted`, so it is also a sample
            // of that position's acceptance: exact under greedy decoding (accepted iff equal), a
            // conservative proxy when sampling (sum p*q instead of sum min(p, q)). Without it a length,
            // once chosen, would never see evidence that a longer one pays (0 included: the probe).
            self.position(round.drafted.min(MAX_POSITIONS - 1)).learn(outcome);
            self.pooled.learn_at(outcome, POOLED_GAIN);
        }
        // Timing samples: zero means "not measured", and past MAX_SAMPLE_S or MAX_POSITIONS drafts it is not a round we model.
        let sample = |t: Duration| {
            Some(t.as_secs_f64())
                .filter(|&s| s > 0.0 && s <= MAX_SAMPLE_S && round.drafted <= MAX_POSITIONS)
        };
        if let Some(step_s) = sample(round.draft_step) {
            ew_bounded(&mut self.t_draft_s, step_s, MAX_DRAFT_SAMPLE_RATIO);
        }
        if let Some(start_s) = sample(round.draft_start) {
            ew_bounded(&mut self.t_start_s, start_s, MAX_DRAFT_SAMPLE_RATIO);
        }
        let rows = round.drafted.saturating_add(1);
        let verifier_s = round.verifier_time.and_then(sample);
        if let Some(v) = verifier_s {
            self.fit_verify(rows as f64, v);
            self.measure_verify(rows, v);
        }
        if let Some(latency_s) = sample(round.call_latency) {
            let compute = verifier_s.unwrap_or_else(|| self.verify_time(rows));
            self.learn_rtt(latency_s - compute);
        }
        self.rounds += 1;
    }

    /// Learns the link from a call that is not a round to model (the first, which processes the prompt):
    /// its latency less the verifier's reported time is a round trip like any other. Without it the
    /// first rounds after the prompt chose on the 10 ms prior, at any RTT.
    pub fn observe_link(&mut self, call_latency: Duration, verifier_time: Duration) {
        let (latency_s, verifier_s) = (call_latency.as_secs_f64(), verifier_time.as_secs_f64());
        if latency_s > 0.0 && latency_s <= MAX_SAMPLE_S && verifier_s >= 0.0 {
            self.learn_rtt(latency_s - verifier_s);
        }
    }

    /// Learns from a call that verified a block of `rows` but was no drafted round (a copied block,
    /// [`crate::lookup`]): the verifier's time for that size, and the link. Copied blocks run longer
    /// than the model's, so they time the sizes the model's blocks rarely reach.
    pub fn observe_block_call(
        &mut self,
        rows: usize,
        call_latency: Duration,
        verifier_time: Duration,
    ) {
        let verifier_s = verifier_time.as_secs_f64();
        if verifier_s > 0.0 && verifier_s <= MAX_SAMPLE_S && rows <= MAX_POSITIONS + 1 {
            self.fit_verify(rows as f64, verifier_s);
            self.measure_verify(rows, verifier_s);
        }
        self.observe_link(call_latency, verifier_time);
    }

    /// One round-trip sample: the first replaces the prior, then a running average down to [`TIME_GAIN`].
    fn learn_rtt(&mut self, rtt_s: f64) {
        let gain = (1.0 / (f64::from(self.rtt_samples) + 1.0)).max(TIME_GAIN);
        self.rtt_samples = self.rtt_samples.saturating_add(1);
        ew(&mut self.rtt_s, rtt_s.max(0.0), gain);
    }

    /// The acceptance rate of draft position `i`; a position not seen yet starts from the pooled rate
    /// (as a prior: the outcomes behind it were not about this position).
    fn position(&mut self, i: usize) -> &mut Rate {
        if self.alpha.len() <= i {
            let seed = Rate::prior(self.pooled.value);
            self.alpha.resize(i + 1, seed);
        }
        &mut self.alpha[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft_control::testing::close;

    #[test]
    fn the_first_round_trip_replaces_the_prior_and_later_ones_average() {
        let mut e = Estimates::default();
        e.observe_link(Duration::from_millis(2_900), Duration::from_millis(2_800));
        assert!(close(e.rtt_s, 0.100), "{}", e.rtt_s);
        e.observe_link(Duration::from_millis(2_900), Duration::from_millis(2_900 - 50));
        assert!(close(e.rtt_s, 0.075), "{}", e.rtt_s);
        e.observe_link(Duration::from_millis(5), Duration::from_secs(1));
        assert!(close(e.rtt_s, 0.050), "clamped at 0: {}", e.rtt_s);
        e.observe_link(Duration::MAX, Duration::ZERO);
        assert!(close(e.rtt_s, 0.050), "an outage is no sample: {}", e.rtt_s);
    }

    #[test]
    fn a_copied_blocks_call_times_its_size_and_the_link() {
        let mut e = Estimates::default();
        let (before, other) = (e.verify_time(25), e.verify_time(3));
        e.observe_block_call(25, Duration::from_millis(900), Duration::from_millis(850));
        assert!(close(e.rtt_s, 0.050), "{}", e.rtt_s);
        assert!(e.verify_time(25) > before, "{} vs {before}", e.verify_time(25));
        // A block past the modelled sizes still teaches the link, but no size's time.
        let mut far = Estimates::default();
        far.observe_block_call(
            MAX_POSITIONS + 2,
            Duration::from_millis(900),
            Duration::from_millis(850),
        );
        assert!(close(far.rtt_s, 0.050) && close(far.verify_time(3), other), "{far:?}");
    }

    #[test]
    fn a_fresh_gateway_learns_a_texts_acceptance_within_a_few_rounds() {
        let mut e = Estimates::default();
        let accepted = RoundObservation {
            drafted: 2,
            accepted: 2,
            ahead_guess: Some(true),
            ..Default::default()
        };
        for _ in 0..4 {
            e.observe(&accepted);
        }
        // The prior counts as four outcomes: position 0 from 0.7 to 0.7 + 0.3 * 4/8 = 0.85 in four (a constant
        // gain of 0.15: 0.88); the pooled rate saw three a round, to 0.7 + 0.3 * 12/16 = 0.925; beta to 0.8.
        assert!(
            close(e.alpha[0].value, 0.85)
                && close(e.acceptance(), 0.925)
                && close(e.beta.value, 0.8),
            "{e:?}"
        );
        // A position's alpha leans on the pooled rate, counted as POOLED_OUTCOMES against its own four.
        assert!(
            close(e.alpha(0), (4.0 * 0.85 + POOLED_OUTCOMES * 0.925) / (4.0 + POOLED_OUTCOMES)),
            "{}",
            e.alpha(0)
        );
        // The length is chosen on the pooled rate read OPTIMISM standard errors high: sqrt(0.925 * 0.075 / 16).
        assert!(
            close(e.optimistic().acceptance(), 0.925 + OPTIMISM * (0.925f64 * 0.075 / 16.0).sqrt()),
            "{e:?}"
        );
        // Past the first outcomes a rate moves at its constant gain, so a late miss is one outcome among many.
        for _ in 0..20 {
            e.observe(&accepted);
        }
        let before = (e.alpha[0].value, e.alpha[1].value, e.acceptance());
        e.observe(&RoundObservation { drafted: 2, accepted: 0, ..Default::default() });
        assert!(
            close(e.alpha[0].value, before.0 * (1.0 - ACCEPT_GAIN)) && e.alpha[1].value == before.1,
            "{e:?}"
        );
        assert!(close(e.acceptance(), before.2 * (1.0 - POOLED_GAIN)), "{e:?}");
        // The optimism fades as outcomes accumulate.
        assert!(e.optimistic().acceptance() - e.acceptance() < 0.015, "{e:?}");
        // A position first reached starts from the pooled rate (as it is when reached), as a prior.
        e.observe(&RoundObservation { drafted: 4, accepted: 3, ..Default::default() });
        assert!(
            e.alpha.len() == 4
                && e.alpha[3].outcomes == 1
                && close(e.alpha[3].value, 0.8 * e.acceptance() / (1.0 - POOLED_GAIN)),
            "{e:?}"
        );
    }

    #[test]
    fn a_rejection_at_a_position_rarely_reached_moves_its_alpha_little() {
        let mut e = Estimates::default();
        for _ in 0..10 {
            e.observe(&RoundObservation {
                drafted: 2,
                accepted: 2,
                ahead_guess: Some(true),
                ..Default::default()
            });
        }
        let before = e.alpha(4);
        // Position 4's first outcome, a rejection: alone it reads 0.8 times its prior, but the pooled rate
        // (30 outcomes, nearly all accepted) counts as POOLED_OUTCOMES against it.
        e.observe(&RoundObservation { drafted: 5, accepted: 4, ..Default::default() });
        assert!(
            e.alpha[4].value < 0.81 * before && e.alpha(4) > before - 0.05,
            "{before} -> {}: {e:?}",
            e.alpha(4)
        );
    }

    #[test]
    fn one_slow_block_moves_the_drafting_times_a_bounded_step() {
        let mut e = Estimates::default();
        let slow = RoundObservation {
            drafted: 2,
            draft_step: Duration::from_secs(2),
            draft_start: Duration::from_secs(3),
            ..Default::default()
        };
        e.observe(&slow);
        // At most 4x the estimate is believed: 30 ms + 0.3 * (120 ms - 30 ms).
        assert!(close(e.t_draft_s, 0.057) && close(e.t_start_s, 0.057), "{e:?}");
        let usual = RoundObservation {
            draft_step: Duration::from_millis(40),
            draft_start: Duration::from_millis(60),
            ..slow
        };
        for _ in 0..15 {
            e.observe(&usual);
        }
        assert!((e.t_draft_s - 0.040).abs() < 1e-3 && (e.t_start_s - 0.060).abs() < 1e-3, "{e:?}");
    }

    #[test]
    fn equal_confidences_defer_to_acceptance_by_position() {
        let mut e = Estimates::default();
        for _ in 0..80 {
            // Every confidence the same (as under greedy decoding without a softmax). Position 0 always accepted, position 1 never.
            e.observe(&RoundObservation {
                drafted: 2,
                accepted: 1,
                confidences: vec![1.0, 1.0],
                ..Default::default()
            });
        }
        // Each position's own rate outweighs the pooled one (0.5) five to one after 80 outcomes.
        assert!(e.acceptance_at(0, 1.0) > 0.9 && e.acceptance_at(1, 1.0) < 0.1, "{e:?}");
    }
}
