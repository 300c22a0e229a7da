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
//! is still the target's (docs/design.md).
//!
//! Whether a proposal is sent, and how much of it, is the draft-length controller's call
//! (`DraftController::copied_block`), from what each source is expected to commit
//! ([`Proposer::expected_tokens`]). Every round's proposals are compared with what the round then
//! committed, sent or not ([`Proposer::observe`]): a committed token is the target's draw, which
//! equals a copied token `x` with probability p(x), the chance the rule would have accepted `x`. So
//! a source learns its odds for free while it is not sent, and one with nothing to offer costs nothing.

use crate::draft_control::Rate;

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
    /// Whether it goes on where its source's last proposal left off, that proposal having matched
    /// everything committed since; otherwise the source was searched afresh (the answer's start
    /// counts as aligned for a prediction). Where an answer diverged from a prediction, the
    /// realigned proposals that follow are often wrong from their first token; an aligned one seldom is.
    pub aligned: bool,
    /// What its source has after `tokens` (up to [`THEN`] tokens): a block of the whole proposal
    /// commits one token more, and whether the answer went on as the source does decides whether
    /// the next proposal is aligned.
    pub then: Vec<u32>,
}

/// Tokens a proposal keeps of its source's continuation: the verifier's token after a whole block,
/// and the next proposal's first.
const THEN: usize = 2;

impl Proposal {
    /// `text[from..]`'s first `len` tokens, not aligned.
    fn new(source: Source, text: &[u32], from: usize, len: usize) -> Self {
        let end = (from + len).min(text.len());
        let then = text[end..(end + THEN).min(text.len())].to_vec();
        Self { tokens: text[from..end].to_vec(), source, aligned: false, then }
    }

    /// Its first `len` tokens.
    pub fn first(&self, len: usize) -> Self {
        let len = len.min(self.tokens.len());
        let then = self.tokens[len..].iter().chain(&self.then).take(THEN).copied().collect();
        Self { tokens: self.tokens[..len].to_vec(), then, ..*self }
    }
}

/// N-gram lengths tried, longest first: a prediction re-aligns on two tokens, the prompt is
/// trusted on three (shorter matches in code are mostly coincidences).
const PREDICTION_NGRAM: (usize, usize) = (2, 8);
const LOOKUP_NGRAM: (usize, usize) = (3, 8);
/// Weight of a new outcome of a token after a proposal's first (a memory of ~50 tokens, a few
/// blocks): a block brings up to its length in outcomes, and one block must not decide the next.
const REST_GAIN: f64 = 0.02;

/// A source's acceptance by position: its first token (the match may be a coincidence), and each
/// token after an accepted one (the text, once aligned, tends to go on repeating).
#[derive(Debug, Clone, Copy)]
struct Odds {
    first: Rate,
    rest: Rate,
}

impl Odds {
    const fn prior(first: f64, rest: f64) -> Self {
        Self { first: Rate::prior(first), rest: Rate::prior(rest) }
    }

    /// `E(k)` for `k` in `1..=len`: the tokens a block of the first `k` commits on average (the
    /// accepted ones and the one the verifier adds).
    fn expected_tokens(&self, len: usize) -> Vec<f64> {
        let (mut sum, mut all_accepted) = (1.0, self.first.value);
        (0..len)
            .map(|_| {
                sum += all_accepted;
                all_accepted *= self.rest.value;
                sum
            })
            .collect()
    }

    /// A proposal whose first `matched` of `compared` tokens were the committed ones.
    fn observe(&mut self, matched: usize, compared: usize) {
        if compared == 0 {
            return;
        }
        self.first.learn(f64::from(u8::from(matched > 0)));
        for position in 1..compared.min(matched + 1) {
            self.rest.learn_at(f64::from(u8::from(position < matched)), REST_GAIN);
        }
    }
}

/// Proposes blocks from a prediction and from the context, per round.
#[derive(Debug, Clone)]
pub struct Proposer {
    prediction: Vec<u32>,
    lookup: bool,
    /// Longest block (the verifier's limit).
    cap: usize,
    /// By [`Source`], then realigned or aligned ([`Proposal::aligned`]). Learning costs nothing
    /// (unsent proposals are compared too), so a prior need not be optimistic to be corrected: a
    /// prediction is the client's word for the answer, a lookup's first token is assumed a
    /// coincidence until the text shows otherwise.
    odds: [[Odds; 2]; 2],
    /// Where the last prediction block started: the answer reads the prediction in order.
    read: usize,
    /// By [`Source`]: the token its next proposal starts with if it goes on where the last one
    /// left off (that one having matched all that was committed since).
    next: [Option<u32>; 2],
}

impl Proposer {
    /// `prediction`: the expected answer's tokens (may be empty); `lookup`: also look in the prompt
    /// and the answer; `cap`: the longest block the verifier takes.
    pub fn new(prediction: Vec<u32>, lookup: bool, cap: usize) -> Self {
        let odds = [
            [Odds::prior(0.7, 0.9), Odds::prior(0.9, 0.95)],
            [Odds::prior(0.2, 0.8), Odds::prior(0.5, 0.85)],
        ];
        Self { prediction, lookup, cap: cap.max(1), odds, read: 0, next: [None; 2] }
    }

