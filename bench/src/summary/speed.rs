//! Speed figures on the long prompts: tokens per second per repetition ([`Timing`]), one mode's row at
//! one link ([`SpeedRow`]), and the round's breakdown into drafting, link and verifier ([`PerRound`]).

use std::collections::BTreeMap;

use serde::Serialize;

use super::Record;
use crate::client::Outcome;
use crate::plan::Mode;
use crate::stats::{ratio, Spread};

/// Timing figures of one mode: each is computed per repetition, then spread over repetitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Completion tokens / request seconds, end to end.
    pub tokens_per_s: Option<Spread>,
    /// Tokens after the first / seconds after the first: the steady pace once prompts are processed.
    /// None for draft-only, whose text arrives in large pieces (it drafts 32 tokens at once).
    pub decode_tokens_per_s: Option<Spread>,
    /// Mean seconds to the first text.
    pub ttft_s: Option<Spread>,
}

/// Some requests' sums within one repetition.
#[derive(Default)]
pub(super) struct Rep {
    tokens: f64,
    secs: f64,
    ttft: f64,
    n: f64,
    after_tokens: f64,
    after_secs: f64,
    burst: bool,
}

impl Rep {
    pub(super) fn tokens_per_s(&self) -> Option<f64> {
        ratio(self.tokens, self.secs)
    }
}

/// Requests summed by repetition.
pub(super) fn by_rep<'a>(records: impl IntoIterator<Item = &'a Record>) -> BTreeMap<u32, Rep> {
    let mut by_rep: BTreeMap<u32, Rep> = BTreeMap::new();
    for r in records {
        let (o, e) = (&r.outcome, by_rep.entry(r.rep).or_default());
        e.tokens += o.completion_tokens as f64;
        e.secs += o.total_s;
        e.ttft += o.ttft_s;
        e.n += 1.0;
        e.after_tokens += o.completion_tokens.saturating_sub(1) as f64;
        e.after_secs += o.total_s - o.ttft_s;
        e.burst |= r.mode == Mode::DraftOnly;
    }
    by_rep
}

/// The [`Timing`] of some requests.
pub fn timing<'a>(records: impl IntoIterator<Item = &'a Record>) -> Timing {
    let by_rep = by_rep(records);
    let spread = |f: &dyn Fn(&Rep) -> Option<f64>| {
        Spread::of(&by_rep.values().filter_map(f).collect::<Vec<_>>())
    };
    Timing {
        tokens_per_s: spread(&Rep::tokens_per_s),
        decode_tokens_per_s: spread(&|r| {
            if r.burst {
                None
            } else {
                ratio(r.after_tokens, r.after_secs)
            }
        }),
        ttft_s: spread(&|r| ratio(r.ttft, r.n)),
    }
}

/// Seconds of one verify round, on average: the gateway's `usage.spade.timing` over its verify calls.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PerRound {
    /// Verify rounds per request.
    pub rounds: f64,
    /// Request time (client-side, first token included) per round.
    pub wall_s: f64,
    /// Drafting the gateway waited for.
    pub draft_s: f64,
    /// Verify calls minus the verifier's own time: the link both ways (and HTTP).
    pub link_s: f64,
    /// The verifier's queue and forward passes (the first call's include processing the prompt).
    pub verifier_s: f64,
    /// The rest of the wall time: the gateway's own work, the client (prompt processing is in the
    /// first call's verifier time and in the drafting waited for).
    pub other_s: f64,
    /// Drafting hidden under verify calls (draft-ahead): not part of the wall time.
    pub overlap_s: f64,
}

impl PerRound {
    /// The largest term of the round time.
    pub fn dominant(&self) -> &'static str {
        let terms = [
            ("draft", self.draft_s),
            ("link", self.link_s),
            ("verifier", self.verifier_s),
            ("other", self.other_s),
        ];
        terms.iter().max_by(|a, b| a.1.total_cmp(&b.1)).map_or("—", |t| t.0)
    }
}

