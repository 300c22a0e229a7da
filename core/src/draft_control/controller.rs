//! One generation's draft-length controller ([`DraftController`]): chooses the lengths each round from
//! its own copy of the estimates, probes at length 0, and learns from every round.

use std::time::Duration;

use super::block_end::BlockEnd;
use super::estimates::{Estimates, RoundObservation};
use super::policy::DraftChoice;
use super::round_model::{BlockKind, Policy, MIN_ROUND_S};
use super::MAX_POSITIONS;

/// Rounds of length 0 per probe (see the `draft_control` docs): each probe drafts while the verifier computes, which
/// costs nothing on separate machines but slows a verifier sharing the host's memory by a few percent.
const PROBE_EVERY: u32 = 4;
/// Every round of length 0 probes until the first draft position has this many outcomes: a fresh
/// gateway's acceptance is its prior (0.7), which at a low RTT chooses 0, and probing only every
/// [`PROBE_EVERY`]th round kept a text the draft predicts well at 0 for a dozen rounds.
const LEARNING_OUTCOMES: u32 = 4;
/// Most odds of a copy being all accepted that [`DraftController::copied_block`] counts on: its run
/// of copies is taken as 20 rounds at most, so that odds near 1 do not outweigh any price.
const MAX_RUN_ODDS: f64 = 0.95;

/// How much of a copied block to send ([`DraftController::copied_block`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopiedBlock {
    pub len: usize,
    /// What the copies it starts are worth over the draft model's rounds, in tokens.
    pub worth: f64,
}

/// One generation's draft-length controller: call [`choose`](Self::choose) before each block,
/// [`keep_drafting`](Self::keep_drafting) after each drafted token, [`observe`](Self::observe) after the call.
#[derive(Clone, Debug)]
pub struct DraftController {
    pub(super) max_draft: usize,
    pub(super) overlap: bool,
    pub(super) estimates: Estimates,
    /// The lengths chosen last, on the optimistic view of the estimates.
    pub(super) policy: Policy,
    /// The kind of block chosen last.
    pub(super) kind: BlockKind,
    pub(super) choice: DraftChoice,
    /// Rounds of length 0 since the last probe.
    pub(super) unprobed: u32,
    pub(super) block_end: BlockEnd,
}

impl DraftController {
    /// `max_draft`: the verifier's limit; `overlap`: whether the edge drafts ahead during calls; `seed`: the
    /// gateway-wide estimates (their acceptance rates count as at most [`SEED_OUTCOMES`](super::estimates::SEED_OUTCOMES) outcomes here).
    pub fn new(max_draft: usize, overlap: bool, mut seed: Estimates) -> Self {
        for rate in seed
            .alpha
            .iter_mut()
            .chain([&mut seed.pooled, &mut seed.beta, &mut seed.any_confidence])
            .chain(seed.by_confidence.iter_mut())
        {
            *rate = rate.as_seed();
        }
        Self::with_estimates(max_draft, overlap, seed)
    }

    /// A controller that starts from `estimates` as they are, as a generation's own.
    pub(super) fn with_estimates(max_draft: usize, overlap: bool, estimates: Estimates) -> Self {
        let view = estimates.optimistic();
        let policy = view.best(max_draft, overlap, None);
        let choice = view.choice_of(&policy, BlockKind::Serial, max_draft, estimates.acceptance());
        Self {
            max_draft,
            overlap,
            estimates,
            policy,
            kind: BlockKind::Serial,
            choice,
            unprobed: 0,
            block_end: BlockEnd::default(),
        }
    }

    /// Where blocks end ([`BlockEnd::Confidence`] unless set).
    pub fn with_block_end(self, block_end: BlockEnd) -> Self {
        Self { block_end, ..self }
    }

    /// Chooses the lengths from the current estimates (keeping the last ones while they are as fast) and
    /// returns the length of the next block, of `kind`.
    pub fn choose(&mut self, kind: BlockKind) -> usize {
        let previous = (self.policy.serial.drafted, self.policy.ahead.drafted);
        let view = self.estimates.optimistic();
        self.policy = view.best(self.max_draft, self.overlap, Some(previous));
        self.kind = kind;
        self.choice =
            view.choice_of(&self.policy, kind, self.max_draft, self.estimates.acceptance());
        self.choice.draft
    }

