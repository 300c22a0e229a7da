//! Drafts that cost nothing to draft: tokens copied from a text the answer is likely to repeat.
//!
//! - A **prediction** (OpenAI's predicted outputs): the answer the client expects, e.g. the file it
//!   asked to be rewritten. The answer starts where it starts; after that the last tokens of the
//!   answer are found in it and what follows them is proposed, so it re-aligns after a divergence
//!   (skipping what the answer left out, resuming after what it added).
//! - **Prompt lookup** (llama.cpp's `--lookup`, vLLM's `ngram`): the last tokens of the answer found
//!   earlier in the prompt or the answer itself, and what followed them there.
//!
//! A proposal is verified like any block, with q a point mass on each token: the speculative rule
//! accepts token x with probability p(x) and resamples a rejection from p without x, so the output
//! is still the target's (docs/design.md). A source whose proposal was rejected at once is not
//! asked again for a few rounds (doubling while it keeps failing), so a source with nothing to offer
//! costs no more than its first miss.

/// Where a proposal came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Prediction,
    Lookup,
}

/// A proposed block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    pub source: Source,
}

/// N-gram lengths tried, longest first: a prediction re-aligns on two tokens, the prompt is
/// trusted on three (shorter matches in code are mostly coincidences).
const PREDICTION_NGRAM: (usize, usize) = (2, 8);
const LOOKUP_NGRAM: (usize, usize) = (3, 8);
/// The shortest block a source is asked for after a miss.
const MIN_BLOCK: usize = 4;
/// Rounds a failing source sits out at most.
const MAX_PAUSE: u32 = 16;

/// One source's state: how long a block it is asked for, and whether it sits out this round.
#[derive(Debug, Clone, Copy)]
struct Gate {
    len: usize,
    pause: u32,
    skip: u32,
}

impl Gate {
    fn new(len: usize) -> Self {
        Self { len, pause: 1, skip: 0 }
    }

    fn open(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// A block of `proposed` tokens had its first `accepted` accepted.
    fn observe(&mut self, proposed: usize, accepted: usize, cap: usize) {
        if accepted == 0 {
            self.skip = self.pause;
            self.pause = (self.pause * 2).min(MAX_PAUSE);
        } else {
            self.pause = 1;
        }
        self.len = if accepted == proposed {
            (self.len * 2).min(cap)
        } else {
            (2 * (accepted + 1)).clamp(MIN_BLOCK, cap.max(MIN_BLOCK))
        };
    }
}

/// Proposes blocks from a prediction and from the context, per round.
#[derive(Debug, Clone)]
pub struct Proposer {
    prediction: Vec<u32>,
    lookup: bool,
    /// Longest block (the verifier's limit).
    cap: usize,
    gates: [Gate; 2],
    /// Where the last prediction block started: the answer reads the prediction in order.
    read: usize,
}

impl Proposer {
    /// `prediction`: the expected answer's tokens (may be empty); `lookup`: also look in the prompt
    /// and the answer; `cap`: the longest block the verifier takes.
    pub fn new(prediction: Vec<u32>, lookup: bool, cap: usize) -> Self {
        let cap = cap.max(1);
        let gates = [Gate::new(cap), Gate::new(MIN_BLOCK.min(cap))];
        Self { prediction, lookup, cap, gates, read: 0 }
    }

    /// Tokens in the prediction.
    pub fn prediction_len(&self) -> usize {
        self.prediction.len()
    }

    /// Whether it can ever propose anything.
    pub fn is_active(&self) -> bool {
        !self.prediction.is_empty() || self.lookup
    }

    /// A block for the round after `seq` (the prompt's `prompt_len` tokens, then the answer so
    /// far), at most `max_len` tokens; None where no source has one.
    pub fn propose(&mut self, seq: &[u32], prompt_len: usize, max_len: usize) -> Option<Proposal> {
        if max_len == 0 {
            return None;
        }
        let answer = &seq[prompt_len.min(seq.len())..];
        if !self.prediction.is_empty() && self.gates[0].open() {
            let len = self.gates[0].len.min(max_len);
            let from = match answer {
                [] => Some(0),
                _ => continuation(&self.prediction, answer, PREDICTION_NGRAM, Some(self.read)),
            };
            if let Some(from) = from {
                self.read = from;
                let tokens =
                    self.prediction[from..(from + len).min(self.prediction.len())].to_vec();
                return Some(Proposal { tokens, source: Source::Prediction });
            }
        }
        if self.lookup && !answer.is_empty() && self.gates[1].open() {
            let len = self.gates[1].len.min(max_len);
            // Everything before the answer's last token, so the tail cannot match itself.
            let context = &seq[..seq.len() - 1];
            if let Some(from) = continuation(context, seq, LOOKUP_NGRAM, None) {
                let tokens = context[from..(from + len).min(context.len())].to_vec();
                return Some(Proposal { tokens, source: Source::Lookup });
            }
        }
        None
    }

