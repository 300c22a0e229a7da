//! The optimiser: of every pair of lengths (one for blocks drafted after a miss, one for blocks drafted
//! ahead), the one to draft, and what it is reported as ([`DraftChoice`]).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::estimates::Estimates;
use super::round_model::{BlockKind, Policy};
use super::MAX_POSITIONS;

/// Modelled rates (committed tokens per second) this close to the highest count as equally fast, and the
/// length among them that costs the verifier least per committed token is drafted. The rate is flat near
/// its optimum when the verifier's per-call cost dwarfs its per-row cost (CPU verify blocks of 2-6 rows
/// are one pass over the weights), so its argmax wanders between lengths with the estimates' noise, while
/// a longer block of the same speed saves verifier compute (the cloud's bill) and per-round costs the
/// model leaves out (starting a draft request, committing and streaming). 3%: the benchmark's
/// goal is 5% of the best fixed length.
pub(super) const RATE_TOLERANCE: f64 = 0.03;

/// The current choice of draft length and the inputs it was made from (for logs, usage and metrics).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DraftChoice {
    /// Tokens to draft this round; 0 is plain target decoding.
    pub draft: usize,
    /// Tokens to draft ahead during a call (0: none); a block drafted ahead is sent when all the
    /// call's drafts and the guess after them were right.
    pub draft_ahead: usize,
    /// `E(draft)`: expected committed tokens this round.
    pub expected_tokens: f64,
    /// `T(draft)`: expected round time, with the wait for the block drafted ahead on a hit.
    pub round_time_s: f64,
    /// Expected committed tokens per second in the long run.
    pub tokens_per_s: f64,
    /// Probability that the block drafted ahead during this round's call is used (0 without draft-ahead).
    pub p_hit: f64,
    /// Whether blocks are drafted ahead.
    pub overlap: bool,
    pub rtt_s: f64,
    /// Draft model time per token.
    pub t_draft_s: f64,
    /// Draft time before a block's first step (request start, catching up on committed tokens).
    pub t_start_s: f64,
    pub verify_a_s: f64,
    pub verify_b_s: f64,
    pub beta: f64,
    /// Estimated acceptance of a draft given all before it were accepted, over every position.
    pub acceptance: f64,
    /// `alpha_i` for `i` in `0..max_draft`, as the length was chosen with (optimistic: see the `draft_control` docs).
    pub alpha: Vec<f64>,
}

impl Estimates {
    /// The lengths to draft, with their inputs: of every pair of a serial length in `0..=max_draft` and an
    /// ahead length (in `0..=max_draft` with draft-ahead, where 0 drafts nothing ahead; 0 without), the pairs whose long-run rate is
    /// within [`RATE_TOLERANCE`] of the highest, and of those the one with the least verifier time per
    /// committed token; but the `previous` pair while its rate is within [`RATE_TOLERANCE`] of that
    /// choice's. Changing length costs what the model leaves out: a block drafted ahead at the old length
    /// is sent short or drafted on after the call, and leaving 0 drafts the first block after the call and
    /// catches the draft up on the tokens committed meanwhile: where several lengths are modelled within a
    /// few percent, changing every round ran behind every fixed length (measured: see docs/benchmarks.md,
    /// adaptive draft length).
    ///
    /// Called on the [`Estimates::optimistic`] view.
    pub(super) fn best(
        &self,
        max_draft: usize,
        overlap: bool,
        previous: Option<(usize, usize)>,
    ) -> Policy {
        let max_draft = max_draft.min(MAX_POSITIONS);
        let lengths = self.lengths(max_draft);
        let aheads = if overlap { 0..=max_draft } else { 0..=0 };
        let policies: Vec<Policy> = aheads
            .flat_map(|a| (0..=max_draft).map(move |s| (s, a)))
            .map(|(s, a)| self.evaluate(&lengths, s, a))
            .collect();
        let top_rate = policies.iter().map(|p| p.rate).fold(f64::NEG_INFINITY, f64::max);
        let as_fast = |p: &&Policy| p.rate >= (1.0 - RATE_TOLERANCE) * top_rate;
        let chosen = policies
            .iter()
            .filter(as_fast)
            .min_by(|x, y| x.verifier_s_per_token.total_cmp(&y.verifier_s_per_token))
            .copied()
            .unwrap_or_else(|| self.evaluate(&lengths, 0, 0));
        let kept = previous.and_then(|(s, a)| {
            policies.iter().find(|p| p.serial.drafted == s && p.ahead.drafted == a)
        });
        kept.filter(|k| k.rate >= (1.0 - RATE_TOLERANCE) * chosen.rate).copied().unwrap_or(chosen)
    }

