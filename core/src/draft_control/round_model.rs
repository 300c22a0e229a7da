//! The round model (see the `draft_control` docs): a round's expected tokens and time, and the long-run rate
//! of a pair of lengths, one for blocks drafted after a miss and one for blocks drafted ahead.

use super::estimates::Estimates;
use super::MAX_POSITIONS;

/// Floor of a modelled round time, so rates stay finite when every cost is estimated at zero.
pub(super) const MIN_ROUND_S: f64 = 1e-6;

impl Estimates {
    /// `E(d)`: expected tokens committed by a round that drafts `d`.
    pub fn expected_tokens(&self, d: usize) -> f64 {
        let (mut sum, mut all_accepted) = (0.0, 1.0);
        for j in 0..=d.min(MAX_POSITIONS) {
            sum += all_accepted;
            all_accepted *= self.alpha(j);
        }
        sum
    }

    /// `T(d)`: expected wall time of a round when every block drafts `d`, in seconds, averaged over
    /// rounds whose block was drafted ahead and rounds whose block was drafted after the call before it.
    pub fn round_time(&self, d: usize, overlap: bool) -> f64 {
        let d = d.min(MAX_POSITIONS);
        let policy = self.evaluate(&self.lengths(d), d, if overlap { d } else { 0 });
        policy.serial_share * policy.serial.round_time_s
            + (1.0 - policy.serial_share) * policy.ahead.round_time_s
    }

    /// Each length `0..=max`'s block before its tokens are seen: `E(d)` and P(all `d` accepted).
    pub(super) fn lengths(&self, max: usize) -> Vec<Candidate> {
        let mut lengths = vec![Candidate::zero()];
        lengths.extend(self.longer_blocks(Candidate::zero(), max));
        lengths
    }

    /// The blocks that go on from `from` one more draft at a time, up to `to` drafts (drafts past
    /// `from` accepted at `alpha` of their position).
    pub(super) fn longer_blocks(
        &self,
        from: Candidate,
        to: usize,
    ) -> impl Iterator<Item = Candidate> + Clone + '_ {
        (from.drafted + 1..=to).scan(from, move |c, j| {
            c.all_accepted *= self.alpha(j - 1);
            c.expected_tokens += c.all_accepted;
            c.drafted = j;
            Some(*c)
        })
    }

    /// The time a round of `block` adds, given the chance it is a hit and the drafting of the block
    /// drafted ahead during its call (`ahead_s`, the guess included): a serial block's drafting, the
    /// call, and on a hit whatever of the drafting ahead outlasts the call (the next round waits for it).
    pub(super) fn round_time_of(
        &self,
        kind: BlockKind,
        drafted: usize,
        p_hit: f64,
        ahead_s: f64,
    ) -> f64 {
        let call = self.rtt_s + self.verify_time(drafted + 1);
        let drafting = match kind {
            BlockKind::Serial if drafted > 0 => self.t_start_s + drafted as f64 * self.t_draft_s,
            _ => 0.0,
        };
        (drafting + call + p_hit * (ahead_s - call).max(0.0)).max(MIN_ROUND_S)
    }

    /// Drafting a block of `ahead` ahead, its guess first.
    pub(super) fn ahead_drafting_s(&self, ahead: usize) -> f64 {
        self.t_start_s + (ahead + 1) as f64 * self.t_draft_s
    }

    /// The long-run rate of drafting `serial` after a miss and `ahead` during each call (0: nothing drafted
    /// ahead), from `lengths` ([`Estimates::lengths`]), and what a round in each state expects.
    ///
    /// A serial round leads to an ahead round with its `P_hit`, an ahead round back to a serial one with
    /// `1 - P_hit`, so in the long run the shares of rounds are `1 - P_hit(ahead)` to `P_hit(serial)`; the
    /// rate is their expected tokens over their expected time. The ahead state's worth over the serial one
    /// (in tokens) follows from the ahead state's balance: `E_a - rate * T_a + P_hit(ahead) * worth = worth`.
    pub(super) fn evaluate(&self, lengths: &[Candidate], serial: usize, ahead: usize) -> Policy {
        let beta = if ahead > 0 { self.beta.value } else { 0.0 };
        let ahead_s = self.ahead_drafting_s(ahead);
        let round = |kind, c: Candidate| {
            let p_hit = c.all_accepted * beta;
            Round {
                drafted: c.drafted,
                expected_tokens: c.expected_tokens,
                round_time_s: self.round_time_of(kind, c.drafted, p_hit, ahead_s),
                p_hit,
            }
        };
        let (s, a) =
            (round(BlockKind::Serial, lengths[serial]), round(BlockKind::Ahead, lengths[ahead]));
        let (ws, wa) = if s.p_hit > 0.0 { (1.0 - a.p_hit, s.p_hit) } else { (1.0, 0.0) };
        let rate = (ws * s.expected_tokens + wa * a.expected_tokens)
            / (ws * s.round_time_s + wa * a.round_time_s);
        let ahead_worth = if a.p_hit < 1.0 {
            (a.expected_tokens - rate * a.round_time_s) / (1.0 - a.p_hit)
        } else {
            (rate * s.round_time_s - s.expected_tokens) / s.p_hit
        };
        let verifier = (ws * self.verify_time(serial + 1) + wa * self.verify_time(ahead + 1))
            / (ws * s.expected_tokens + wa * a.expected_tokens);
        Policy {
            serial: s,
            ahead: a,
            rate,
            ahead_worth,
            serial_share: ws / (ws + wa),
            verifier_s_per_token: verifier,
        }
    }
}