    /// A copied block ([`crate::lookup`]: no drafting, so its round is its call, `rtt + V(k + 1)`)
    /// weighed against the draft model's rounds. `expected[k - 1]` is what sending its first `k`
    /// tokens commits on average. Its length is the one whose round commits the most per second. It
    /// is worth its tokens less its time at the model's rate; a copy all accepted is followed by
    /// the next (the source goes on), so the copies it starts are worth that for `1 / (1 - P(all
    /// accepted))` rounds, and it is sent when they are worth more than the model's next round: 0
    /// for a block drafted after a miss, a block drafted ahead's worth when one is `ahead_ready`
    /// (the copy drops it). Weighed one round at a time instead, a prediction the answer follows
    /// for hundreds of tokens lost to every ready block of a draft model that copies it too.
    /// None: the model's rounds are worth more.
    pub fn copied_block(&self, expected: &[f64], ahead_ready: bool) -> Option<CopiedBlock> {
        let e = &self.estimates;
        let time = |k: usize| (e.rtt_s + e.verify_time(k + 1)).max(MIN_ROUND_S);
        let (len, tokens) =
            (1..=expected.len().min(MAX_POSITIONS))
                .map(|k| (k, expected[k - 1]))
                .max_by(|(a, ea), (b, eb)| (ea / time(*a)).total_cmp(&(eb / time(*b))))?;
        let worth = tokens - self.policy.rate * time(len);
        // E(k) - E(k - 1), with E(0) = 1: the chance that all of the first k are accepted.
        let all_accepted = tokens - len.checked_sub(2).map_or(1.0, |i| expected[i]);
        let run = worth / (1.0 - all_accepted.clamp(0.0, MAX_RUN_ODDS));
        let model = if ahead_ready { self.policy.ahead_worth } else { 0.0 };
        (worth > 0.0 && run > model).then_some(CopiedBlock { len, worth: run - model })
    }

    /// Whether a round of length 0 drafts a guess as a probe: every [`PROBE_EVERY`]th such round, and
    /// every one while the first position's acceptance has fewer than [`LEARNING_OUTCOMES`] outcomes.
    pub fn probe(&mut self) -> bool {
        self.unprobed += 1;
        let learning =
            self.estimates.alpha.first().is_none_or(|rate| rate.outcomes < LEARNING_OUTCOMES);
        let due = learning || self.unprobed >= PROBE_EVERY;
        if due {
            self.unprobed = 0;
        }
        due
    }

    /// Learns from the round just verified (feed the gateway-wide [`Estimates::observe`] the same observation).
    pub fn observe(&mut self, round: &RoundObservation) {
        self.estimates.observe(round);
    }

    /// Learns the link from a call that is not a round ([`Estimates::observe_link`]).
    pub fn observe_link(&mut self, call_latency: Duration, verifier_time: Duration) {
        self.estimates.observe_link(call_latency, verifier_time);
    }

    /// Learns from a copied block's call ([`Estimates::observe_block_call`]).
    pub fn observe_block_call(
        &mut self,
        rows: usize,
        call_latency: Duration,
        verifier_time: Duration,
    ) {
        self.estimates.observe_block_call(rows, call_latency, verifier_time);
    }

    /// The last choice and its inputs.
    pub fn choice(&self) -> DraftChoice {
        self.choice.clone()
    }