    /// How the proposal fared: its first `accepted` tokens were accepted.
    pub fn observe(&mut self, proposal: &Proposal, accepted: usize) {
        let gate = &mut self.gates[proposal.source as usize];
        gate.observe(proposal.tokens.len(), accepted, self.cap);
    }
}

/// Where what followed the longest n-gram (within `ngram`) that ends `seq` starts in `source`,
/// with something after it. `from_at_least`: the earliest occurrence continuing at or after this
/// position, where there is one (a prediction is read in order), else the earliest; None: the
/// latest occurrence (the nearest context).
fn continuation(
    source: &[u32],
    seq: &[u32],
    ngram: (usize, usize),
    from_at_least: Option<usize>,
) -> Option<usize> {
    for n in (ngram.0..=ngram.1.min(seq.len())).rev() {
        let tail = &seq[seq.len() - n..];
        let mut ends = (0..source.len().saturating_sub(n))
            .filter(|&i| &source[i..i + n] == tail)
            .map(|i| i + n);
        let found = match from_at_least {
            Some(floor) => {
                let all: Vec<usize> = ends.collect();
                all.iter().find(|&&e| e >= floor).or(all.first()).copied()
            }
            None => ends.next_back(),
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prediction_is_proposed_from_its_start_then_realigned_after_a_divergence() {
        let prediction: Vec<u32> = (100..140).collect();
        let mut p = Proposer::new(prediction, false, 8);
        let prompt = [1, 2, 3];
        let first = p.propose(&prompt, 3, 32).unwrap();
        assert_eq!((first.tokens, first.source), ((100..108).collect(), Source::Prediction));
        // The answer added a token (7) after 104, then went on with 105, 106: resume after 106.
        let seq = [1, 2, 3, 100, 101, 102, 103, 104, 7, 105, 106];
        assert_eq!(p.propose(&seq, 3, 32).unwrap().tokens, (107..115).collect::<Vec<_>>());
        // It skipped 107..=119 and went on with 120, 121: resume after 121.
        let seq = [1, 2, 3, 100, 101, 120, 121];
        assert_eq!(p.propose(&seq, 3, 3).unwrap().tokens, [122, 123, 124]);
        // Nowhere in the prediction: nothing.
        assert_eq!(p.propose(&[1, 2, 3, 9, 9], 3, 8), None);
    }

    #[test]
    fn lookup_proposes_what_followed_the_tail_earlier_in_the_prompt() {
        let mut p = Proposer::new(Vec::new(), true, 16);
        let prompt = [5, 6, 7, 8, 9, 10, 11, 12];
        let seq = [&prompt[..], &[1, 6, 7, 8]].concat();
        let proposal = p.propose(&seq, prompt.len(), 16).unwrap();
        // Asked for its first-block length (4), after the 3-gram 6 7 8.
        assert_eq!((proposal.tokens, proposal.source), (vec![9, 10, 11, 12], Source::Lookup));
        // Two tokens are too few to trust.
        let seq = [&prompt[..], &[1, 7, 8]].concat();
        assert_eq!(p.propose(&seq, prompt.len(), 16), None);
        assert!(!Proposer::new(Vec::new(), false, 16).is_active());
    }

    #[test]
    fn a_failing_source_sits_out_longer_each_time_and_block_lengths_follow_acceptance() {
        let mut p = Proposer::new(Vec::new(), true, 32);
        let seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 1, 6, 7, 8];
        let proposal = p.propose(&seq, 15, 32).unwrap();
        p.observe(&proposal, 0);
        // Sits out one round, then is asked again; after a second miss, two rounds.
        assert_eq!(p.propose(&seq, 15, 32), None);
        let proposal = p.propose(&seq, 15, 32).unwrap();
        p.observe(&proposal, 0);
        assert_eq!((p.propose(&seq, 15, 32), p.propose(&seq, 15, 32)), (None, None));
        let proposal = p.propose(&seq, 15, 32).unwrap();
        assert_eq!(proposal.tokens.len(), 4);
        // All accepted: twice as long next time (up to what follows).
        p.observe(&proposal, 4);
        assert_eq!(p.propose(&seq, 15, 32).unwrap().tokens.len(), 8);
        // Partly accepted: twice what was accepted, plus the correction.
        p.observe(&proposal, 3);
        assert_eq!(p.gates[1].len, 8);
    }
}