/// A block length weighed before its tokens are seen (or the rest of a block being drafted).
#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate {
    pub(super) drafted: usize,
    /// `E`: expected committed tokens.
    pub(super) expected_tokens: f64,
    /// P(all `drafted` accepted).
    pub(super) all_accepted: f64,
}

impl Candidate {
    pub(super) fn zero() -> Self {
        Self { drafted: 0, expected_tokens: 1.0, all_accepted: 1.0 }
    }
}

/// A block of one kind under a [`Policy`]: what its round expects.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Round {
    pub(super) drafted: usize,
    pub(super) expected_tokens: f64,
    pub(super) round_time_s: f64,
    /// P(all drafts accepted and the guess drafted ahead right): the next block is drafted already.
    pub(super) p_hit: f64,
}

/// The lengths of a generation's two kinds of block ([`BlockKind`]) and what drafting them is worth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Policy {
    pub(super) serial: Round,
    /// `drafted` 0: nothing is drafted ahead.
    pub(super) ahead: Round,
    /// Long-run committed tokens per second.
    pub(super) rate: f64,
    /// What a round that starts with a block drafted ahead is worth over one that drafts its block first, in tokens.
    pub(super) ahead_worth: f64,
    /// Share of rounds whose block is drafted after the call before it.
    pub(super) serial_share: f64,
    pub(super) verifier_s_per_token: f64,
}

impl Policy {
    /// How much `block` of `kind` is worth to this policy, in tokens: its expected tokens less the
    /// round's time at the policy's rate, plus the worth of drafting the next block ahead when it is a hit.
    pub(super) fn value(&self, estimates: &Estimates, kind: BlockKind, block: &Candidate) -> f64 {
        let p_hit =
            if self.ahead.drafted > 0 { block.all_accepted * estimates.beta.value } else { 0.0 };
        let mut time = estimates.round_time_of(
            kind,
            block.drafted,
            p_hit,
            estimates.ahead_drafting_s(self.ahead.drafted),
        );
        if kind == BlockKind::Ahead {
            // Drafting past the policy's length may outlast the call it was drafted under.
            time += (estimates.ahead_drafting_s(block.drafted)
                - estimates.ahead_drafting_s(self.ahead.drafted))
            .max(0.0);
        }
        block.expected_tokens - self.rate * time + p_hit * self.ahead_worth
    }
}

/// Which of a generation's two kinds of block is drafted: their rounds cost differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Drafted once the call before it has returned (a generation's first block, and every block after a
    /// rejection or a wrong guess): its drafting adds to the round.
    Serial,
    /// Drafted during the call before it, as if all of that call's drafts and the guess after them were
    /// right, and sent when they were: its drafting is done when its round starts.
    Ahead,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft_control::estimates::Rate;
    use crate::draft_control::testing::{close, est, known};

    #[test]
    fn expected_tokens_and_round_time_match_hand_computed_values() {
        let e = Estimates {
            alpha: [0.9, 0.8, 0.5].map(known).to_vec(),
            beta: Rate::prior(0.6),
            ..est(0.0, 30.0, 50.0, 80.0, 8.0)
        };
        let tokens: Vec<f64> = (0..=3).map(|d| e.expected_tokens(d)).collect();
        assert!(
            tokens.iter().zip([1.0, 1.9, 2.62, 2.98]).all(|(&x, want)| close(x, want)),
            "{tokens:?}"
        );
        assert!(close(e.round_time(0, true), 0.138) && close(e.round_time(0, false), 0.138));
        assert!(close(e.round_time(2, false), 0.214));
        // P_hit = 0.72 * 0.6; the call (0.154 s) outlasts drafting 3 (0.09 s).
        assert!(
            close(e.round_time(2, true), 0.432 * 0.154 + 0.568 * 0.214),
            "{}",
            e.round_time(2, true)
        );
        // Slow drafting: a hit is bounded by drafting the guess and the next block, 2 * 0.2 s.
        let slow = Estimates { t_draft_s: 0.2, ..e.clone() };
        assert!(
            close(slow.round_time(1, true), 0.54 * 0.4 + 0.46 * 0.346),
            "{}",
            slow.round_time(1, true)
        );
        // Nothing drafted after a miss, 2 drafted ahead: a round of 0 (0.138 s) hits with the guess's 0.6, a
        // block drafted ahead (0.154 s, 2.62 tokens) with 0.72 * 0.6; drafting ahead (0.09 s) outlasts neither call.
        let policy = e.evaluate(&e.lengths(2), 0, 2);
        let (serial_share, ahead_share) = (1.0 - 0.432, 0.6);
        let rate =
            (serial_share + ahead_share * 2.62) / (serial_share * 0.138 + ahead_share * 0.154);
        assert!(
            close(policy.rate, rate)
                && close(policy.serial.p_hit, 0.6)
                && close(policy.ahead.p_hit, 0.432),
            "{policy:?}"
        );
        // Worth of starting a round with a block drafted ahead: its tokens less its time at that rate, over its misses.
        assert!(close(policy.ahead_worth, (2.62 - rate * 0.154) / (1.0 - 0.432)), "{policy:?}");
        assert!(
            close(
                policy.serial.expected_tokens - rate * policy.serial.round_time_s
                    + 0.6 * policy.ahead_worth,
                0.0
            ),
            "{policy:?}"
        );
    }
}