    pub fn estimates(&self) -> &Estimates {
        &self.estimates
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::draft_control::block_end::BlockOdds;
    use crate::draft_control::policy::RATE_TOLERANCE;
    use crate::draft_control::testing::{close, est, known};
    use crate::draft_control::MAX_POSITIONS;

    /// A simulated round against a world with flat acceptance 0.8, 30 ms draft steps and V = 100 ms + 10 ms * rows.
    fn simulate(rng: &mut ChaCha8Rng, d: usize, rtt_s: f64) -> RoundObservation {
        let accepted = (0..d).take_while(|_| rng.random_bool(0.8)).count();
        let verifier_s = 0.1 + 0.01 * (d + 1) as f64;
        // The guess is the draft's token for position d: accepted like any other (greedy decoding).
        let ahead_guess = (d > 0 && accepted == d).then(|| rng.random_bool(0.8));
        RoundObservation {
            drafted: d,
            accepted,
            confidences: vec![0.8; d],
            draft_step: Duration::from_secs_f64(if d > 0 { 0.03 } else { 0.0 }),
            draft_start: Duration::from_secs_f64(if d > 0 { 0.01 } else { 0.0 }),
            call_latency: Duration::from_secs_f64(rtt_s + verifier_s),
            verifier_time: Some(Duration::from_secs_f64(verifier_s)),
            ahead_guess,
        }
    }

    #[test]
    fn estimates_track_a_round_trip_jump_within_ten_rounds() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut ctl = DraftController::new(16, true, Estimates::default());
        for _ in 0..30 {
            let d = ctl.choose(BlockKind::Serial);
            ctl.observe(&simulate(&mut rng, d, 0.020));
        }
        let at = |e: &Estimates, rtt_s: f64| {
            DraftController::new(16, true, Estimates { rtt_s, ..e.clone() })
                .choose(BlockKind::Serial)
        };
        let before = ctl.choose(BlockKind::Serial);
        assert!((ctl.estimates().rtt_s - 0.020).abs() < 0.002, "{:?}", ctl.estimates());
        for _ in 0..10 {
            let d = ctl.choose(BlockKind::Serial);
            ctl.observe(&simulate(&mut rng, d, 0.150));
        }
        let e = ctl.estimates().clone();
        assert!((e.rtt_s - 0.150).abs() < 0.2 * 0.150, "{e:?}");
        let (want, want_before) = (at(&e, 0.150), at(&e, 0.020));
        // What the new RTT makes fastest, or a length kept because it is as fast (within the tolerance).
        let (chosen, rate) = (ctl.choose(BlockKind::Serial), |d: usize| {
            e.expected_tokens(d) / e.round_time(d, true)
        });
        assert!(
            chosen == want || rate(chosen) >= (1.0 - RATE_TOLERANCE) * rate(want),
            "{chosen} vs {want}"
        );
        assert!(
            want >= want_before && want > before,
            "{chosen}, {want} vs {want_before} / {before}"
        );
    }

    #[test]
    fn probes_at_length_zero_bring_drafting_back_when_guesses_match() {
        let mut ctl = DraftController::new(8, true, est(0.1, 15.0, 100.0, 20.0, 45.0));
        assert_eq!(ctl.choose(BlockKind::Serial), 0);
        // A fresh gateway probes every round until the first position has a few outcomes.
        assert!((0..LEARNING_OUTCOMES).all(|_| ctl.probe()));
        let probe = |matched| RoundObservation { ahead_guess: Some(matched), ..Default::default() };
        let rounds = (0..30).take_while(|_| {
            ctl.observe(&probe(true));
            ctl.choose(BlockKind::Serial) == 0 && ctl.choice().draft_ahead == 0
        });
        assert!(rounds.count() < 15, "{:?}", ctl.estimates());
        // Misses drive it back to 0; a probe that drafted nothing is no evidence about later positions.
        for _ in 0..30 {
            ctl.observe(&probe(false));
        }
        // (Drafting ahead may be kept a while where it is about as fast as none.)
        assert_eq!(ctl.choose(BlockKind::Serial), 0, "{:?}", ctl.estimates());
        let fresh = DraftController::with_estimates(8, true, ctl.estimates().clone()).choice();
        assert_eq!((fresh.draft, fresh.draft_ahead), (0, 0), "{:?}", ctl.estimates());
        assert!(
            ctl.estimates().alpha.len() == 1 && ctl.estimates().alpha(0) < 0.1,
            "{:?}",
            ctl.estimates()
        );
        assert_eq!((0..4 * PROBE_EVERY).filter(|_| ctl.probe()).count(), 4);
        // After a fully accepted block, the guess is an outcome of the next position.
        let mut e = est(0.5, 15.0, 100.0, 20.0, 45.0);
        e.observe(&RoundObservation {
            drafted: 2,
            accepted: 2,
            ahead_guess: Some(true),
            ..Default::default()
        });
        assert!(
            e.alpha.len() == 3
                && e.alpha(2) > e.alpha(1)
                && e.alpha(1) > e.alpha(0)
                && e.alpha(0) > 0.5,
            "{e:?}"
        );
    }