    /// Tokens in the prediction.
    pub fn prediction_len(&self) -> usize {
        self.prediction.len()
    }

    /// Whether it can ever propose anything.
    pub fn is_active(&self) -> bool {
        !self.prediction.is_empty() || self.lookup
    }

    /// Each source's block for the round after `seq` (the prompt's `prompt_len` tokens, then the
    /// answer so far), at most `max_len` tokens (and the verifier's cap); empty where none has one.
    pub fn propose(&mut self, seq: &[u32], prompt_len: usize, max_len: usize) -> Vec<Proposal> {
        let len = max_len.min(self.cap);
        let mut proposals = Vec::new();
        if len == 0 {
            return proposals;
        }
        let answer = &seq[prompt_len.min(seq.len())..];
        let next = std::mem::take(&mut self.next);
        let aligned = |p: &Proposal| p.tokens.first() == next[p.source as usize].as_ref();
        if !self.prediction.is_empty() {
            let from = match answer {
                [] => Some(0),
                _ => continuation(&self.prediction, answer, PREDICTION_NGRAM, Some(self.read)),
            };
            if let Some(from) = from {
                self.read = from;
                let proposal = Proposal::new(Source::Prediction, &self.prediction, from, len);
                let aligned = answer.is_empty() || aligned(&proposal);
                proposals.push(Proposal { aligned, ..proposal });
            }
        }
        if self.lookup && !answer.is_empty() {
            // Everything before the answer's last token, so the tail cannot match itself.
            let context = &seq[..seq.len() - 1];
            if let Some(from) = continuation(context, seq, LOOKUP_NGRAM, None) {
                let proposal = Proposal::new(Source::Lookup, context, from, len);
                proposals.push(Proposal { aligned: aligned(&proposal), ..proposal });
            }
        }
        proposals
    }

    /// `E(k)` for `k` in `1..=proposal.tokens.len()`: what sending the proposal's first `k` tokens
    /// commits on average, by its source's odds.
    pub fn expected_tokens(&self, proposal: &Proposal) -> Vec<f64> {
        self.odds_of(proposal).expected_tokens(proposal.tokens.len())
    }

    /// Learns from the tokens committed after `proposal` was made, whether it was sent or not.
    /// Call it for each of a round's proposals before the next [`Proposer::propose`].
    pub fn observe(&mut self, proposal: &Proposal, committed: &[u32]) {
        let compared = proposal.tokens.len().min(committed.len());
        let matched = proposal.tokens.iter().zip(committed).take_while(|(p, c)| p == c).count();
        self.odds_of_mut(proposal).observe(matched, compared);
        // Past the proposal too: a whole block's verifier token may still be the source's.
        let mut source = proposal.tokens.iter().chain(&proposal.then);
        let followed = source.clone().zip(committed).take_while(|(p, c)| p == c).count();
        self.next[proposal.source as usize] =
            source.nth(followed).copied().filter(|_| followed == committed.len());
    }

    fn odds_of(&self, proposal: &Proposal) -> &Odds {
        &self.odds[proposal.source as usize][usize::from(proposal.aligned)]
    }

    fn odds_of_mut(&mut self, proposal: &Proposal) -> &mut Odds {
        &mut self.odds[proposal.source as usize][usize::from(proposal.aligned)]
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
        let first = p.propose(&prompt, 3, 32);
        let want = Proposal {
            tokens: (100..108).collect(),
            source: Source::Prediction,
            aligned: true,
            then: vec![108, 109],
        };
        assert_eq!(first, [want]);
        // The answer added a token (7) after 104, then went on with 105, 106: resume after 106.
        let seq = [1, 2, 3, 100, 101, 102, 103, 104, 7, 105, 106];
        assert_eq!(p.propose(&seq, 3, 32)[0].tokens, (107..115).collect::<Vec<_>>());
        // It skipped 107..=119 and went on with 120, 121: resume after 121.
        let seq = [1, 2, 3, 100, 101, 120, 121];
        assert_eq!(p.propose(&seq, 3, 3)[0].tokens, [122, 123, 124]);
        // Nowhere in the prediction: nothing.
        assert_eq!(p.propose(&[1, 2, 3, 9, 9], 3, 8), []);
    }

    #[test]
    fn lookup_proposes_what_followed_the_tail_earlier_in_the_prompt() {
        let mut p = Proposer::new(Vec::new(), true, 16);
        let prompt = [5, 6, 7, 8, 9, 10, 11, 12];
        let seq = [&prompt[..], &[1, 6, 7, 8]].concat();
        // After the 3-gram 6 7 8, on to the context's end (the answer's tokens but its last).
        let want = Proposal {
            tokens: vec![9, 10, 11, 12, 1, 6, 7],
            source: Source::Lookup,
            aligned: false,
            then: vec![],
        };
        assert_eq!(p.propose(&seq, prompt.len(), 16), std::slice::from_ref(&want));
        let first_two = want.first(2);
        assert_eq!((first_two.tokens, first_two.then), (vec![9, 10], vec![11, 12]));
        // Two tokens are too few to trust.
        let seq = [&prompt[..], &[1, 7, 8]].concat();
        assert_eq!(p.propose(&seq, prompt.len(), 16), []);
        assert!(!Proposer::new(Vec::new(), false, 16).is_active());
    }

