//! Where a block ends ([`BlockEnd`]): within a block, each drafted token's confidence updates what the
//! block is expected to commit ([`BlockOdds`]), and the block goes on while a longer one is worth more
//! to the chosen lengths than ending here.

use super::controller::DraftController;
use super::policy::RATE_TOLERANCE;
use super::round_model::Candidate;
use super::MAX_POSITIONS;

/// Where `auto` ends a block (see the `draft_control` docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BlockEnd {
    /// At the chosen length.
    Length,
    /// Where the draft's confidence says drafting on does not pay, never past the chosen length.
    Early,
    /// Where the draft's confidence says drafting on does not pay, before or past the chosen length, up
    /// to the most a block may hold.
    #[default]
    Confidence,
}

/// What is expected of a block being drafted, from the draft's confidence in each of its tokens so far.
/// Kept by the block itself: a block drafted ahead goes on after the round that started it is observed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockOdds {
    drafted: usize,
    /// P(all drafted so far are accepted).
    all_accepted: f64,
    /// Expected committed tokens if the block ended here: `1 + sum_j P(first j accepted)`.
    expected_tokens: f64,
}

impl Default for BlockOdds {
    fn default() -> Self {
        Self { drafted: 0, all_accepted: 1.0, expected_tokens: 1.0 }
    }
}

impl DraftController {
    /// Whether blocks may end on [`Self::keep_drafting`] before their cap ([`BlockEnd::Length`]: never).
    pub fn ends_blocks_early(&self) -> bool {
        self.block_end != BlockEnd::Length
    }

    /// The most the block of the last [`Self::choose`] may draft: `d`, or with [`BlockEnd::Confidence`]
    /// `max_draft` (0 when `d` is 0: no block).
    pub fn block_cap(&self) -> usize {
        match self.block_end {
            BlockEnd::Confidence if self.choice.draft > 0 => self.max_draft,
            _ => self.choice.draft,
        }
    }

