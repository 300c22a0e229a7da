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
//! ~5% slower in this model than the best pair (`tests::after_a_miss_a_shorter_block_…`). Rounds of the
//! two kinds alternate as a two-state Markov chain (a round in series is followed by one drafted ahead with
//! `P_hit(s)`, one drafted ahead by one in series with `1 - P_hit(a)`), so a pair's long-run rate is its
//! rounds' expected tokens over their expected time, weighted by the chain's shares of rounds. Each round
//! picks the pair in `0..=max` that maximises that rate, committed tokens per second: a long link makes
//! every call expensive, so more drafts per call pay; a cheap link or a draft that is rarely accepted makes
//! them waste draft and verifier time. Pairs within 3% of the best rate count as equally fast, and of those
//! the one with the least verifier time per committed token is drafted (usually the longest; see
//! [`RATE_TOLERANCE`] for why).
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
//! outcomes a round) and for longer. Replaying the benchmark's acceptance traces
//! (`examples/draft_control_sim.rs`, fresh gateways, RTT 0, 50, 100 ms and drift, two verifiers' timings),
//! `auto` ran 3.3% behind the best fixed length on average with per-position rates alone, 1.8% with the
//! pooled rate read plainly, 1.35% half a standard error high and 2.0% a whole one (docs/benchmarks.md).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::pass_times::{Gains, PacedTimes};

/// Buckets of the acceptance-by-confidence table, of equal width over `[0, 1]`.
const BUCKETS: usize = 10;
/// Weight of a new acceptance outcome (by position, by confidence, bonus guess) once a rate has seen enough
/// (a memory of ~17 outcomes). With 0.15 one rejection moved `alpha_0` from 0.97 to 0.82, and on a CPU
/// verifier at a low RTT, where the best length turns on whether `alpha` is 0.85 or 0.93, `auto` swung
/// between 1 and 5 drafts on a text the draft predicts well (per-round log, bench quick-dec2-sticky).
const ACCEPT_GAIN: f64 = 0.06;
/// Outcomes a generation's copy of the gateway-wide rates counts theirs as: it learns its own text from
/// there (gains 1/9, 1/10, …), moving half-way to its own rate within ~8 outcomes.
const SEED_OUTCOMES: u32 = 4;
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
/// Standard errors the pooled acceptance is read above its estimate (see the module docs): one made the
/// first blocks of a fresh gateway 8 drafts long where a 6th verify row cost more than the 5th.
const OPTIMISM: f64 = 0.5;
/// Weight of a new timing sample (RTT, draft step): links change abruptly, and 0.3 closes 97% of a step in 10 rounds.
const TIME_GAIN: f64 = 0.3;
/// Per-observation decay of the verifier-time fit's sums (a memory of ~20 calls): slower than [`TIME_GAIN`]
/// because a two-parameter fit needs a few distinct block sizes in its memory, and calls of one size vary
/// by ±25% on a shared host; with 0.85 the per-row slope wandered between 40 and 100 ms in one generation
/// (per-round log), and `examples/draft_control_sim.rs` gains 1-2% at every RTT from 0.95.
const FIT_DECAY: f64 = 0.95;
/// Pull of the fitted per-row time towards its previous value, in observations' weight. It makes the fit fall
/// back to the previous (at first, prior) `b` when all remembered blocks have the same size, and is negligible otherwise.
const FIT_RIDGE: f64 = 0.05;
/// Most draft positions modelled, so an absurd `max_draft` or observation cannot allocate without bound.
const MAX_POSITIONS: usize = 1024;
/// Floor of a modelled round time, so rates stay finite when every cost is estimated at zero.
const MIN_ROUND_S: f64 = 1e-6;
/// Longest timing sample believed, in seconds: a longer call or draft is an outage, not a round to model.
const MAX_SAMPLE_S: f64 = 600.0;
/// A drafting-time sample moves its estimate at most this factor either way: one block that waited on
/// something else (the draft model's prompt processing, another generation's round) must not set the
/// step time for many rounds, which it would when no drafting follows to correct it (a length of 0).
const MAX_DRAFT_SAMPLE_RATIO: f64 = 4.0;
/// A verifier-time sample is read at most this factor off its block size's modelled time either way. Calls of one size
/// vary by 8-12% from one to the next, but one in 27 takes over 35% longer (a shared host), and a size
/// timed once or twice during one, then left, kept that time: `auto` drafted 2-3 for the rest of a text
/// where 4 was 15% faster (benchmark quick-dec3-four and -four2, replayed with
/// `examples/draft_control_replay.rs`). A verifier that got 50% slower is still believed within about ten
/// calls.
const MAX_VERIFY_SAMPLE_RATIO: f64 = 1.15;
/// How the verifier's time by block size is learnt ([`crate::pass_times`]): a call moves the pace every
/// size shares at [`TIME_GAIN`] and its own size's time at 0.05. When each size followed only its own
/// calls, a size that met a few slow calls looked costly until it was drafted again, which its cost kept
/// it from: over a gateway's successive generations the sizes next to the best drifted up one by one, and
/// `auto` ran 5-7% behind d = 4 at 50-150 ms where fresh gateways ran 1-3% behind
/// (`examples/draft_control_sim.rs --warm --phases` with this host's pass times and draft step), as the
/// benchmark's gateways did once each served every prompt of a link.
const VERIFY_GAINS: Gains = Gains { pace: TIME_GAIN, shape: 0.05, max_ratio: MAX_VERIFY_SAMPLE_RATIO };
/// Modelled rates (committed tokens per second) this close to the highest count as equally fast, and the
/// length among them that costs the verifier least per committed token is drafted. The rate is flat near
/// its optimum when the verifier's per-call cost dwarfs its per-row cost (CPU verify blocks of 2-6 rows
/// are one pass over the weights), so its argmax wanders between lengths with the estimates' noise, while
/// a longer block of the same speed saves verifier compute (the cloud's bill) and per-round costs the
/// model leaves out (starting a draft request, committing and streaming). 3%: the benchmark's
/// goal is 5% of the best fixed length.
const RATE_TOLERANCE: f64 = 0.03;
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
    /// none: see [`DraftController`]'s probe) were accepted.
    pub ahead_guess: Option<bool>,
}