    #[test]
    fn both_sources_propose_when_both_have_a_continuation() {
        let mut p = Proposer::new(vec![9, 10, 50, 51], true, 16);
        let prompt = [5, 6, 7, 8, 9, 10, 11, 12];
        let seq = [&prompt[..], &[7, 8, 9, 10]].concat();
        let sources: Vec<Source> =
            p.propose(&seq, prompt.len(), 16).iter().map(|p| p.source).collect();
        assert_eq!(sources, [Source::Prediction, Source::Lookup]);
    }

    #[test]
    fn expected_tokens_follow_the_odds_and_learn_from_what_was_committed() {
        let odds = Odds::prior(0.5, 0.8);
        let e = odds.expected_tokens(3);
        let want = [1.5, 1.5 + 0.4, 1.5 + 0.4 + 0.32];
        assert!(e.iter().zip(want).all(|(x, w)| (x - w).abs() < 1e-12), "{e:?}");
        let mut p = Proposer::new(Vec::new(), true, 16);
        let proposal = Proposal::new(Source::Lookup, &[1, 2, 3, 4], 0, 4);
        let before = p.expected_tokens(&proposal);
        // Committed 1 2 3 then something else: a rejection at the fourth token; first accepted.
        p.observe(&proposal, &[1, 2, 3, 9, 9]);
        let odds = p.odds[Source::Lookup as usize][0];
        assert!(odds.first.value > 0.2 && odds.first.outcomes == 1 && odds.rest.outcomes == 3);
        assert!(p.expected_tokens(&proposal)[0] > before[0]);
        // A first token that was not committed lowers the first odds and teaches nothing after it.
        p.observe(&proposal, &[7]);
        let odds = p.odds[Source::Lookup as usize][0];
        assert!(odds.first.outcomes == 2 && odds.rest.outcomes == 3);
        // Nothing committed (the round failed): nothing learnt.
        p.observe(&proposal, &[]);
        assert_eq!(p.odds[Source::Lookup as usize][0].first.outcomes, 2);
    }

    #[test]
    fn a_proposal_is_aligned_while_the_answer_follows_its_source_and_learns_apart_after() {
        let prediction: Vec<u32> = (100..140).collect();
        let mut p = Proposer::new(prediction, false, 8);
        let prompt = [1, 2, 3];
        let first = p.propose(&prompt, 3, 32).remove(0);
        assert!(first.aligned);
        // Four tokens committed, all as proposed: the next proposal goes on from 104, aligned.
        p.observe(&first, &[100, 101, 102, 103]);
        let seq = [1, 2, 3, 100, 101, 102, 103];
        let second = p.propose(&seq, 3, 32).remove(0);
        assert!(second.aligned && second.tokens[0] == 104);
        // The answer diverged (7 for 104, then 105 and 106 as the prediction has them): the
        // proposal found after it is realigned, and learning from it leaves the aligned odds alone.
        p.observe(&second, &[7, 105, 106]);
        let seq = [1, 2, 3, 100, 101, 102, 103, 7, 105, 106];
        let third = p.propose(&seq, 3, 32).remove(0);
        assert!(!third.aligned && third.tokens[0] == 107);
        let aligned_before = p.expected_tokens(&second);
        p.observe(&third, &[9]);
        assert_eq!(p.expected_tokens(&second), aligned_before);
        assert!(p.odds[Source::Prediction as usize][0].first.outcomes == 1);
        // Its first token was not committed: nothing to go on from, so realigned.
        let fourth = p.propose(&[1, 2, 3, 100, 101], 3, 32).remove(0);
        assert!(!fourth.aligned);
    }

    #[test]
    fn a_whole_block_and_the_verifiers_token_after_it_keep_the_next_proposal_aligned() {
        let prediction: Vec<u32> = (100..140).collect();
        // The block cap (8) is the whole proposal: the round commits it and the verifier's 108.
        let mut p = Proposer::new(prediction, false, 8);
        let prompt = [1, 2, 3];
        let first = p.propose(&prompt, 3, 32).remove(0);
        p.observe(&first, &(100..109).collect::<Vec<_>>());
        let seq: Vec<u32> = prompt.iter().copied().chain(100..109).collect();
        let second = p.propose(&seq, 3, 32).remove(0);
        assert!(second.aligned && second.tokens[0] == 109, "{second:?}");
        // A verifier's token after the whole block that is not the source's: realigned.
        p.observe(&second, &(109..117).chain([7]).collect::<Vec<_>>());
        let seq: Vec<u32> = seq.iter().copied().chain(109..117).chain([7, 117, 118]).collect();
        assert!(!p.propose(&seq, 3, 32)[0].aligned);
    }
}