    /// Called after each drafted token of the block of the last [`Self::choose`] with the probability the
    /// draft gave it: whether to draft one more. False at the block's cap ([`Self::block_cap`]), or (unless
    /// [`BlockEnd::Length`]) when ending the block here is worth the most to the chosen lengths
    /// ([`Policy::value`](super::round_model::Policy::value)) of it and the longer blocks up to the cap, given the draft's confidence in the
    /// tokens drafted so far. Blocks worth within [`RATE_TOLERANCE`] of a round's time of the most count as
    /// worth as much, and of those the one nearest the chosen length is drafted: the lengths were chosen
    /// with the same tolerance, so without it blocks of average confidence would end short of their length.
    pub fn keep_drafting(&self, block: &mut BlockOdds, confidence_of_last_drafted: f32) -> bool {
        let e = &self.estimates.optimistic();
        block.all_accepted *= e.acceptance_at(block.drafted, confidence_of_last_drafted);
        block.expected_tokens += block.all_accepted;
        block.drafted = block.drafted.saturating_add(1);
        let cap = self.block_cap().min(MAX_POSITIONS);
        if block.drafted >= cap {
            return false;
        }
        if self.block_end == BlockEnd::Length {
            return true;
        }
        let now = Candidate {
            drafted: block.drafted,
            expected_tokens: block.expected_tokens,
            all_accepted: block.all_accepted,
        };
        let blocks: Vec<(Candidate, f64)> = std::iter::once(now)
            .chain(e.longer_blocks(now, cap))
            .map(|c| (c, self.policy.value(e, self.kind, &c)))
            .collect();
        let top = blocks.iter().map(|&(_, v)| v).fold(f64::NEG_INFINITY, f64::max);
        let slack = RATE_TOLERANCE * self.policy.rate * self.choice.round_time_s;
        let chosen = blocks
            .iter()
            .filter(|&&(_, v)| v >= top - slack)
            .min_by_key(|(c, _)| c.drafted.abs_diff(self.choice.draft));
        chosen.is_some_and(|(c, _)| c.drafted > block.drafted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft_control::estimates::{Estimates, Rate, RoundObservation, BUCKETS};
    use crate::draft_control::round_model::BlockKind;
    use crate::draft_control::testing::est;

    #[test]
    fn low_confidence_stops_the_block_and_high_confidence_runs_to_the_choice() {
        let mut e = Estimates::default();
        for _ in 0..30 {
            e.observe(&RoundObservation {
                drafted: 3,
                accepted: 2,
                confidences: vec![0.95, 0.95, 0.05],
                ..Default::default()
            });
        }
        assert!(e.acceptance_at(0, 0.05) < 0.05 && e.acceptance_at(0, 0.95) > 0.95, "{e:?}");
        let (by_confidence, any_confidence) = (e.by_confidence, e.any_confidence);
        let estimates =
            Estimates { by_confidence, any_confidence, ..est(0.8, 30.0, 200.0, 100.0, 10.0) };
        let mut ctl = DraftController::with_estimates(16, false, estimates.clone())
            .with_block_end(BlockEnd::Early);
        let d = ctl.choose(BlockKind::Serial);
        assert_eq!((d, ctl.block_cap()), (6, 6));
        assert!(!ctl.keep_drafting(&mut BlockOdds::default(), 0.05));
        let mut block = BlockOdds::default();
        let kept = (1..=d).take_while(|_| ctl.keep_drafting(&mut block, 0.97)).count();
        assert_eq!(kept, d - 1, "drafted {d} tokens");
        // A mid-block low-confidence token stops it too.
        let mut block = BlockOdds::default();
        assert!(ctl.keep_drafting(&mut block, 0.97) && !ctl.keep_drafting(&mut block, 0.02));
        // Without early stop the same low-confidence tokens run the block to the chosen length.
        let ctl = ctl.with_block_end(BlockEnd::Length);
        let mut block = BlockOdds::default();
        let kept = (1..=d).take_while(|_| ctl.keep_drafting(&mut block, 0.02)).count();
        assert_eq!(kept, d - 1, "drafted {d} tokens");
        // Ending on confidence alone, confident tokens run the block past the chosen length to the most
        // it may hold, and an unsure one still ends it.
        let mut ctl = DraftController::with_estimates(16, false, estimates)
            .with_block_end(BlockEnd::Confidence);
        assert_eq!((ctl.choose(BlockKind::Serial), ctl.block_cap()), (6, 16));
        let mut block = BlockOdds::default();
        let kept = (1..=16).take_while(|_| ctl.keep_drafting(&mut block, 0.97)).count();
        assert_eq!(kept, 15, "drafted 16 tokens");
        let mut block = BlockOdds::default();
        assert!(
            (0..8).all(|_| ctl.keep_drafting(&mut block, 0.97))
                && !ctl.keep_drafting(&mut block, 0.02)
        );
    }

    #[test]
    fn tokens_as_confident_as_the_average_run_to_the_chosen_length() {
        for rtt in [0.0, 20.0, 50.0, 100.0, 200.0] {
            for overlap in [false, true] {
                let mut e = est(0.8, 30.0, rtt, 60.0, 35.0);
                (e.by_confidence, e.any_confidence) =
                    ([Rate::prior(1.0); BUCKETS], Rate::prior(1.0));
                let mut ctl =
                    DraftController::with_estimates(8, overlap, e).with_block_end(BlockEnd::Early);
                for kind in [BlockKind::Serial, BlockKind::Ahead] {
                    let d = ctl.choose(kind);
                    let mut block = BlockOdds::default();
                    let kept = (1..=d).take_while(|_| ctl.keep_drafting(&mut block, 0.85)).count();
                    assert_eq!(
                        kept,
                        d.saturating_sub(1),
                        "rtt {rtt} overlap {overlap} {kind:?}: d = {d}"
                    );
                }
            }
        }
    }
}