/// Online estimates of the round model's inputs. `Default` holds the priors a fresh gateway starts from:
/// `alpha_i = 0.7`, `beta = 0.6`, `t_draft = 30 ms`, `t_start = 30 ms`, `rtt = 10 ms`, `V(rows) = 80 ms + 8 ms * rows`, and an
/// acceptance by confidence of `(0.7 + bucket centre) / 2`: draft confidence tends to track acceptance, but a
/// fresh gateway should not trust it fully before it has seen outcomes.
#[derive(Clone, Debug, Serialize)]
pub struct Estimates {
    /// `P(position i accepted | all before accepted)` from position `i`'s own outcomes (see [`Estimates::alpha`]).
    alpha: Vec<Rate>,
    /// The same over every position's outcomes.
    pooled: Rate,
    /// P(the drafted-ahead bonus guess equals the verifier's bonus | all drafts accepted).
    beta: Rate,
    /// P(a draft is accepted | all before accepted, its confidence in bucket k).
    by_confidence: [Rate; BUCKETS],
    /// The same over every bucket: what a bucket's rate is read against (see [`Estimates::acceptance_at`]).
    any_confidence: Rate,
    t_draft_s: f64,
    t_start_s: f64,
    rtt_s: f64,
    verify_a_s: f64,
    verify_b_s: f64,
    /// RTT samples seen: the first replaces the prior, the next few are averaged with it.
    #[serde(skip)]
    rtt_samples: u32,
    /// The verifier's time by scored rows ([`VERIFY_GAINS`]).
    #[serde(skip)]
    verify_by_rows: PacedTimes,
    /// Rounds observed, priors excluded.
    rounds: u64,
    #[serde(skip)]
    fit: Fit,
}