    /// What a round of `kind` under `policy` reports: its length and expectations, and the inputs, as
    /// chosen with (the optimistic view), but the plain acceptance `plain`.
    pub(super) fn choice_of(
        &self,
        policy: &Policy,
        kind: BlockKind,
        max_draft: usize,
        plain: f64,
    ) -> DraftChoice {
        let round = match kind {
            BlockKind::Serial => policy.serial,
            BlockKind::Ahead => policy.ahead,
        };
        DraftChoice {
            draft: round.drafted,
            draft_ahead: policy.ahead.drafted,
            expected_tokens: round.expected_tokens,
            round_time_s: round.round_time_s,
            tokens_per_s: policy.rate,
            p_hit: round.p_hit,
            overlap: policy.ahead.drafted > 0,
            rtt_s: self.rtt_s,
            t_draft_s: self.t_draft_s,
            t_start_s: self.t_start_s,
            verify_a_s: self.verify_a_s,
            verify_b_s: self.verify_b_s,
            beta: self.beta.value,
            acceptance: plain,
            alpha: (0..max_draft.min(MAX_POSITIONS)).map(|i| self.alpha(i)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::draft_control::estimates::Rate;
    use crate::draft_control::round_model::Candidate;
    use crate::draft_control::testing::{close, est, known};
    use crate::draft_control::DraftController;

    #[test]
    fn hopeless_drafts_choose_zero_and_certain_drafts_on_a_long_link_choose_max() {
        for overlap in [false, true] {
            assert_eq!(
                DraftController::with_estimates(8, overlap, est(0.01, 30.0, 200.0, 80.0, 8.0))
                    .choose(BlockKind::Serial),
                0
            );
            assert_eq!(
                DraftController::with_estimates(8, overlap, est(0.999, 30.0, 1000.0, 80.0, 8.0))
                    .choose(BlockKind::Serial),
                8
            );
            assert_eq!(
                DraftController::with_estimates(0, overlap, est(0.999, 30.0, 1000.0, 80.0, 8.0))
                    .choose(BlockKind::Serial),
                0
            );
        }
    }

    #[test]
    fn chosen_length_grows_with_round_trip_time() {
        for overlap in [false, true] {
            let chosen: Vec<usize> = [0.0, 20.0, 50.0, 100.0, 200.0, 500.0]
                .iter()
                .map(|&rtt| {
                    DraftController::with_estimates(32, overlap, est(0.8, 30.0, rtt, 100.0, 10.0))
                        .choose(BlockKind::Serial)
                })
                .collect();
            assert!(chosen.windows(2).all(|w| w[0] <= w[1]), "overlap {overlap}: {chosen:?}");
            assert!(chosen[4] > chosen[0], "overlap {overlap}: {chosen:?}");
        }
        // Hand-computed without overlap. At 0 ms d = 2 is fastest (12.84 tok/s) but d = 3 (12.83) is as
        // fast within the tolerance and costs the verifier 56 ms per token against 61. At 200 ms d = 5 is
        // fastest (7.23), and d = 6 (7.18) is cheaper (43.0 ms per token against 44.6).
        assert_eq!(
            DraftController::with_estimates(32, false, est(0.8, 30.0, 0.0, 100.0, 10.0))
                .choose(BlockKind::Serial),
            3
        );
        assert_eq!(
            DraftController::with_estimates(32, false, est(0.8, 30.0, 200.0, 100.0, 10.0))
                .choose(BlockKind::Serial),
            6
        );
    }

    #[test]
    fn after_a_miss_a_shorter_block_than_the_one_drafted_ahead_is_faster_than_one_length() {
        // The benchmark's host: the verifier's passes of 1-9 rows (`/v1/info`), 48 ms draft steps, acceptance
        // 0.9. A block drafted in series costs a draft step and a verifier row per token; one drafted ahead
        // only the row, and its hit saves the next round's drafting.
        for rtt in [0.0, 50.0, 150.0] {
            let mut e =
                Estimates { t_start_s: 0.005, beta: known(0.85), ..est(0.9, 48.0, rtt, 0.0, 0.0) };
            e.seed_verifier_passes(&[
                0.091, 0.150, 0.214, 0.239, 0.279, 0.354, 0.400, 0.433, 0.509,
            ]);
            let mut ctl = DraftController::with_estimates(8, true, e);
            let (serial, ahead) = (ctl.choose(BlockKind::Serial), ctl.choose(BlockKind::Ahead));
            let lengths = e_lengths(&ctl);
            let one_length = (0..=8)
                .map(|d| ctl.estimates.optimistic().evaluate(&lengths, d, d).rate)
                .fold(0.0, f64::max);
            assert!(serial < ahead, "rtt {rtt}: ({serial}, {ahead})");
            assert!(
                ctl.choice().tokens_per_s > 1.01 * one_length,
                "rtt {rtt}: {:?} against {one_length}",
                ctl.choice()
            );
        }
        // Where drafting costs more than verifying (76 ms a token, 105 ms a row with no cost per call), a
        // round of 0 is fastest even with draft-ahead: 1 token in 128 ms (7.8/s) against d = 2's 2.71 in 442 ms (6.1/s).
        let e = Estimates {
            t_start_s: 0.089,
            beta: Rate::prior(0.7),
            ..est(0.9, 76.0, 23.0, 0.0, 105.0)
        };
        for overlap in [false, true] {
            let mut ctl = DraftController::with_estimates(8, overlap, e.clone());
            assert_eq!(
                (ctl.choose(BlockKind::Serial), ctl.choose(BlockKind::Ahead)),
                (0, 0),
                "{:?}",
                ctl.choice()
            );
            assert!(close(ctl.choice().tokens_per_s, 1.0 / 0.128));
        }
    }

    fn e_lengths(ctl: &DraftController) -> Vec<Candidate> {
        ctl.estimates.optimistic().lengths(ctl.max_draft)
    }

    #[test]
    fn draft_ahead_drafts_at_least_as_much_and_is_faster() {
        for rtt in [0.0, 20.0, 100.0, 300.0] {
            let (mut with, mut without) = (
                DraftController::with_estimates(16, true, est(0.8, 30.0, rtt, 100.0, 10.0)),
                DraftController::with_estimates(16, false, est(0.8, 30.0, rtt, 100.0, 10.0)),
            );
            with.choose(BlockKind::Serial);
            assert!(with.choice().draft_ahead >= without.choose(BlockKind::Serial), "rtt {rtt}");
            assert!(
                with.choice().tokens_per_s > without.choice().tokens_per_s,
                "rtt {rtt}: {:?} vs {:?}",
                with.choice(),
                without.choice()
            );
        }
    }

    #[test]
    fn a_length_is_kept_while_it_is_as_fast_and_left_when_it_is_not() {
        // Flat acceptance 0.8 and a call's fixed cost well above a row's: several pairs of lengths are about as fast.
        let e = est(0.8, 30.0, 0.0, 100.0, 10.0);
        let fresh = e.optimistic().best(8, true, None);
        let lengths = e.optimistic().lengths(8);
        let pairs = (0..=8).flat_map(|s| (1..=8).map(move |a| (s, a)));
        let near: Vec<(usize, usize)> = pairs
            .filter(|&(s, a)| (s, a) != (fresh.serial.drafted, fresh.ahead.drafted))
            .filter(|&(s, a)| {
                e.optimistic().evaluate(&lengths, s, a).rate >= (1.0 - RATE_TOLERANCE) * fresh.rate
            })
            .collect();
        assert!(!near.is_empty(), "no pair is as fast as {fresh:?}: the test needs a flat optimum");
        for &(s, a) in &near {
            let kept = e.optimistic().best(8, true, Some((s, a)));
            assert_eq!(
                (kept.serial.drafted, kept.ahead.drafted),
                (s, a),
                "({s}, {a}) is within the tolerance of {fresh:?}"
            );
        }
        // A long link makes the kept lengths slow: they are left.
        let slow = Estimates { rtt_s: 0.300, ..e.clone() };
        let long = slow.optimistic().best(8, true, None);
        let left = slow.optimistic().best(8, true, Some((0, 1)));
        assert!(long.ahead.drafted > fresh.ahead.drafted && left == long, "{long:?}");
    }

    #[test]
    fn choose_follows_the_directly_computed_rule() {
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        for case in 0..500 {
            let max = rng.random_range(0..=12usize);
            let alpha: Vec<f64> = (0..max.max(1)).map(|_| rng.random_range(0.0..1.0)).collect();
            let (beta, t, start, rtt, a, b, overlap) = (
                rng.random_range(0.0..1.0),
                rng.random_range(0.001..0.1),
                rng.random_range(0.0..0.1),
                rng.random_range(0.0..0.5),
                rng.random_range(0.0..0.2),
                rng.random_range(0.0..0.03),
                rng.random_bool(0.5),
            );
            let tokens =
                |d: usize| (0..=d).map(|j| alpha[..j].iter().product::<f64>()).sum::<f64>();
            let v = |d: usize| a + b * (d + 1) as f64;
            // Drafting `serial` after a miss and `ahead` during each call: rounds of each kind with their
            // P(hit), time and tokens; a hit waits for whatever of the drafting ahead outlasts its call.
            let pair = |serial: usize, ahead: usize| {
                let p = |d: usize| {
                    if ahead > 0 {
                        alpha[..d].iter().product::<f64>() * beta
                    } else {
                        0.0
                    }
                };
                let wait =
                    |d: usize| p(d) * (start + (ahead + 1) as f64 * t - (rtt + v(d))).max(0.0);
                let serial_time = if serial > 0 { start + serial as f64 * t } else { 0.0 }
                    + rtt
                    + v(serial)
                    + wait(serial);
                let ahead_time = rtt + v(ahead) + wait(ahead);
                // Shares of rounds: serial ones end in a hit with p(serial), ahead ones in a miss with 1 - p(ahead).
                let (ws, wa) =
                    if p(serial) > 0.0 { (1.0 - p(ahead), p(serial)) } else { (1.0, 0.0) };
                let tokens_per_round = ws * tokens(serial) + wa * tokens(ahead);
                (
                    tokens_per_round / (ws * serial_time + wa * ahead_time),
                    (ws * v(serial) + wa * v(ahead)) / tokens_per_round,
                )
            };
            let aheads = if overlap { 0..=max } else { 0..=0 };
            let pairs: Vec<(usize, usize)> =
                aheads.flat_map(|ahead| (0..=max).map(move |serial| (serial, ahead))).collect();
            let top = pairs.iter().map(|&(s, a)| pair(s, a).0).fold(f64::NEG_INFINITY, f64::max);
            // Within 3% of the fastest, the least verifier time per committed token; the first on ties.
            let want = pairs.iter().filter(|&&(s, a)| pair(s, a).0 >= 0.97 * top).fold(
                None,
                |best: Option<(usize, usize)>, &(s, a)| match best {
                    Some((bs, ba)) if pair(bs, ba).1 <= pair(s, a).1 => Some((bs, ba)),
                    _ => Some((s, a)),
                },
            );
            let want = want.unwrap();
            let estimates = Estimates {
                alpha: alpha.iter().copied().map(known).collect(),
                beta: Rate::prior(beta),
                t_draft_s: t,
                t_start_s: start,
                rtt_s: rtt,
                verify_a_s: a,
                verify_b_s: b,
                ..Estimates::default()
            };
            let mut ctl = DraftController::with_estimates(max, overlap, estimates);
            let chosen = (ctl.choose(BlockKind::Serial), ctl.choose(BlockKind::Ahead));
            // Pairs can cost the verifier the same per token (a miss after drafting 1 ends either way), and then rounding decides.
            let (rate, cost) = pair(chosen.0, chosen.1);
            assert!(
                chosen == want
                    || (rate >= 0.97 * top && (cost - pair(want.0, want.1).1).abs() < 1e-9),
                "case {case}: {chosen:?} vs {want:?}"
            );
            assert!((ctl.choice().tokens_per_s - rate).abs() < 1e-6 * rate, "case {case}");
        }
    }
}
