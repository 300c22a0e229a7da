//! Draft-length control: how many tokens the edge drafts per round, chosen online.
//!
//! # Round model
//!
//! One round: the edge drafts `d` tokens (`t_start + d * t_draft`: `t_start` is what a block costs before its
//! first step, starting a draft request and catching up on the tokens committed since the last one) and sends
//! them; the call takes `rtt + V(d+1)`, where
//! `V(rows)` is the verifier's compute for `d + 1` scored rows (measured per block size, see
//! [`Estimates::verify_time`]); the verifier commits the accepted
//! prefix plus one token (correction or bonus). With `alpha_i = P(position i accepted | all before accepted)`,
//! a round commits `E(d) = sum_{j=0..=d} prod_{i<j} alpha_i` tokens on average.
//!
//! Draft-ahead: while the call is in flight the edge drafts the optimistic continuation (a guess of the bonus
//! token, then the next block). It is used ("hit") when all `d` drafts are accepted and the guess equals the
//! verifier's bonus, `P_hit(d) = prod_{i<d} alpha_i * beta`. So a generation has two kinds of block
//! ([`BlockKind`]): one drafted ahead, whose drafting is done when its round starts (the round costs its call,
//! `rtt + V(d+1)`), and one drafted after a miss, in series with the link (`t_start + d * t_draft` more). A
//! hit makes the next block one drafted ahead; if drafting it (`t_start + (a+1) * t_draft` for a block of
//! `a`) outlasts the call, the next round waits for the rest. Without draft-ahead every block is drafted in
//! series. `d = 0` is plain target decoding: `E = 1`, and with draft-ahead its call still drafts the guess and
//! the next block, so a round of 0 after a miss leaves drafting for the idle time under the call. With
//! `a = 0` nothing is drafted ahead but a guess every few rounds of 0 (the edge is idle then), whose match
//! counts as an outcome of `alpha_0`: this probe keeps the estimates alive while drafting does not pay, so
//! a length of 0 is left again when the link slows down or the text gets easier. Likewise the guess after a
//! fully accepted block of `d` is an outcome of `alpha_d`, so a short length learns whether a longer one would pay.
//!
//! The lengths are a pair: `s` for blocks drafted in series and `a` for blocks drafted ahead. A block
//! drafted in series costs a draft step and a verifier row per token, one drafted ahead only the row, so
//! the best `s` is often shorter than the best `a`: on the benchmark's host a single length for both was
//! ~5% slower in this model than the best pair (`policy::tests::after_a_miss_a_shorter_block_…`). Rounds of the
//! two kinds alternate as a two-state Markov chain (a round in series is followed by one drafted ahead with
//! `P_hit(s)`, one drafted ahead by one in series with `1 - P_hit(a)`), so a pair's long-run rate is its
//! rounds' expected tokens over their expected time, weighted by the chain's shares of rounds. Each round
//! picks the pair in `0..=max` that maximises that rate, committed tokens per second: a long link makes
//! every call expensive, so more drafts per call pay; a cheap link or a draft that is rarely accepted makes
//! them waste draft and verifier time. Pairs within 3% of the best rate count as equally fast, and of those
//! the one with the least verifier time per committed token is drafted (usually the longest; see
//! [`RATE_TOLERANCE`](policy::RATE_TOLERANCE) for why).
//!
//! Where a block ends ([`BlockEnd`]): within a block, [`DraftController::keep_drafting`] weighs ending
//! here against drafting on, with the acceptance of the tokens drafted so far estimated from the draft's
//! confidence in each. A block is weighed by what it is worth to the chosen pair: its expected tokens, less
//! its round's time at the pair's rate, plus what the hit it may bring is worth (a round that starts with a
//! block drafted ahead is worth more than one that drafts first; the chain gives how much). It goes on
//! only while some longer block is worth more than ending here. With
//! [`BlockEnd::Confidence`] (the gateway's default) the longer blocks reach up to `max`, so a block
//! ends where the draft turns unsure, before or after `d`; `d` is then what the model expects of a block
//! before its tokens are seen (and whether to draft at all). With [`BlockEnd::Early`] they reach only up
//! to `d`; with [`BlockEnd::Length`] every block runs to `d`. Under greedy decoding the draft's softmax
//! probability of its token sorts its drafts well: on the benchmark's four long texts, drafts it gave at
//! least 0.9 were the target's 99.3% of the time (two thirds of all drafts), those below 0.8 about half
//! the time (`engine/examples/acceptance_trace.rs`). So a block runs on through a confident stretch,
//! which no fixed length can, and stops at the first unsure token, where a rejection is likely.
//!
//! All inputs are exponentially weighted online estimates ([`Estimates`]), so they follow drift (a route
//! change moving the RTT from 20 to 150 ms) within a few rounds; acceptance rates average their first
//! outcomes with their prior instead, so a fresh gateway leaves its priors within a few rounds too. The
//! gateway keeps one gateway-wide instance, clones it into each generation's [`DraftController`] and feeds
//! it every generation's observations too.
//!
//! Acceptance is chosen with optimistically, as in UCB-SpecStop (arXiv 2606.20591): every position's
//! `alpha_i` leans on the acceptance pooled over all positions (which learns from every outcome), and the
//! pooled rate is read half a standard error high. A plug-in estimate learned in one generation's first
//! rounds is low about as often as high, but a low one picks short blocks, which then teach it less (fewer
//! outcomes a round) and for longer. Half a standard error put `auto` nearest the best fixed length, of
//! the readings tried (measured: see docs/benchmarks.md, adaptive draft length).
//!
//! # Files
//!
//! - `estimates`: what one round showed ([`RoundObservation`]) and the online estimates learnt from it.
//! - `verify_time`: the verifier's time by block size, from its calls and its own pass times.
//! - `round_model`: a round's expected tokens and time, and a pair of lengths' long-run rate.
//! - `policy`: the pair of lengths chosen ([`DraftChoice`]).
//! - `controller`: one generation's [`DraftController`].
//! - `block_end`: where a block ends ([`BlockEnd`]), from the draft's confidence in its tokens.
//! - `record`: the speculative loop's per-round log record ([`RoundRecord`]).

mod block_end;
mod controller;
mod estimates;
mod policy;
mod record;
mod round_model;
#[cfg(test)]
mod testing;
mod verify_time;

pub use block_end::{BlockEnd, BlockOdds};
pub use controller::{CopiedBlock, DraftController};
pub(crate) use estimates::Rate;
pub use estimates::{Estimates, RoundObservation};
pub use policy::DraftChoice;
pub use record::RoundRecord;
pub use round_model::BlockKind;

/// Most draft positions modelled, so an absurd `max_draft` or observation cannot allocate without bound.
const MAX_POSITIONS: usize = 1024;