/// Exponentially decayed sums of the weighted least-squares fit `V(rows) = a + b * rows`.
#[derive(Clone, Debug, Default)]
struct Fit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Default for Estimates {
    fn default() -> Self {
        let by_confidence = std::array::from_fn(|k| Rate::prior(0.5 * ALPHA_PRIOR + 0.5 * (k as f64 + 0.5) / BUCKETS as f64));
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
struct Rate {
    value: f64,
    outcomes: u32,
}

impl Rate {
    const fn prior(value: f64) -> Self {
        Self { value, outcomes: 0 }
    }

    /// The rate as a generation's starting point ([`SEED_OUTCOMES`]).
    fn as_seed(self) -> Self {
        Self { outcomes: self.outcomes.min(SEED_OUTCOMES), ..self }
    }

    fn learn(&mut self, outcome: f64) {
        self.learn_at(outcome, ACCEPT_GAIN);
    }

    fn learn_at(&mut self, outcome: f64, gain: f64) {
        let gain = (1.0 / (f64::from(self.outcomes) + 1.0 + PRIOR_OUTCOMES)).max(gain);
        self.outcomes = self.outcomes.saturating_add(1);
        ew(&mut self.value, outcome, gain);
    }

    /// The rate plus `z` standard errors of a mean of its outcomes and its prior's (at most 1).
    fn upper(self, z: f64) -> f64 {
        let variance = self.value * (1.0 - self.value) / (f64::from(self.outcomes) + PRIOR_OUTCOMES);
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
            Some(k) if self.any_confidence.value > 0.0 => (alpha * self.by_confidence[k].value / self.any_confidence.value).clamp(0.0, 1.0),
            _ => alpha,
        }
    }

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
            (Some((r0, v0)), Some((r1, v1))) if r1 > r0 => v0 + (v1 - v0) * (rows - r0) as f64 / (r1 - r0) as f64,
            (Some((r0, v0)), _) => v0 + b * (rows - r0) as f64,
            (None, Some((r1, v1))) => (v1 - b * (r1 - rows) as f64).max(0.0),
            (None, None) => self.verify_a_s + b * rows as f64,
        }
    }

    /// The estimates a length is chosen with: the pooled acceptance read [`OPTIMISM`] standard errors high
    /// (see the module docs).
    fn optimistic(&self) -> Self {
        let mut view = self.clone();
        view.pooled.value = self.pooled.upper(OPTIMISM);
        view
    }

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
        policy.serial_share * policy.serial.round_time_s + (1.0 - policy.serial_share) * policy.ahead.round_time_s
    }

    /// Each length `0..=max`'s block before its tokens are seen: `E(d)` and P(all `d` accepted).
    fn lengths(&self, max: usize) -> Vec<Candidate> {
        let mut lengths = vec![Candidate::zero()];
        lengths.extend(self.longer_blocks(Candidate::zero(), max));
        lengths
    }

    /// The blocks that go on from `from` one more draft at a time, up to `to` drafts (drafts past
    /// `from` accepted at `alpha` of their position).
    fn longer_blocks(&self, from: Candidate, to: usize) -> impl Iterator<Item = Candidate> + Clone + '_ {
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
    fn round_time_of(&self, kind: BlockKind, drafted: usize, p_hit: f64, ahead_s: f64) -> f64 {
        let call = self.rtt_s + self.verify_time(drafted + 1);
        let drafting = match kind {
            BlockKind::Serial if drafted > 0 => self.t_start_s + drafted as f64 * self.t_draft_s,
            _ => 0.0,
        };
        (drafting + call + p_hit * (ahead_s - call).max(0.0)).max(MIN_ROUND_S)
    }

    /// Drafting a block of `ahead` ahead, its guess first.
    fn ahead_drafting_s(&self, ahead: usize) -> f64 {
        self.t_start_s + (ahead + 1) as f64 * self.t_draft_s
    }

    /// The long-run rate of drafting `serial` after a miss and `ahead` during each call (0: nothing drafted
    /// ahead), from `lengths` ([`Estimates::lengths`]), and what a round in each state expects.
    ///
    /// A serial round leads to an ahead round with its `P_hit`, an ahead round back to a serial one with
    /// `1 - P_hit`, so in the long run the shares of rounds are `1 - P_hit(ahead)` to `P_hit(serial)`; the
    /// rate is their expected tokens over their expected time. The ahead state's worth over the serial one
    /// (in tokens) follows from the ahead state's balance: `E_a - rate * T_a + P_hit(ahead) * worth = worth`.
    fn evaluate(&self, lengths: &[Candidate], serial: usize, ahead: usize) -> Policy {
        let beta = if ahead > 0 { self.beta.value } else { 0.0 };
        let ahead_s = self.ahead_drafting_s(ahead);
        let round = |kind, c: Candidate| {
            let p_hit = c.all_accepted * beta;
            Round { drafted: c.drafted, expected_tokens: c.expected_tokens, round_time_s: self.round_time_of(kind, c.drafted, p_hit, ahead_s), p_hit }
        };
        let (s, a) = (round(BlockKind::Serial, lengths[serial]), round(BlockKind::Ahead, lengths[ahead]));
        let (ws, wa) = if s.p_hit > 0.0 { (1.0 - a.p_hit, s.p_hit) } else { (1.0, 0.0) };
        let rate = (ws * s.expected_tokens + wa * a.expected_tokens) / (ws * s.round_time_s + wa * a.round_time_s);
        let ahead_worth =
            if a.p_hit < 1.0 { (a.expected_tokens - rate * a.round_time_s) / (1.0 - a.p_hit) } else { (rate * s.round_time_s - s.expected_tokens) / s.p_hit };
        let verifier = (ws * self.verify_time(serial + 1) + wa * self.verify_time(ahead + 1)) / (ws * s.expected_tokens + wa * a.expected_tokens);
        Policy { serial: s, ahead: a, rate, ahead_worth, serial_share: ws / (ws + wa), verifier_s_per_token: verifier }
    }

    /// The lengths to draft, with their inputs: of every pair of a serial length in `0..=max_draft` and an
    /// ahead length (in `0..=max_draft` with draft-ahead, where 0 drafts nothing ahead; 0 without), the pairs whose long-run rate is
    /// within [`RATE_TOLERANCE`] of the highest, and of those the one with the least verifier time per
    /// committed token; but the `previous` pair while its rate is within [`RATE_TOLERANCE`] of that
    /// choice's. Changing length costs what the model leaves out: a block drafted ahead at the old length
    /// is sent short or drafted on after the call, and leaving 0 drafts the first block after the call and
    /// catches the draft up on the tokens committed meanwhile. On a CPU verifier at a low RTT, where every
    /// length from 0 to 4 is modelled within a few percent, `auto` changed length most rounds and ran
    /// 10% behind both d = 1 and d = 4 (benchmark quick-dec2-seeded, RTT 0).
    ///
    /// Called on the [`Estimates::optimistic`] view.
    fn best(&self, max_draft: usize, overlap: bool, previous: Option<(usize, usize)>) -> Policy {
        let max_draft = max_draft.min(MAX_POSITIONS);
        let lengths = self.lengths(max_draft);
        let aheads = if overlap { 0..=max_draft } else { 0..=0 };
        let policies: Vec<Policy> = aheads.flat_map(|a| (0..=max_draft).map(move |s| (s, a))).map(|(s, a)| self.evaluate(&lengths, s, a)).collect();
        let top_rate = policies.iter().map(|p| p.rate).fold(f64::NEG_INFINITY, f64::max);
        let as_fast = |p: &&Policy| p.rate >= (1.0 - RATE_TOLERANCE) * top_rate;
        let chosen = policies
            .iter()
            .filter(as_fast)
            .min_by(|x, y| x.verifier_s_per_token.total_cmp(&y.verifier_s_per_token))
            .copied()
            .unwrap_or_else(|| self.evaluate(&lengths, 0, 0));
        let kept = previous.and_then(|(s, a)| policies.iter().find(|p| p.serial.drafted == s && p.ahead.drafted == a));
        kept.filter(|k| k.rate >= (1.0 - RATE_TOLERANCE) * chosen.rate).copied().unwrap_or(chosen)
    }

    /// What a round of `kind` under `policy` reports: its length and expectations, and the inputs, as
    /// chosen with (the optimistic view), but the plain acceptance `plain`.
    fn choice_of(&self, policy: &Policy, kind: BlockKind, max_draft: usize, plain: f64) -> DraftChoice {
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
        let sample = |t: Duration| Some(t.as_secs_f64()).filter(|&s| s > 0.0 && s <= MAX_SAMPLE_S && round.drafted <= MAX_POSITIONS);
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

    /// Adds `(rows, seconds)` to the verifier's time for blocks of `rows` (see [`Estimates::verify_time`]).
    fn measure_verify(&mut self, rows: usize, seconds: f64) {
        if rows <= MAX_POSITIONS + 1 {
            self.verify_by_rows.observe(rows, seconds);
        }
    }

    /// Adds `(rows, seconds)` to the decayed least-squares fit of `V` and refits `a, b >= 0`.
    fn fit_verify(&mut self, rows: f64, seconds: f64) {
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
    /// timing (4 rows at 231 ms after 3 at 244), which made a block of 3 drafts look cheaper than it
    /// was against both neighbours (benchmark quick-dec3-turns, 7 of its 12 `auto` gateways' seeds).
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
            run = ((mean * count as f64 + run.0 * run.1 as f64) / (count + run.1) as f64, count + run.1);
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

/// A block length weighed before its tokens are seen (or the rest of a block being drafted).
#[derive(Clone, Copy, Debug)]
struct Candidate {
    drafted: usize,
    /// `E`: expected committed tokens.
    expected_tokens: f64,
    /// P(all `drafted` accepted).
    all_accepted: f64,
}

impl Candidate {
    fn zero() -> Self {
        Self { drafted: 0, expected_tokens: 1.0, all_accepted: 1.0 }
    }
}

/// A block of one kind under a [`Policy`]: what its round expects.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Round {
    drafted: usize,
    expected_tokens: f64,
    round_time_s: f64,
    /// P(all drafts accepted and the guess drafted ahead right): the next block is drafted already.
    p_hit: f64,
}

/// The lengths of a generation's two kinds of block ([`BlockKind`]) and what drafting them is worth.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Policy {
    serial: Round,
    /// `drafted` 0: nothing is drafted ahead.
    ahead: Round,
    /// Long-run committed tokens per second.
    rate: f64,
    /// What a round that starts with a block drafted ahead is worth over one that drafts its block first, in tokens.
    ahead_worth: f64,
    /// Share of rounds whose block is drafted after the call before it.
    serial_share: f64,
    verifier_s_per_token: f64,
}