    #[test]
    fn degenerate_observations_neither_panic_nor_poison_the_estimates() {
        let mut ctl = DraftController::new(usize::MAX, true, Estimates::default());
        let rounds = [
            RoundObservation::default(),
            RoundObservation {
                drafted: 2,
                accepted: 9,
                confidences: vec![f32::NAN, f32::INFINITY, -1.0],
                ahead_guess: Some(true),
                ..Default::default()
            },
            RoundObservation {
                drafted: usize::MAX,
                accepted: usize::MAX,
                call_latency: Duration::MAX,
                verifier_time: Some(Duration::ZERO),
                ..Default::default()
            },
            RoundObservation {
                drafted: 1,
                call_latency: Duration::from_millis(5),
                verifier_time: Some(Duration::from_secs(1)),
                ..Default::default()
            },
        ];
        for round in &rounds {
            ctl.observe(round);
            let d = ctl.choose(BlockKind::Serial);
            assert!(d <= MAX_POSITIONS);
            let mut block = BlockOdds::default();
            let _ = (
                ctl.keep_drafting(&mut block, f32::NAN),
                ctl.keep_drafting(&mut block, 2.0),
                ctl.keep_drafting(&mut block, -3.0),
            );
            let c = ctl.choice();
            assert!(
                c.tokens_per_s.is_finite()
                    && c.round_time_s > 0.0
                    && c.alpha.iter().all(|a| (0.0..=1.0).contains(a)),
                "{c:?}"
            );
        }
        let e = ctl.estimates();
        // The absurd latency was ignored and the last sample (latency < verifier time) clamped at 0; the first
        // sample replaces the 10 ms prior.
        assert!(close(e.rtt_s, 0.0) && close(e.t_draft_s, 0.030), "{:?}", (e.rtt_s, e.t_draft_s));
    }

    /// `E(k)` of a copied block whose tokens are each accepted with `alpha` (after the ones before).
    fn copied(alpha: f64, len: usize) -> Vec<f64> {
        (1..=len).map(|k| (0..=k).map(|j| alpha.powi(j as i32)).sum()).collect()
    }

    #[test]
    fn a_copied_block_is_sent_where_it_beats_the_model_and_as_long_as_its_rate_is_highest() {
        // Draft acceptance 0.7, 30 ms steps, 50 ms RTT, V = 80 ms + 8 ms a row.
        let c = DraftController::with_estimates(8, true, est(0.7, 30.0, 50.0, 80.0, 8.0));
        // A text that repeats (0.98 a token): sent, and longer than the model's drafts.
        let sure = c.copied_block(&copied(0.98, 32), false).unwrap();
        assert!(sure.len > 8 && sure.worth > 0.0, "{sure:?}");
        // Its length maximises tokens per second of its own round.
        let e = &c.estimates;
        let rate = |k: usize| copied(0.98, 32)[k - 1] / (e.rtt_s + e.verify_time(k + 1));
        assert!((1..=32).all(|k| rate(k) <= rate(sure.len)));
        // A guess right a third of the time is worth less than the model's round.
        assert_eq!(c.copied_block(&copied(0.33, 32), false), None);
        // Nothing to send: nothing.
        assert_eq!(c.copied_block(&[], false), None);
        // A block drafted ahead and ready raises the bar by its worth.
        let ready = c.copied_block(&copied(0.98, 32), true);
        assert!(c.policy.ahead_worth > 0.0);
        assert!(ready.is_none_or(|r| close(r.worth, sure.worth - c.policy.ahead_worth)));
        // Where verify rows are cheap (a GPU), the block runs to what the source has.
        let gpu = DraftController::with_estimates(8, true, est(0.7, 30.0, 50.0, 20.0, 0.1));
        assert_eq!(gpu.copied_block(&copied(0.98, 32), false).unwrap().len, 32);
    }

    #[test]
    fn a_copy_the_answer_keeps_following_beats_a_ready_block_of_a_draft_that_copies_too() {
        // A draft model copying the text as well (0.995 a token), 60 ms steps and rows, 50 ms RTT:
        // its blocks drafted ahead are nearly always right, so a ready one is worth several tokens.
        let copies_too = Estimates { beta: known(0.995), ..est(0.995, 60.0, 50.0, 50.0, 60.0) };
        let c = DraftController::with_estimates(8, true, copies_too);
        let e = &c.estimates;
        let follows = copied(0.996, 32);
        let sent = c.copied_block(&follows, true).expect("a copy the answer follows is sent");
        let one_round =
            follows[sent.len - 1] - c.policy.rate * (e.rtt_s + e.verify_time(sent.len + 1));
        // One round of it is worth less than the ready block; the run of copies it starts is not.
        assert!(one_round > 0.0 && one_round < c.policy.ahead_worth, "{one_round} {:?}", c.policy);
        // At 0.99 a token its copies run shorter: worth more than a block drafted after a miss,
        // not more than the ready one.
        assert!(c.copied_block(&copied(0.99, 32), false).is_some());
        assert_eq!(c.copied_block(&copied(0.99, 32), true), None);
    }
}