/// The per-round breakdown of some requests (None without verify calls).
pub fn per_round(records: &[&Record]) -> Option<PerRound> {
    let calls: f64 = records.iter().map(|r| r.outcome.verify_calls as f64).sum();
    if calls == 0.0 {
        return None;
    }
    let sum = |f: fn(&Outcome) -> f64| records.iter().map(|r| f(&r.outcome)).sum::<f64>() / calls;
    let (wall_s, draft_s, link_s, verifier_s) = (
        sum(|o| o.total_s),
        sum(|o| o.timing.draft_s),
        sum(|o| o.timing.link_s),
        sum(|o| o.timing.verifier_s),
    );
    Some(PerRound {
        rounds: calls / records.len() as f64,
        wall_s,
        draft_s,
        link_s,
        verifier_s,
        other_s: wall_s - draft_s - link_s - verifier_s,
        overlap_s: sum(|o| o.timing.overlap_s),
    })
}

/// Speed on the long prompts: one mode through one link (a fixed RTT, or the drift case).
#[derive(Debug, Clone, Serialize)]
pub struct SpeedRow {
    pub mode: Mode,
    pub label: String,
    pub rtt_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift_to_ms: Option<u64>,
    pub requests: usize,
    /// Fewest and mean completion tokens of a request.
    pub min_tokens: u64,
    pub mean_tokens: f64,
    #[serde(flatten)]
    pub timing: Timing,
    pub tokens_per_call: Option<f64>,
    /// Pre-drafted blocks sent, per verify round and per round that drafted ahead.
    pub ahead_used_per_round: Option<f64>,
    pub ahead_used_per_drafted: Option<f64>,
    pub per_round: Option<PerRound>,
    /// Median tokens/s over target-only's at the same link.
    pub vs_target_only: Option<f64>,
    /// `auto` only: the draft length of its last choice, mean over requests.
    pub auto_last_draft: Option<f64>,
    /// Drift only: where the link changed, median over repetitions: seconds into the request it
    /// changed in, and that share of the request's time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switch_at_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switch_share: Option<f64>,
}

impl SpeedRow {
    pub fn tokens_per_s(&self) -> Option<f64> {
        self.timing.tokens_per_s.map(|s| s.median)
    }
}

pub(super) fn speed_row(
    mode: Mode,
    rtt_ms: u64,
    drift_to_ms: Option<u64>,
    records: &[&Record],
) -> SpeedRow {
    let sum = |f: fn(&Outcome) -> u64| records.iter().map(|r| f(&r.outcome)).sum::<u64>() as f64;
    let (tokens, calls, drafted_ahead, used) = (
        sum(|o| o.completion_tokens),
        sum(|o| o.verify_calls),
        sum(|o| o.ahead_drafted),
        sum(|o| o.ahead_used),
    );
    let auto: Vec<f64> =
        records.iter().filter_map(|r| r.outcome.auto.as_ref()?.get("draft")?.as_f64()).collect();
    SpeedRow {
        mode,
        label: mode.to_string(),
        rtt_ms,
        drift_to_ms,
        requests: records.len(),
        min_tokens: records.iter().map(|r| r.outcome.completion_tokens).min().unwrap_or(0),
        mean_tokens: ratio(tokens, records.len() as f64).unwrap_or(0.0),
        timing: timing(records.iter().copied()),
        tokens_per_call: ratio(tokens, calls),
        ahead_used_per_round: ratio(used, calls).filter(|_| mode.speculates()),
        ahead_used_per_drafted: ratio(used, drafted_ahead).filter(|_| mode.speculates()),
        per_round: per_round(records),
        vs_target_only: None,
        auto_last_draft: ratio(auto.iter().sum(), auto.len() as f64),
        switch_at_s: None,
        switch_share: None,
    }
}

/// Fills `vs_target_only` of rows at one link.
pub(super) fn against_target_only(rows: &mut [SpeedRow]) {
    let base = rows.iter().find(|r| r.mode == Mode::TargetOnly).and_then(SpeedRow::tokens_per_s);
    for r in rows.iter_mut() {
        r.vs_target_only = base.and_then(|b| ratio(r.tokens_per_s()?, b));
    }
}