impl Policy {
    /// How much `block` of `kind` is worth to this policy, in tokens: its expected tokens less the
    /// round's time at the policy's rate, plus the worth of drafting the next block ahead when it is a hit.
    fn value(&self, estimates: &Estimates, kind: BlockKind, block: &Candidate) -> f64 {
        let p_hit = if self.ahead.drafted > 0 { block.all_accepted * estimates.beta.value } else { 0.0 };
        let mut time = estimates.round_time_of(kind, block.drafted, p_hit, estimates.ahead_drafting_s(self.ahead.drafted));
        if kind == BlockKind::Ahead {
            // Drafting past the policy's length may outlast the call it was drafted under.
            time += (estimates.ahead_drafting_s(block.drafted) - estimates.ahead_drafting_s(self.ahead.drafted)).max(0.0);
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
    /// `alpha_i` for `i` in `0..max_draft`, as the length was chosen with (optimistic: see the module docs).
    pub alpha: Vec<f64>,
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

/// Rounds of length 0 per probe (see the module docs): each probe drafts while the verifier computes, which
/// costs nothing on separate machines but slows a verifier sharing the host's memory by a few percent.
const PROBE_EVERY: u32 = 4;
/// Every round of length 0 probes until the first draft position has this many outcomes: a fresh
/// gateway's acceptance is its prior (0.7), which at a low RTT chooses 0, and probing only every
/// [`PROBE_EVERY`]th round kept a text the draft predicts well at 0 for a dozen rounds.
const LEARNING_OUTCOMES: u32 = 4;

/// One generation's draft-length controller: call [`choose`](Self::choose) before each block,
/// [`keep_drafting`](Self::keep_drafting) after each drafted token, [`observe`](Self::observe) after the call.
#[derive(Clone, Debug)]
pub struct DraftController {
    max_draft: usize,
    overlap: bool,
    estimates: Estimates,
    /// The lengths chosen last, on the optimistic view of the estimates.
    policy: Policy,
    /// The kind of block chosen last.
    kind: BlockKind,
    choice: DraftChoice,
    /// Rounds of length 0 since the last probe.
    unprobed: u32,
    block_end: BlockEnd,
}

/// Where `auto` ends a block (see the module docs).
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

impl DraftController {
    /// `max_draft`: the verifier's limit; `overlap`: whether the edge drafts ahead during calls; `seed`: the
    /// gateway-wide estimates (their acceptance rates count as at most [`SEED_OUTCOMES`] outcomes here).
    pub fn new(max_draft: usize, overlap: bool, mut seed: Estimates) -> Self {
        for rate in seed.alpha.iter_mut().chain([&mut seed.pooled, &mut seed.beta, &mut seed.any_confidence]).chain(seed.by_confidence.iter_mut()) {
            *rate = rate.as_seed();
        }
        Self::with_estimates(max_draft, overlap, seed)
    }

    /// A controller that starts from `estimates` as they are, as a generation's own.
    fn with_estimates(max_draft: usize, overlap: bool, estimates: Estimates) -> Self {
        let view = estimates.optimistic();
        let policy = view.best(max_draft, overlap, None);
        let choice = view.choice_of(&policy, BlockKind::Serial, max_draft, estimates.acceptance());
        Self { max_draft, overlap, estimates, policy, kind: BlockKind::Serial, choice, unprobed: 0, block_end: BlockEnd::default() }
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
        self.choice = view.choice_of(&self.policy, kind, self.max_draft, self.estimates.acceptance());
        self.choice.draft
    }

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
    /// ([`Policy::value`]) of it and the longer blocks up to the cap, given the draft's confidence in the
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
        let now = Candidate { drafted: block.drafted, expected_tokens: block.expected_tokens, all_accepted: block.all_accepted };
        let blocks: Vec<(Candidate, f64)> = std::iter::once(now).chain(e.longer_blocks(now, cap)).map(|c| (c, self.policy.value(e, self.kind, &c))).collect();
        let top = blocks.iter().map(|&(_, v)| v).fold(f64::NEG_INFINITY, f64::max);
        let slack = RATE_TOLERANCE * self.policy.rate * self.choice.round_time_s;
        let chosen = blocks.iter().filter(|&&(_, v)| v >= top - slack).min_by_key(|(c, _)| c.drafted.abs_diff(self.choice.draft));
        chosen.is_some_and(|(c, _)| c.drafted > block.drafted)
    }

    /// Whether a round of length 0 drafts a guess as a probe: every [`PROBE_EVERY`]th such round, and
    /// every one while the first position's acceptance has fewer than [`LEARNING_OUTCOMES`] outcomes.
    pub fn probe(&mut self) -> bool {
        self.unprobed += 1;
        let learning = self.estimates.alpha.first().is_none_or(|rate| rate.outcomes < LEARNING_OUTCOMES);
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
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const MS: f64 = 1e-3;

    /// A rate learned from so many outcomes that reading it optimistically changes it by less than 1e-5.
    fn known(value: f64) -> Rate {
        Rate { value, outcomes: u32::MAX }
    }

    /// Estimates with flat acceptance `alpha` (pooled, no position of its own) and the given costs in milliseconds.
    fn est(alpha: f64, t_draft_ms: f64, rtt_ms: f64, a_ms: f64, b_ms: f64) -> Estimates {
        let (t_draft_s, rtt_s, verify_a_s, verify_b_s) = (t_draft_ms * MS, rtt_ms * MS, a_ms * MS, b_ms * MS);
        Estimates { alpha: Vec::new(), pooled: known(alpha), t_draft_s, t_start_s: 0.0, rtt_s, verify_a_s, verify_b_s, ..Estimates::default() }
    }

    fn close(x: f64, want: f64) -> bool {
        (x - want).abs() < 1e-6
    }

    #[test]
    fn expected_tokens_and_round_time_match_hand_computed_values() {
        let e = Estimates { alpha: [0.9, 0.8, 0.5].map(known).to_vec(), beta: Rate::prior(0.6), ..est(0.0, 30.0, 50.0, 80.0, 8.0) };
        let tokens: Vec<f64> = (0..=3).map(|d| e.expected_tokens(d)).collect();
        assert!(tokens.iter().zip([1.0, 1.9, 2.62, 2.98]).all(|(&x, want)| close(x, want)), "{tokens:?}");
        assert!(close(e.round_time(0, true), 0.138) && close(e.round_time(0, false), 0.138));
        assert!(close(e.round_time(2, false), 0.214));
        // P_hit = 0.72 * 0.6; the call (0.154 s) outlasts drafting 3 (0.09 s).
        assert!(close(e.round_time(2, true), 0.432 * 0.154 + 0.568 * 0.214), "{}", e.round_time(2, true));
        // Slow drafting: a hit is bounded by drafting the guess and the next block, 2 * 0.2 s.
        let slow = Estimates { t_draft_s: 0.2, ..e.clone() };
        assert!(close(slow.round_time(1, true), 0.54 * 0.4 + 0.46 * 0.346), "{}", slow.round_time(1, true));
        // Nothing drafted after a miss, 2 drafted ahead: a round of 0 (0.138 s) hits with the guess's 0.6, a
        // block drafted ahead (0.154 s, 2.62 tokens) with 0.72 * 0.6; drafting ahead (0.09 s) outlasts neither call.
        let policy = e.evaluate(&e.lengths(2), 0, 2);
        let (serial_share, ahead_share) = (1.0 - 0.432, 0.6);
        let rate = (serial_share + ahead_share * 2.62) / (serial_share * 0.138 + ahead_share * 0.154);
        assert!(close(policy.rate, rate) && close(policy.serial.p_hit, 0.6) && close(policy.ahead.p_hit, 0.432), "{policy:?}");
        // Worth of starting a round with a block drafted ahead: its tokens less its time at that rate, over its misses.
        assert!(close(policy.ahead_worth, (2.62 - rate * 0.154) / (1.0 - 0.432)), "{policy:?}");
        assert!(close(policy.serial.expected_tokens - rate * policy.serial.round_time_s + 0.6 * policy.ahead_worth, 0.0), "{policy:?}");
    }

    #[test]
    fn hopeless_drafts_choose_zero_and_certain_drafts_on_a_long_link_choose_max() {
        for overlap in [false, true] {
            assert_eq!(DraftController::with_estimates(8, overlap, est(0.01, 30.0, 200.0, 80.0, 8.0)).choose(BlockKind::Serial), 0);
            assert_eq!(DraftController::with_estimates(8, overlap, est(0.999, 30.0, 1000.0, 80.0, 8.0)).choose(BlockKind::Serial), 8);
            assert_eq!(DraftController::with_estimates(0, overlap, est(0.999, 30.0, 1000.0, 80.0, 8.0)).choose(BlockKind::Serial), 0);
        }
    }

    #[test]
    fn chosen_length_grows_with_round_trip_time() {
        for overlap in [false, true] {
            let chosen: Vec<usize> = [0.0, 20.0, 50.0, 100.0, 200.0, 500.0]
                .iter()
                .map(|&rtt| DraftController::with_estimates(32, overlap, est(0.8, 30.0, rtt, 100.0, 10.0)).choose(BlockKind::Serial))
                .collect();
            assert!(chosen.windows(2).all(|w| w[0] <= w[1]), "overlap {overlap}: {chosen:?}");
            assert!(chosen[4] > chosen[0], "overlap {overlap}: {chosen:?}");
        }
        // Hand-computed without overlap. At 0 ms d = 2 is fastest (12.84 tok/s) but d = 3 (12.83) is as
        // fast within the tolerance and costs the verifier 56 ms per token against 61. At 200 ms d = 5 is
        // fastest (7.23), and d = 6 (7.18) is cheaper (43.0 ms per token against 44.6).
        assert_eq!(DraftController::with_estimates(32, false, est(0.8, 30.0, 0.0, 100.0, 10.0)).choose(BlockKind::Serial), 3);
        assert_eq!(DraftController::with_estimates(32, false, est(0.8, 30.0, 200.0, 100.0, 10.0)).choose(BlockKind::Serial), 6);
    }

    #[test]
    fn after_a_miss_a_shorter_block_than_the_one_drafted_ahead_is_faster_than_one_length() {
        // The benchmark's host: the verifier's passes of 1-9 rows (`/v1/info`), 48 ms draft steps, acceptance
        // 0.9. A block drafted in series costs a draft step and a verifier row per token; one drafted ahead
        // only the row, and its hit saves the next round's drafting.
        for rtt in [0.0, 50.0, 150.0] {
            let mut e = Estimates { t_start_s: 0.005, beta: known(0.85), ..est(0.9, 48.0, rtt, 0.0, 0.0) };
            e.seed_verifier_passes(&[0.091, 0.150, 0.214, 0.239, 0.279, 0.354, 0.400, 0.433, 0.509]);
            let mut ctl = DraftController::with_estimates(8, true, e);
            let (serial, ahead) = (ctl.choose(BlockKind::Serial), ctl.choose(BlockKind::Ahead));
            let lengths = e_lengths(&ctl);
            let one_length = (0..=8).map(|d| ctl.estimates.optimistic().evaluate(&lengths, d, d).rate).fold(0.0, f64::max);
            assert!(serial < ahead, "rtt {rtt}: ({serial}, {ahead})");
            assert!(ctl.choice().tokens_per_s > 1.01 * one_length, "rtt {rtt}: {:?} against {one_length}", ctl.choice());
        }
        // Where drafting costs more than verifying (76 ms a token, 105 ms a row with no cost per call), a
        // round of 0 is fastest even with draft-ahead: 1 token in 128 ms (7.8/s) against d = 2's 2.71 in 442 ms (6.1/s).
        let e = Estimates { t_start_s: 0.089, beta: Rate::prior(0.7), ..est(0.9, 76.0, 23.0, 0.0, 105.0) };
        for overlap in [false, true] {
            let mut ctl = DraftController::with_estimates(8, overlap, e.clone());
            assert_eq!((ctl.choose(BlockKind::Serial), ctl.choose(BlockKind::Ahead)), (0, 0), "{:?}", ctl.choice());
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
            assert!(with.choice().tokens_per_s > without.choice().tokens_per_s, "rtt {rtt}: {:?} vs {:?}", with.choice(), without.choice());
        }
    }

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
        let at = |e: &Estimates, rtt_s: f64| DraftController::new(16, true, Estimates { rtt_s, ..e.clone() }).choose(BlockKind::Serial);
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
        let (chosen, rate) = (ctl.choose(BlockKind::Serial), |d: usize| e.expected_tokens(d) / e.round_time(d, true));
        assert!(chosen == want || rate(chosen) >= (1.0 - RATE_TOLERANCE) * rate(want), "{chosen} vs {want}");
        assert!(want >= want_before && want > before, "{chosen}, {want} vs {want_before} / {before}");
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
            .filter(|&(s, a)| e.optimistic().evaluate(&lengths, s, a).rate >= (1.0 - RATE_TOLERANCE) * fresh.rate)
            .collect();
        assert!(!near.is_empty(), "no pair is as fast as {fresh:?}: the test needs a flat optimum");
        for &(s, a) in &near {
            let kept = e.optimistic().best(8, true, Some((s, a)));
            assert_eq!((kept.serial.drafted, kept.ahead.drafted), (s, a), "({s}, {a}) is within the tolerance of {fresh:?}");
        }
        // A long link makes the kept lengths slow: they are left.
        let slow = Estimates { rtt_s: 0.300, ..e.clone() };
        let long = slow.optimistic().best(8, true, None);
        let left = slow.optimistic().best(8, true, Some((0, 1)));
        assert!(long.ahead.drafted > fresh.ahead.drafted && left == long, "{long:?}");
    }

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
        assert!(ctl.estimates().alpha.len() == 1 && ctl.estimates().alpha(0) < 0.1, "{:?}", ctl.estimates());
        assert_eq!((0..4 * PROBE_EVERY).filter(|_| ctl.probe()).count(), 4);
        // After a fully accepted block, the guess is an outcome of the next position.
        let mut e = est(0.5, 15.0, 100.0, 20.0, 45.0);
        e.observe(&RoundObservation { drafted: 2, accepted: 2, ahead_guess: Some(true), ..Default::default() });
        assert!(e.alpha.len() == 3 && e.alpha(2) > e.alpha(1) && e.alpha(1) > e.alpha(0) && e.alpha(0) > 0.5, "{e:?}");
    }

    #[test]
    fn a_fresh_gateway_learns_a_texts_acceptance_within_a_few_rounds() {
        let mut e = Estimates::default();
        let accepted = RoundObservation { drafted: 2, accepted: 2, ahead_guess: Some(true), ..Default::default() };
        for _ in 0..4 {
            e.observe(&accepted);
        }
        // The prior counts as four outcomes: position 0 from 0.7 to 0.7 + 0.3 * 4/8 = 0.85 in four (a constant
        // gain of 0.15: 0.88); the pooled rate saw three a round, to 0.7 + 0.3 * 12/16 = 0.925; beta to 0.8.
        assert!(close(e.alpha[0].value, 0.85) && close(e.acceptance(), 0.925) && close(e.beta.value, 0.8), "{e:?}");
        // A position's alpha leans on the pooled rate, counted as POOLED_OUTCOMES against its own four.
        assert!(close(e.alpha(0), (4.0 * 0.85 + POOLED_OUTCOMES * 0.925) / (4.0 + POOLED_OUTCOMES)), "{}", e.alpha(0));
        // The length is chosen on the pooled rate read OPTIMISM standard errors high: sqrt(0.925 * 0.075 / 16).
        assert!(close(e.optimistic().acceptance(), 0.925 + OPTIMISM * (0.925f64 * 0.075 / 16.0).sqrt()), "{e:?}");
        // Past the first outcomes a rate moves at its constant gain, so a late miss is one outcome among many.
        for _ in 0..20 {
            e.observe(&accepted);
        }
        let before = (e.alpha[0].value, e.alpha[1].value, e.acceptance());
        e.observe(&RoundObservation { drafted: 2, accepted: 0, ..Default::default() });
        assert!(close(e.alpha[0].value, before.0 * (1.0 - ACCEPT_GAIN)) && e.alpha[1].value == before.1, "{e:?}");
        assert!(close(e.acceptance(), before.2 * (1.0 - POOLED_GAIN)), "{e:?}");
        // The optimism fades as outcomes accumulate.
        assert!(e.optimistic().acceptance() - e.acceptance() < 0.015, "{e:?}");
        // A position first reached starts from the pooled rate (as it is when reached), as a prior.
        e.observe(&RoundObservation { drafted: 4, accepted: 3, ..Default::default() });
        assert!(e.alpha.len() == 4 && e.alpha[3].outcomes == 1 && close(e.alpha[3].value, 0.8 * e.acceptance() / (1.0 - POOLED_GAIN)), "{e:?}");
    }

    #[test]
    fn a_rejection_at_a_position_rarely_reached_moves_its_alpha_little() {
        let mut e = Estimates::default();
        for _ in 0..10 {
            e.observe(&RoundObservation { drafted: 2, accepted: 2, ahead_guess: Some(true), ..Default::default() });
        }
        let before = e.alpha(4);
        // Position 4's first outcome, a rejection: alone it reads 0.8 times its prior, but the pooled rate
        // (30 outcomes, nearly all accepted) counts as POOLED_OUTCOMES against it.
        e.observe(&RoundObservation { drafted: 5, accepted: 4, ..Default::default() });
        assert!(e.alpha[4].value < 0.81 * before && e.alpha(4) > before - 0.05, "{before} -> {}: {e:?}", e.alpha(4));
    }

    #[test]
    fn one_slow_block_moves_the_drafting_times_a_bounded_step() {
        let mut e = Estimates::default();
        let slow = RoundObservation { drafted: 2, draft_step: Duration::from_secs(2), draft_start: Duration::from_secs(3), ..Default::default() };
        e.observe(&slow);
        // At most 4x the estimate is believed: 30 ms + 0.3 * (120 ms - 30 ms).
        assert!(close(e.t_draft_s, 0.057) && close(e.t_start_s, 0.057), "{e:?}");
        let usual = RoundObservation { draft_step: Duration::from_millis(40), draft_start: Duration::from_millis(60), ..slow };
        for _ in 0..15 {
            e.observe(&usual);
        }
        assert!((e.t_draft_s - 0.040).abs() < 1e-3 && (e.t_start_s - 0.060).abs() < 1e-3, "{e:?}");
    }

    #[test]
    fn low_confidence_stops_the_block_and_high_confidence_runs_to_the_choice() {
        let mut e = Estimates::default();
        for _ in 0..30 {
            e.observe(&RoundObservation { drafted: 3, accepted: 2, confidences: vec![0.95, 0.95, 0.05], ..Default::default() });
        }
        assert!(e.acceptance_at(0, 0.05) < 0.05 && e.acceptance_at(0, 0.95) > 0.95, "{e:?}");
        let (by_confidence, any_confidence) = (e.by_confidence, e.any_confidence);
        let estimates = Estimates { by_confidence, any_confidence, ..est(0.8, 30.0, 200.0, 100.0, 10.0) };
        let mut ctl = DraftController::with_estimates(16, false, estimates.clone()).with_block_end(BlockEnd::Early);
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
        let mut ctl = DraftController::with_estimates(16, false, estimates).with_block_end(BlockEnd::Confidence);
        assert_eq!((ctl.choose(BlockKind::Serial), ctl.block_cap()), (6, 16));
        let mut block = BlockOdds::default();
        let kept = (1..=16).take_while(|_| ctl.keep_drafting(&mut block, 0.97)).count();
        assert_eq!(kept, 15, "drafted 16 tokens");
        let mut block = BlockOdds::default();
        assert!((0..8).all(|_| ctl.keep_drafting(&mut block, 0.97)) && !ctl.keep_drafting(&mut block, 0.02));
    }

    #[test]
    fn equal_confidences_defer_to_acceptance_by_position() {
        let mut e = Estimates::default();
        for _ in 0..80 {
            // Every confidence the same (as under greedy decoding without a softmax). Position 0 always accepted, position 1 never.
            e.observe(&RoundObservation { drafted: 2, accepted: 1, confidences: vec![1.0, 1.0], ..Default::default() });
        }
        // Each position's own rate outweighs the pooled one (0.5) five to one after 80 outcomes.
        assert!(e.acceptance_at(0, 1.0) > 0.9 && e.acceptance_at(1, 1.0) < 0.1, "{e:?}");
    }

    #[test]
    fn tokens_as_confident_as_the_average_run_to_the_chosen_length() {
        for rtt in [0.0, 20.0, 50.0, 100.0, 200.0] {
            for overlap in [false, true] {
                let mut e = est(0.8, 30.0, rtt, 60.0, 35.0);
                (e.by_confidence, e.any_confidence) = ([Rate::prior(1.0); BUCKETS], Rate::prior(1.0));
                let mut ctl = DraftController::with_estimates(8, overlap, e).with_block_end(BlockEnd::Early);
                for kind in [BlockKind::Serial, BlockKind::Ahead] {
                    let d = ctl.choose(kind);
                    let mut block = BlockOdds::default();
                    let kept = (1..=d).take_while(|_| ctl.keep_drafting(&mut block, 0.85)).count();
                    assert_eq!(kept, d.saturating_sub(1), "rtt {rtt} overlap {overlap} {kind:?}: d = {d}");
                }
            }
        }
    }

    #[test]
    fn verifier_time_fit_recovers_a_and_b_and_keeps_b_when_rows_never_vary() {
        let mut e = Estimates::default();
        for drafted in [0, 3, 7, 1, 5, 2, 6, 4, 0, 8].into_iter().cycle().take(40) {
            let v = 0.05 + 0.012 * (drafted + 1) as f64;
            e.observe(&RoundObservation { drafted, accepted: drafted, verifier_time: Some(Duration::from_secs_f64(v)), ..Default::default() });
        }
        assert!((e.verify_a_s - 0.05).abs() < 1e-6 && (e.verify_b_s - 0.012).abs() < 1e-7, "{e:?}");
        let mut same = Estimates::default();
        for _ in 0..20 {
            same.observe(&RoundObservation { drafted: 4, verifier_time: Some(Duration::from_millis(200)), ..Default::default() });
        }
        assert!(close(same.verify_b_s, 0.008) && close(same.verify_a_s, 0.2 - 5.0 * 0.008), "{same:?}");
    }

    #[test]
    fn the_verifiers_pass_times_seed_what_the_gateway_has_not_measured() {
        // A CPU verifier: 10 ms + 40 ms a row, as /v1/info reports it for 1-9 rows.
        let cpu: Vec<f64> = (1..=9).map(|rows| 0.010 + 0.040 * rows as f64).collect();
        let mut e = Estimates { alpha: vec![Rate::prior(0.8)], rtt_s: 0.0, ..Estimates::default() };
        let prior_choice = DraftController::new(8, true, e.clone()).choice().draft_ahead;
        assert_eq!(e.seed_verifier_passes(&cpu), 9);
        // The fit is pulled a little towards the prior slope (FIT_RIDGE).
        assert!((e.verify_a_s - 0.010).abs() < 2e-4 && (e.verify_b_s - 0.040).abs() < 1e-4, "{e:?}");
        assert!(close(e.verify_time(5), 0.210) && (e.verify_time(12) - 0.490).abs() < 1e-3);
        // The prior (8 ms a row) sends long blocks at RTT 0; the verifier's own times do not.
        let seeded_choice = DraftController::new(8, true, e.clone()).choice().draft_ahead;
        assert!(seeded_choice < prior_choice, "prior {prior_choice}, seeded {seeded_choice}");
        // What the gateway measured stays; a later seed fills only sizes it has not timed.
        e.observe(&RoundObservation { drafted: 1, accepted: 1, verifier_time: Some(Duration::from_millis(150)), ..Default::default() });
        let (measured, a, b) = (e.verify_time(2), e.verify_a_s, e.verify_b_s);
        assert_eq!(e.seed_verifier_passes(&[0.5; 9]), 0);
        assert!(close(e.verify_time(2), measured) && close(e.verify_time(3), 0.130 * e.verify_by_rows.pace()), "{e:?}");
        assert!(close(e.verify_a_s, a) && close(e.verify_b_s, b));
        // Nonsense entries are skipped, not learned.
        let mut odd = Estimates::default();
        assert_eq!(odd.seed_verifier_passes(&[f64::NAN, -1.0, 0.0, f64::INFINITY, 1e9]), 0);
        assert!(odd.verify_by_rows.is_empty() && odd.fit.w == 0.0 && close(odd.verify_b_s, 0.008), "{odd:?}");
    }

    #[test]
    fn the_verifiers_pass_times_are_seeded_as_never_falling_with_rows() {
        let fit = |values: &[f64]| never_falling(values.iter().enumerate().map(|(i, &v)| (i + 1, v)).collect()).into_iter().map(|(_, v)| v).collect::<Vec<_>>();
        assert_eq!(fit(&[1.0, 2.0, 2.0, 3.0]), vec![1.0, 2.0, 2.0, 3.0]);
        assert_eq!(fit(&[1.0, 4.0, 2.0, 3.0, 5.0]), vec![1.0, 3.0, 3.0, 3.0, 5.0]);
        assert_eq!(fit(&[3.0, 2.0, 1.0]), vec![2.0, 2.0, 2.0]);
        assert!(fit(&[]).is_empty());
        // A verifier's pass times as one benchmark gateway was seeded with them (milliseconds).
        let mut e = Estimates::default();
        let seeded: Vec<f64> = [95.0, 161.0, 244.0, 231.0, 322.0, 399.0, 479.0, 457.0, 493.0].map(|ms| ms / 1e3).to_vec();
        assert_eq!(e.seed_verifier_passes(&seeded), 9);
        let v: Vec<f64> = (1..=9).map(|rows| e.verify_time(rows)).collect();
        assert!(close(v[2], 0.2375) && close(v[3], 0.2375) && close(v[6], 0.468) && close(v[7], 0.468), "{v:?}");
        assert!(close(v[0], 0.095) && close(v[4], 0.322) && close(v[8], 0.493), "{v:?}");
        // Skipped entries leave the sizes around them in order of rows.
        let mut gaps = Estimates::default();
        assert_eq!(gaps.seed_verifier_passes(&[0.1, f64::NAN, 0.3, 0.2]), 3);
        assert!(close(gaps.verify_time(3), 0.25) && close(gaps.verify_time(4), 0.25) && close(gaps.verify_time(2), 0.175), "{gaps:?}");
    }

    #[test]
    fn one_slow_call_does_not_make_its_block_size_costly_for_good() {
        let mut e = Estimates::default();
        e.seed_verifier_passes(&[0.05, 0.10, 0.15, 0.16, 0.17]);
        let slow = RoundObservation { drafted: 4, accepted: 4, verifier_time: Some(Duration::from_millis(250)), ..Default::default() };
        e.observe(&slow);
        // Read as 15% over the size's time, not 47%, and mostly as the verifier's pace: every size
        // moves about as much, so the slow size does not look costlier than its neighbours.
        let pace = 1.0 + TIME_GAIN * 0.15;
        assert!(close(e.verify_by_rows.pace(), pace) && close(e.verify_time(4), 0.16 * pace), "{e:?}");
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
            e.observe(&RoundObservation { drafted, accepted: drafted, verifier_time: Some(Duration::from_secs_f64(seconds)), ..Default::default() })
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
            e.observe(&RoundObservation { drafted, accepted: drafted, verifier_time: Some(Duration::from_secs_f64(v(drafted + 1))), ..Default::default() })
        };
        let mut e = est(0.95, 30.0, 0.0, 80.0, 8.0);
        for drafted in [2, 6, 2, 2, 3] {
            observe(&mut e, drafted);
        }
        // Sizes seen are their own measurements; between them, interpolated; beyond, the fit's slope.
        assert!(close(e.verify_time(3), v(3)) && close(e.verify_time(7), v(7)), "{e:?}");
        assert!(close(e.verify_time(5), v(4) + (v(7) - v(4)) / 3.0), "{}", e.verify_time(5));
        assert!(close(e.verify_time(9), v(7) + 2.0 * e.verify_b_s) && close(e.verify_time(1), v(3) - 2.0 * e.verify_b_s));
        // Once every size is seen, the choice is the longest block of one pass (hand-computed with
        // alpha 0.95: 10.18 tokens/s at d = 5, 7.26 at d = 6).
        for drafted in (1..=6).cycle().take(30) {
            observe(&mut e, drafted);
        }
        let e = Estimates { alpha: vec![Rate::prior(0.95)], ..e };
        assert_eq!(DraftController::with_estimates(8, true, e.clone()).choose(BlockKind::Serial), 5, "{e:?}");
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
            let tokens = |d: usize| (0..=d).map(|j| alpha[..j].iter().product::<f64>()).sum::<f64>();
            let v = |d: usize| a + b * (d + 1) as f64;
            // Drafting `serial` after a miss and `ahead` during each call: rounds of each kind with their
            // P(hit), time and tokens; a hit waits for whatever of the drafting ahead outlasts its call.
            let pair = |serial: usize, ahead: usize| {
                let p = |d: usize| if ahead > 0 { alpha[..d].iter().product::<f64>() * beta } else { 0.0 };
                let wait = |d: usize| p(d) * (start + (ahead + 1) as f64 * t - (rtt + v(d))).max(0.0);
                let serial_time = if serial > 0 { start + serial as f64 * t } else { 0.0 } + rtt + v(serial) + wait(serial);
                let ahead_time = rtt + v(ahead) + wait(ahead);
                // Shares of rounds: serial ones end in a hit with p(serial), ahead ones in a miss with 1 - p(ahead).
                let (ws, wa) = if p(serial) > 0.0 { (1.0 - p(ahead), p(serial)) } else { (1.0, 0.0) };
                let tokens_per_round = ws * tokens(serial) + wa * tokens(ahead);
                (tokens_per_round / (ws * serial_time + wa * ahead_time), (ws * v(serial) + wa * v(ahead)) / tokens_per_round)
            };
            let aheads = if overlap { 0..=max } else { 0..=0 };
            let pairs: Vec<(usize, usize)> = aheads.flat_map(|ahead| (0..=max).map(move |serial| (serial, ahead))).collect();
            let top = pairs.iter().map(|&(s, a)| pair(s, a).0).fold(f64::NEG_INFINITY, f64::max);
            // Within 3% of the fastest, the least verifier time per committed token; the first on ties.
            let want = pairs.iter().filter(|&&(s, a)| pair(s, a).0 >= 0.97 * top).fold(None, |best: Option<(usize, usize)>, &(s, a)| match best {
                Some((bs, ba)) if pair(bs, ba).1 <= pair(s, a).1 => Some((bs, ba)),
                _ => Some((s, a)),
            });
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
            assert!(chosen == want || (rate >= 0.97 * top && (cost - pair(want.0, want.1).1).abs() < 1e-9), "case {case}: {chosen:?} vs {want:?}");
            assert!((ctl.choice().tokens_per_s - rate).abs() < 1e-6 * rate, "case {case}");
        }
    }

    #[test]
    fn degenerate_observations_neither_panic_nor_poison_the_estimates() {
        let mut ctl = DraftController::new(usize::MAX, true, Estimates::default());
        let rounds = [
            RoundObservation::default(),
            RoundObservation { drafted: 2, accepted: 9, confidences: vec![f32::NAN, f32::INFINITY, -1.0], ahead_guess: Some(true), ..Default::default() },
            RoundObservation {
                drafted: usize::MAX,
                accepted: usize::MAX,
                call_latency: Duration::MAX,
                verifier_time: Some(Duration::ZERO),
                ..Default::default()
            },
            RoundObservation { drafted: 1, call_latency: Duration::from_millis(5), verifier_time: Some(Duration::from_secs(1)), ..Default::default() },
        ];
        for round in &rounds {
            ctl.observe(round);
            let d = ctl.choose(BlockKind::Serial);
            assert!(d <= MAX_POSITIONS);
            let mut block = BlockOdds::default();
            let _ = (ctl.keep_drafting(&mut block, f32::NAN), ctl.keep_drafting(&mut block, 2.0), ctl.keep_drafting(&mut block, -3.0));
            let c = ctl.choice();
            assert!(c.tokens_per_s.is_finite() && c.round_time_s > 0.0 && c.alpha.iter().all(|a| (0.0..=1.0).contains(a)), "{c:?}");
        }
        let e = ctl.estimates();
        // The absurd latency was ignored and the last sample (latency < verifier time) clamped at 0; the first
        // sample replaces the 10 ms prior.
        assert!(close(e.rtt_s, 0.0) && close(e.t_draft_s, 0.030), "{:?}", (e.rtt_s, e.t_draft_s));
    }
}
