//! From raw measurements to the figures the report shows.
//!
//! Accounting figures (calls, acceptance, cost per token, bytes) come from the accounting batches
//! (greedy, every short accounting prompt once) and the sampled batches. Speed figures come from the
//! long prompts through the link (timing and drift batches): each is computed per repetition (tokens
//! over seconds of that repetition's requests) and then the median over repetitions; the per-round
//! breakdown (drafting, link, verifier) pools the repetitions: the gateway's `usage.spade.timing` summed
//! over the requests, divided by their verify calls. Losslessness compares every greedy output of every
//! speculative mode, accounting, timing and drift alike, with target-only's for the same prompt and
//! length.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::client::Outcome;
use crate::plan::{Batch, Drift, Kind, Mode, LONG_MIN_TOKENS};
use crate::prom::VerifierCounters;
use crate::prompts::Category;
use crate::stats::{median, ratio, Spread};

/// One request's result.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub rep: u32,
    pub mode: Mode,
    pub kind: Kind,
    pub rtt_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift_to_ms: Option<u64>,
    pub temperature: f64,
    pub max_tokens: u32,
    pub prompt_id: String,
    pub category: Category,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// Where the link changed in a drift batch: in request `request` (its index in the batch), `at_s`
/// seconds after it was sent, that share of the request's time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DriftSwitch {
    pub request: usize,
    pub at_s: f64,
    pub share_of_request: Option<f64>,
}

/// One batch: its requests and what the servers spent on them.
#[derive(Debug, Clone, Serialize)]
pub struct BatchResult {
    pub batch: Batch,
    pub records: Vec<Record>,
    /// Verifier counters over the batch (difference of two `/metrics` scrapes).
    pub verifier: VerifierCounters,
    pub verifier_cpu_s: f64,
    pub gateway_cpu_s: f64,
    pub wall_s: f64,
    /// Drift only: where the link changed (None: it never did).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift_switch: Option<DriftSwitch>,
}

/// Greedy outputs of a mode compared with target-only's, prompt by prompt.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Identity {
    pub identical: usize,
    pub compared: usize,
    /// Requests whose output differs (`prompt id` or `prompt id @ RTT`).
    pub differing: Vec<String>,
}

impl Identity {
    pub fn share(&self) -> f64 {
        ratio(self.identical as f64, self.compared as f64).unwrap_or(0.0)
    }

    fn add(&mut self, other: &Identity) {
        self.identical += other.identical;
        self.compared += other.compared;
        self.differing.extend(other.differing.iter().cloned());
    }
}

/// A mode's greedy outputs against target-only's, by kind of batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModeIdentity {
    pub mode: Mode,
    pub label: String,
    pub accounting: Identity,
    /// Timing batches: the long prompts at every RTT and repetition.
    pub timing: Identity,
    pub drift: Identity,
}

impl ModeIdentity {
    pub fn total(&self) -> Identity {
        let mut t = self.accounting.clone();
        t.add(&self.timing);
        t.add(&self.drift);
        t
    }

    /// Every greedy output compared and identical.
    pub fn lossless(&self) -> bool {
        let t = self.total();
        t.compared > 0 && t.identical == t.compared
    }
}

/// One row of the accounting tables: a mode at one temperature, no link delay, short prompts.
#[derive(Debug, Clone, Serialize)]
pub struct ModeSummary {
    pub mode: Mode,
    pub label: String,
    pub temperature: f64,
    pub requests: usize,
    pub tokens: u64,
    pub calls_per_request: f64,
    /// 1 − (this mode's calls per token) / (target-only's), at the same temperature.
    pub calls_saved: Option<f64>,
    /// Accepted drafts / drafts (the gateway's usage counts).
    pub acceptance: Option<f64>,
    pub tokens_per_call: Option<f64>,
    /// Share of verify blocks whose first i+1 drafts were all accepted (verifier /metrics).
    pub acceptance_by_position: Vec<f64>,
    pub acceptance_by_category: BTreeMap<String, f64>,
    pub verifier_cpu_s_per_token: Option<f64>,
    pub gateway_cpu_s_per_token: Option<f64>,
    pub verifier_forward_s_per_token: Option<f64>,
    pub bytes_per_token: Option<f64>,
    /// Of these short requests themselves.
    #[serde(flatten)]
    pub timing: Timing,
    /// Greedy only: outputs identical to target-only.
    pub identical: Option<Identity>,
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
        let terms = [("draft", self.draft_s), ("link", self.link_s), ("verifier", self.verifier_s), ("other", self.other_s)];
        terms.iter().max_by(|a, b| a.1.total_cmp(&b.1)).map_or("—", |t| t.0)
    }
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

/// `auto` against the fixed draft lengths (draft-ahead on, as `auto`) at one link.
#[derive(Debug, Clone, Serialize)]
pub struct AutoVsFixed {
    pub rtt_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift_to_ms: Option<u64>,
    pub auto_tokens_per_s: f64,
    /// Every fixed draft length's median tokens/s.
    pub fixed: Vec<(u32, f64)>,
    pub best_fixed: u32,
    pub best_fixed_tokens_per_s: f64,
    /// auto / best fixed − 1.
    pub auto_vs_best: f64,
    /// auto / best fixed − 1 within each repetition, spread over repetitions ([`paired_by_rep`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paired_vs_best: Option<Spread>,
    /// At a fixed RTT: within [`AUTO_TOLERANCE`] of the best fixed length; drift: faster than every one.
    pub met: bool,
}

/// How far below the best fixed draft length `auto` may be at a fixed RTT.
pub const AUTO_TOLERANCE: f64 = 0.05;

/// Speedup goals of speculative decoding (with draft-ahead) over target-only, by RTT.
pub const SPEEDUP_GOALS: [(u64, f64); 3] = [(0, 1.0), (50, 1.5), (100, 2.0)];

/// Speculative decoding (draft-ahead on) against target-only at one RTT.
#[derive(Debug, Clone, Serialize)]
pub struct VsTargetOnly {
    pub rtt_ms: u64,
    pub target_only_tokens_per_s: f64,
    pub auto_ratio: Option<f64>,
    /// The fastest draft-ahead mode (auto or a fixed length) and its ratio.
    pub best: Mode,
    pub best_ratio: f64,
    pub goal: Option<f64>,
    pub met: Option<bool>,
    /// The largest term of the fastest mode's round time.
    pub dominant: Option<String>,
    /// The fastest mode's decode tokens/s (after the first token) over target-only's.
    pub decode_ratio: Option<f64>,
    /// Where the goal is missed, what it would take ([`GoalGap`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap: Option<GoalGap>,
}

/// What a missed speed-up goal would take, at the fastest mode's round breakdown: its round time must
/// shrink by the ratio it reached over the goal, with the same tokens per round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GoalGap {
    /// The round time (s) at which the goal would be met.
    pub round_needed_s: f64,
    /// The verifier's time per round (s), as measured and as the goal needs with every other term as
    /// measured; `needed <= 0` means the other terms alone exceed the round the goal allows.
    pub verifier_s: f64,
    pub verifier_needed_s: f64,
}

impl GoalGap {
    fn of(p: &PerRound, ratio: f64, goal: f64) -> Option<GoalGap> {
        (ratio < goal).then(|| {
            let round_needed_s = p.wall_s * ratio / goal;
            GoalGap { round_needed_s, verifier_s: p.verifier_s, verifier_needed_s: p.verifier_s - (p.wall_s - round_needed_s) }
        })
    }

    /// Whether a cheaper verifier alone could meet the goal (the other terms fit in the round).
    pub fn verifier_can_close_it(&self) -> bool {
        self.verifier_needed_s > 0.0
    }
}

/// The completion tokens of a long prompt (target-only's greedy output, else the fewest any mode got).
#[derive(Debug, Clone, Serialize)]
pub struct LongOutput {
    pub prompt_id: String,
    pub max_tokens: u32,
    pub tokens: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub greedy: Vec<ModeSummary>,
    pub sampled: Vec<ModeSummary>,
    /// Long prompts at every fixed RTT, by RTT then mode.
    pub speed: Vec<SpeedRow>,
    /// Long prompts through the drifting link, by mode.
    pub drift: Vec<SpeedRow>,
    pub auto_vs_fixed: Vec<AutoVsFixed>,
    pub vs_target_only: Vec<VsTargetOnly>,
    pub identity: Vec<ModeIdentity>,
    pub long_outputs: Vec<LongOutput>,
    /// True when every speculative mode's greedy output matched target-only on every request.
    pub lossless: bool,
    /// Things a reader should know (counter mismatches, degraded answers, missing baselines, short outputs).
    pub warnings: Vec<String>,
}

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
struct Rep {
    tokens: f64,
    secs: f64,
    ttft: f64,
    n: f64,
    after_tokens: f64,
    after_secs: f64,
    burst: bool,
}

impl Rep {
    fn tokens_per_s(&self) -> Option<f64> {
        ratio(self.tokens, self.secs)
    }
}

/// Requests summed by repetition.
fn by_rep<'a>(records: impl IntoIterator<Item = &'a Record>) -> BTreeMap<u32, Rep> {
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
    let spread = |f: &dyn Fn(&Rep) -> Option<f64>| Spread::of(&by_rep.values().filter_map(f).collect::<Vec<_>>());
    Timing {
        tokens_per_s: spread(&Rep::tokens_per_s),
        decode_tokens_per_s: spread(&|r| if r.burst { None } else { ratio(r.after_tokens, r.after_secs) }),
        ttft_s: spread(&|r| ratio(r.ttft, r.n)),
    }
}

/// Target-only's greedy outputs by (prompt id, max tokens).
type Outputs<'a> = HashMap<(&'a str, u32), &'a str>;

/// Greedy outputs of some records vs target-only's for the same prompt and length.
pub fn identity<'a>(candidate: impl IntoIterator<Item = &'a Record>, target: &Outputs) -> Identity {
    let mut id = Identity::default();
    for r in candidate {
        if let Some(reference) = target.get(&(r.prompt_id.as_str(), r.max_tokens)) {
            id.compared += 1;
            if *reference == r.outcome.text {
                id.identical += 1;
            } else {
                let at = match r.kind {
                    Kind::Accounting => String::new(),
                    Kind::Timing => format!(" @ RTT {} ms rep {}", r.rtt_ms, r.rep),
                    Kind::Drift => format!(" @ drift rep {}", r.rep),
                    Kind::Sampled => " (sampled)".into(),
                };
                id.differing.push(format!("{}{at}", r.prompt_id));
            }
        }
    }
    id
}

/// The figures of one mode from its accounting (or sampled) batches, against target-only's calls per
/// token and (greedy) outputs.
fn mode_summary(mode: Mode, temperature: f64, batches: &[&BatchResult], calls_per_token: Option<f64>, outputs: &Outputs) -> ModeSummary {
    let records: Vec<&Record> = batches.iter().flat_map(|b| &b.records).collect();
    let sum = |f: fn(&Outcome) -> u64| records.iter().map(|r| f(&r.outcome)).sum::<u64>() as f64;
    let (tokens, calls) = (sum(|o| o.completion_tokens), sum(|o| o.verify_calls));
    let (accepted, drafted) = (sum(|o| o.accepted), sum(|o| o.accepted + o.rejected));
    let mut verifier = VerifierCounters::default();
    batches.iter().for_each(|b| verifier.add(&b.verifier));
    let per_token = |x: f64| ratio(x, tokens);
    let mut by_category: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for r in &records {
        let e = by_category.entry(format!("{:?}", r.category).to_lowercase()).or_default();
        e.0 += r.outcome.accepted as f64;
        e.1 += (r.outcome.accepted + r.outcome.rejected) as f64;
    }
    ModeSummary {
        mode,
        label: mode.to_string(),
        temperature,
        requests: records.len(),
        tokens: tokens as u64,
        calls_per_request: ratio(calls, records.len() as f64).unwrap_or(0.0),
        calls_saved: calls_per_token.filter(|_| mode.uses_verifier()).and_then(|base| Some(1.0 - ratio(calls, tokens)? / base)),
        acceptance: ratio(accepted, drafted),
        tokens_per_call: ratio(tokens, calls),
        acceptance_by_position: verifier.acceptance_by_position(),
        acceptance_by_category: by_category.into_iter().filter_map(|(c, (a, d))| Some((c, ratio(a, d)?))).collect(),
        verifier_cpu_s_per_token: per_token(batches.iter().map(|b| b.verifier_cpu_s).sum()),
        gateway_cpu_s_per_token: per_token(batches.iter().map(|b| b.gateway_cpu_s).sum()),
        verifier_forward_s_per_token: per_token(verifier.forward_seconds),
        bytes_per_token: per_token(sum(|o| o.bytes_sent + o.bytes_received)),
        timing: timing(records.iter().copied()),
        identical: (temperature == 0.0 && mode != Mode::TargetOnly).then(|| identity(records.iter().copied(), outputs)),
    }
}

/// The per-round breakdown of some requests (None without verify calls).
pub fn per_round(records: &[&Record]) -> Option<PerRound> {
    let calls: f64 = records.iter().map(|r| r.outcome.verify_calls as f64).sum();
    if calls == 0.0 {
        return None;
    }
    let sum = |f: fn(&Outcome) -> f64| records.iter().map(|r| f(&r.outcome)).sum::<f64>() / calls;
    let (wall_s, draft_s, link_s, verifier_s) = (sum(|o| o.total_s), sum(|o| o.timing.draft_s), sum(|o| o.timing.link_s), sum(|o| o.timing.verifier_s));
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

fn speed_row(mode: Mode, rtt_ms: u64, drift_to_ms: Option<u64>, records: &[&Record]) -> SpeedRow {
    let sum = |f: fn(&Outcome) -> u64| records.iter().map(|r| f(&r.outcome)).sum::<u64>() as f64;
    let (tokens, calls, drafted_ahead, used) = (sum(|o| o.completion_tokens), sum(|o| o.verify_calls), sum(|o| o.ahead_drafted), sum(|o| o.ahead_used));
    let auto: Vec<f64> = records.iter().filter_map(|r| r.outcome.auto.as_ref()?.get("draft")?.as_f64()).collect();
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
fn against_target_only(rows: &mut [SpeedRow]) {
    let base = rows.iter().find(|r| r.mode == Mode::TargetOnly).and_then(SpeedRow::tokens_per_s);
    for r in rows.iter_mut() {
        r.vs_target_only = base.and_then(|b| ratio(r.tokens_per_s()?, b));
    }
}

/// `auto` against every fixed draft length (draft-ahead on) among one link's rows.
pub fn auto_vs_fixed(rows: &[SpeedRow]) -> Option<AutoVsFixed> {
    let auto = rows.iter().find(|r| r.mode == Mode::Auto)?;
    let fixed: Vec<(u32, f64)> = rows.iter().filter_map(|r| Some((r.mode.fixed_with_ahead()?, r.tokens_per_s()?))).collect();
    let &(best_fixed, best) = fixed.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let auto_tps = auto.tokens_per_s()?;
    let auto_vs_best = auto_tps / best - 1.0;
    let met = if auto.drift_to_ms.is_some() { fixed.iter().all(|&(_, f)| auto_tps > f) } else { auto_vs_best >= -AUTO_TOLERANCE };
    Some(AutoVsFixed {
        rtt_ms: auto.rtt_ms,
        drift_to_ms: auto.drift_to_ms,
        auto_tokens_per_s: auto_tps,
        fixed,
        best_fixed,
        best_fixed_tokens_per_s: best,
        auto_vs_best,
        paired_vs_best: None,
        met,
    })
}

/// `a` / `b` − 1 in tokens/s within each repetition both ran, spread over repetitions. A repetition runs
/// the modes of a link prompt by prompt in turns ([`crate::plan::Plan::links`]), so the pair leaves out how the
/// shared host's speed drifts between repetitions, which moves each mode's median by as much as the 5%
/// `auto` is held to.
fn paired_by_rep(a: &[&Record], b: &[&Record]) -> Option<Spread> {
    let b = by_rep(b.iter().copied());
    let pairs: Vec<f64> = by_rep(a.iter().copied()).iter().filter_map(|(rep, a)| Some(ratio(a.tokens_per_s()?, b.get(rep)?.tokens_per_s()?)? - 1.0)).collect();
    Spread::of(&pairs)
}

/// Speculative decoding with draft-ahead (auto or fixed) against target-only among one RTT's rows.
fn vs_target_only(rows: &[SpeedRow]) -> Option<VsTargetOnly> {
    let target = rows.iter().find(|r| r.mode == Mode::TargetOnly)?;
    let target_tps = target.tokens_per_s()?;
    let ahead = |m: Mode| matches!(m, Mode::Auto | Mode::Speculative(_));
    let best = rows.iter().filter(|r| ahead(r.mode)).filter_map(|r| Some((r, r.tokens_per_s()?))).max_by(|a, b| a.1.total_cmp(&b.1))?;
    let goal = SPEEDUP_GOALS.iter().find(|(rtt, _)| *rtt == target.rtt_ms).map(|g| g.1);
    let best_ratio = best.1 / target_tps;
    Some(VsTargetOnly {
        rtt_ms: target.rtt_ms,
        target_only_tokens_per_s: target_tps,
        auto_ratio: rows.iter().find(|r| r.mode == Mode::Auto).and_then(SpeedRow::tokens_per_s).map(|a| a / target_tps),
        best: best.0.mode,
        best_ratio,
        goal,
        met: goal.map(|g| best_ratio >= g),
        dominant: best.0.per_round.map(|p| p.dominant().to_string()),
        decode_ratio: best.0.timing.decode_tokens_per_s.zip(target.timing.decode_tokens_per_s).and_then(|(b, t)| ratio(b.median, t.median)),
        gap: goal.zip(best.0.per_round).and_then(|(g, p)| GoalGap::of(&p, best_ratio, g)),
    })
}

/// Every figure of a run.
pub fn summarise(results: &[BatchResult], modes: &[Mode], rtts_ms: &[u64], drift: Option<Drift>) -> Summary {
    let mut warnings = Vec::new();
    let of = |mode: Mode, kind: Kind| results.iter().filter(move |b| b.batch.mode == mode && b.batch.kind == kind).collect::<Vec<_>>();
    let records = |mode: Mode, kind: Kind, rtt_ms: u64| -> Vec<&Record> {
        results.iter().filter(|b| b.batch.mode == mode && b.batch.kind == kind && b.batch.rtt_ms == rtt_ms).flat_map(|b| &b.records).collect()
    };

    // Target-only's greedy outputs, the reference for every other mode; it must agree with itself.
    let mut outputs: Outputs = HashMap::new();
    for r in results.iter().filter(|b| b.batch.mode == Mode::TargetOnly && b.batch.temperature == 0.0).flat_map(|b| &b.records) {
        let seen = *outputs.entry((r.prompt_id.as_str(), r.max_tokens)).or_insert(r.outcome.text.as_str());
        if seen != r.outcome.text {
            warnings.push(format!(
                "target-only's own greedy output of {} ({} tokens) differs between requests: the reference is the first",
                r.prompt_id, r.max_tokens
            ));
        }
    }
    if outputs.is_empty() && results.iter().any(|b| b.batch.mode.speculates()) {
        warnings.push("no target-only greedy output: losslessness is not checked".into());
    }

    let mut sections = Vec::new();
    for kind in [Kind::Accounting, Kind::Sampled] {
        let target_records: Vec<&Record> = of(Mode::TargetOnly, kind).into_iter().flat_map(|b| &b.records).collect();
        let calls_per_token =
            ratio(target_records.iter().map(|r| r.outcome.verify_calls as f64).sum(), target_records.iter().map(|r| r.outcome.completion_tokens as f64).sum());
        if target_records.is_empty() && results.iter().any(|b| b.batch.kind == kind) {
            warnings.push(format!("no target-only {kind:?} batch: calls saved are not computed"));
        }
        let mut rows = Vec::new();
        for &mode in modes {
            let batches = of(mode, kind);
            let Some(first) = batches.first() else { continue };
            rows.push(mode_summary(mode, first.batch.temperature, &batches, calls_per_token, &outputs));
        }
        sections.push(rows);
    }
    let sampled = sections.pop().unwrap_or_default();
    let greedy = sections.pop().unwrap_or_default();

    let identity: Vec<ModeIdentity> = modes
        .iter()
        .filter(|m| m.speculates() || **m == Mode::DraftOnly)
        .map(|&mode| {
            let greedy_of = |kind| of(mode, kind).into_iter().filter(|b| b.batch.temperature == 0.0).flat_map(|b| &b.records);
            ModeIdentity {
                mode,
                label: mode.to_string(),
                accounting: identity(greedy_of(Kind::Accounting), &outputs),
                timing: identity(greedy_of(Kind::Timing), &outputs),
                drift: identity(greedy_of(Kind::Drift), &outputs),
            }
        })
        .collect();
    let speculative: Vec<&ModeIdentity> = identity.iter().filter(|i| i.mode.speculates()).collect();
    let lossless = !speculative.is_empty() && speculative.iter().all(|i| i.lossless());

    for b in results {
        let calls: u64 = b.records.iter().map(|r| r.outcome.verify_calls).sum();
        if b.batch.mode.uses_verifier() && (calls as f64 - b.verifier.calls).abs() > 0.5 {
            warnings.push(format!(
                "{} {:?} rep {} RTT {} ms: gateway counted {calls} verify calls, verifier {}",
                b.batch.mode, b.batch.kind, b.batch.rep, b.batch.rtt_ms, b.verifier.calls
            ));
        }
        let degraded = b.records.iter().filter(|r| r.outcome.degraded != (b.batch.mode == Mode::DraftOnly)).count();
        if degraded > 0 {
            warnings.push(format!("{} {:?} rep {}: {degraded} answers with an unexpected `degraded` flag", b.batch.mode, b.batch.kind, b.batch.rep));
        }
        if b.batch.kind == Kind::Drift && b.drift_switch.is_none() {
            warnings.push(format!("{} drift rep {}: the link never changed (the output was shorter than expected)", b.batch.mode, b.batch.rep));
        }
    }

    // Long outputs: how many tokens the long prompts really produced.
    let mut long_outputs: BTreeMap<(String, u32), (Option<u64>, u64)> = BTreeMap::new();
    for r in results.iter().filter(|b| matches!(b.batch.kind, Kind::Timing | Kind::Drift) && b.batch.temperature == 0.0).flat_map(|b| &b.records) {
        let e = long_outputs.entry((r.prompt_id.clone(), r.max_tokens)).or_insert((None, u64::MAX));
        if r.mode == Mode::TargetOnly {
            e.0.get_or_insert(r.outcome.completion_tokens);
        }
        e.1 = e.1.min(r.outcome.completion_tokens);
    }
    let long_outputs: Vec<LongOutput> =
        long_outputs.into_iter().map(|((prompt_id, max_tokens), (target, min))| LongOutput { prompt_id, max_tokens, tokens: target.unwrap_or(min) }).collect();
    for l in long_outputs.iter().filter(|l| l.tokens < u64::from(LONG_MIN_TOKENS)) {
        warnings.push(format!(
            "long prompt {} produced {} tokens (< {LONG_MIN_TOKENS}; asked {}): its timing is less dominated by decoding",
            l.prompt_id, l.tokens, l.max_tokens
        ));
    }

    let paired = |a: AutoVsFixed, kind: Kind, rtt: u64| AutoVsFixed {
        paired_vs_best: paired_by_rep(&records(Mode::Auto, kind, rtt), &records(Mode::Speculative(a.best_fixed), kind, rtt)),
        ..a
    };
    let mut speed = Vec::new();
    let mut auto_vs = Vec::new();
    let mut vs_target = Vec::new();
    for &rtt in rtts_ms {
        let mut rows: Vec<SpeedRow> = modes
            .iter()
            .filter(|m| m.uses_verifier() || rtt == 0)
            .filter_map(|&mode| {
                let recs = records(mode, Kind::Timing, rtt);
                (!recs.is_empty()).then(|| speed_row(mode, rtt, None, &recs))
            })
            .collect();
        against_target_only(&mut rows);
        auto_vs.extend(auto_vs_fixed(&rows).map(|a| paired(a, Kind::Timing, rtt)));
        vs_target.extend(vs_target_only(&rows));
        speed.extend(rows);
    }
    let mut drift_rows = Vec::new();
    if let Some(d) = drift {
        drift_rows = modes
            .iter()
            .filter_map(|&mode| {
                let recs = records(mode, Kind::Drift, d.from_ms);
                (!recs.is_empty()).then(|| {
                    let switches: Vec<DriftSwitch> = of(mode, Kind::Drift).iter().filter_map(|b| b.drift_switch).collect();
                    let at: Vec<f64> = switches.iter().map(|s| s.at_s).collect();
                    let share: Vec<f64> = switches.iter().filter_map(|s| s.share_of_request).collect();
                    SpeedRow { switch_at_s: median(&at), switch_share: median(&share), ..speed_row(mode, d.from_ms, Some(d.to_ms), &recs) }
                })
            })
            .collect();
        against_target_only(&mut drift_rows);
        auto_vs.extend(auto_vs_fixed(&drift_rows).map(|a| paired(a, Kind::Drift, d.from_ms)));
    }
    Summary { greedy, sampled, speed, drift: drift_rows, auto_vs_fixed: auto_vs, vs_target_only: vs_target, identity, long_outputs, lossless, warnings }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::RoundTiming;

    /// A request of batch `(rep, mode, kind, rtt_ms)` giving `(tokens, verify calls, seconds)`.
    fn record((rep, mode, kind, rtt_ms): (u32, Mode, Kind, u64), id: &str, text: &str, (tokens, calls, secs): (u64, u64, f64)) -> Record {
        let (accepted, rejected) = if mode.speculates() { (tokens - calls, calls) } else { (0, 0) };
        let long = matches!(kind, Kind::Timing | Kind::Drift);
        Record {
            rep,
            mode,
            kind,
            rtt_ms,
            drift_to_ms: (kind == Kind::Drift).then_some(150),
            temperature: 0.0,
            max_tokens: if long { 160 } else { 24 },
            prompt_id: id.into(),
            category: Category::Code,
            outcome: Outcome {
                text: text.into(),
                completion_tokens: tokens,
                accepted,
                rejected,
                verify_calls: calls,
                bytes_sent: 10 * calls,
                bytes_received: 2 * calls,
                degraded: mode == Mode::DraftOnly,
                ttft_s: secs / 4.0,
                total_s: secs,
                ahead_drafted: if mode.speculates() && mode != Mode::NoAhead(4) { calls } else { 0 },
                ahead_used: if mode.speculates() && mode != Mode::NoAhead(4) { calls / 2 } else { 0 },
                timing: RoundTiming {
                    draft_s: 0.1 * calls as f64,
                    overlap_s: 0.05 * calls as f64,
                    link_s: 0.02 * calls as f64,
                    verifier_s: 0.2 * calls as f64,
                },
                auto: (mode == Mode::Auto).then(|| serde_json::json!({"draft": 3})),
                ..Outcome::default()
            },
        }
    }

    fn batch(records: Vec<Record>, verifier_cpu_s: f64) -> BatchResult {
        let r = &records[0];
        let calls = records.iter().map(|r| r.outcome.verify_calls as f64).sum();
        let drift_switch = (r.kind == Kind::Drift).then_some(DriftSwitch { request: 0, at_s: 1.0, share_of_request: Some(0.5) });
        BatchResult {
            batch: Batch {
                rep: r.rep,
                mode: r.mode,
                kind: r.kind,
                rtt_ms: r.rtt_ms,
                drift_to_ms: r.drift_to_ms,
                temperature: 0.0,
                max_tokens: r.max_tokens,
                prompts: vec![],
            },
            verifier: VerifierCounters { calls, ..Default::default() },
            records,
            verifier_cpu_s,
            gateway_cpu_s: 0.0,
            wall_s: 0.0,
            drift_switch,
        }
    }

    const T: Mode = Mode::TargetOnly;
    const S: Mode = Mode::Speculative(4);
    const MODES: [Mode; 2] = [T, S];

    fn run() -> Vec<BatchResult> {
        let (acc, tim) = (Kind::Accounting, Kind::Timing);
        vec![
            batch(vec![record((0, T, acc, 0), "a", "x", (20, 20, 2.0)), record((0, T, acc, 0), "b", "y", (20, 20, 2.0))], 4.0),
            batch(vec![record((0, S, acc, 0), "a", "x", (20, 5, 4.0)), record((0, S, acc, 0), "b", "y", (20, 5, 4.0))], 2.0),
            batch(vec![record((0, T, tim, 0), "long", "long text", (160, 160, 16.0))], 0.0),
            batch(vec![record((0, S, tim, 0), "long", "long text", (160, 40, 16.0))], 0.0),
            batch(vec![record((1, S, tim, 0), "long", "long text", (160, 40, 8.0))], 0.0),
            batch(vec![record((2, S, tim, 0), "long", "long text", (160, 40, 32.0))], 0.0),
            batch(vec![record((0, S, tim, 50), "long", "long text", (160, 40, 20.0))], 0.0),
            batch(vec![record((0, T, tim, 50), "long", "long text", (160, 160, 40.0))], 0.0),
        ]
    }

    #[test]
    fn accounting_figures_against_target_only() {
        let s = summarise(&run(), &MODES, &[0, 50], None);
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        let spec = &s.greedy[1];
        assert_eq!(spec.calls_per_request, 5.0);
        assert!((spec.calls_saved.unwrap() - 0.75).abs() < 1e-12);
        assert_eq!(spec.tokens_per_call, Some(4.0));
        assert_eq!(spec.acceptance, Some(30.0 / 40.0));
        assert_eq!(spec.verifier_cpu_s_per_token, Some(2.0 / 40.0));
        assert_eq!(spec.bytes_per_token, Some(120.0 / 40.0));
        assert_eq!(spec.identical, Some(Identity { identical: 2, compared: 2, differing: vec![] }));
        assert_eq!(spec.timing.tokens_per_s.unwrap().median, 40.0 / 8.0, "the accounting requests' own speed");
        let id = &s.identity[0];
        assert_eq!((id.accounting.compared, id.timing.compared, id.drift.compared), (2, 4, 0));
        assert!(s.lossless);
        assert_eq!(s.long_outputs.len(), 1);
        assert_eq!(s.long_outputs[0].tokens, 160);
    }

    #[test]
    fn speed_is_the_median_over_repetitions_of_the_long_prompts() {
        let s = summarise(&run(), &MODES, &[0, 50], None);
        let row = s.speed.iter().find(|r| r.mode == S && r.rtt_ms == 0).unwrap();
        // 160 tokens in 16, 8 and 32 s.
        let tps = row.timing.tokens_per_s.unwrap();
        assert_eq!((tps.median, tps.min, tps.max, tps.reps), (10.0, 5.0, 20.0, 3));
        assert_eq!(row.timing.ttft_s.unwrap().median, 4.0);
        assert_eq!(row.timing.decode_tokens_per_s.unwrap().median, 159.0 / 12.0);
        assert_eq!(row.vs_target_only, Some(1.0));
        assert_eq!(row.tokens_per_call, Some(4.0));
        assert_eq!((row.min_tokens, row.requests), (160, 3));
        let at50 = s.speed.iter().find(|r| r.mode == S && r.rtt_ms == 50).unwrap();
        assert_eq!(at50.vs_target_only, Some(2.0));
        let goal50 = s.vs_target_only.iter().find(|v| v.rtt_ms == 50).unwrap();
        assert_eq!((goal50.best, goal50.best_ratio, goal50.goal, goal50.met), (S, 2.0, Some(1.5), Some(true)));
        let goal0 = s.vs_target_only.iter().find(|v| v.rtt_ms == 0).unwrap();
        assert_eq!((goal0.goal, goal0.met), (Some(1.0), Some(true)));
        assert_eq!((goal0.gap, goal50.gap), (None, None), "goals met leave no gap");
    }

    #[test]
    fn a_missed_goal_says_how_fast_the_verifier_would_have_to_be() {
        // A 400 ms round, 250 of it verifier, at 1.6x where 2x is the goal: the round must take
        // 320 ms, so the verifier 170 ms with the other 150 ms unchanged.
        let p = PerRound { rounds: 30.0, wall_s: 0.4, draft_s: 0.02, link_s: 0.105, verifier_s: 0.25, other_s: 0.025, overlap_s: 0.2 };
        let gap = GoalGap::of(&p, 1.6, 2.0).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(gap.round_needed_s, 0.32) && close(gap.verifier_needed_s, 0.17), "{gap:?}");
        assert!(gap.verifier_can_close_it());
        // At 0.5x of a 2x goal the round must take 100 ms, less than the other terms' 150 ms.
        let beyond = GoalGap::of(&p, 0.5, 2.0).unwrap();
        assert!(beyond.verifier_needed_s < 0.0 && !beyond.verifier_can_close_it());
        assert_eq!(GoalGap::of(&p, 2.0, 2.0), None);
    }

    #[test]
    fn the_round_breakdown_divides_the_gateways_timing_by_verify_calls() {
        let s = summarise(&run(), &MODES, &[0, 50], None);
        let row = s.speed.iter().find(|r| r.mode == S && r.rtt_ms == 0).unwrap();
        let p = row.per_round.unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(p.rounds, 40.0));
        assert!(close(p.wall_s, 56.0 / 120.0));
        assert!(close(p.draft_s, 0.1) && close(p.link_s, 0.02) && close(p.verifier_s, 0.2) && close(p.overlap_s, 0.05));
        assert!(close(p.other_s, 56.0 / 120.0 - 0.32));
        assert_eq!(p.dominant(), "verifier");
        assert_eq!((row.ahead_used_per_round, row.ahead_used_per_drafted), (Some(0.5), Some(0.5)));
        let target = s.speed.iter().find(|r| r.mode == T && r.rtt_ms == 0).unwrap();
        assert_eq!(target.ahead_used_per_round, None, "target-only drafts nothing");
    }

    fn speed(mode: Mode, drift: bool, tps: f64) -> SpeedRow {
        let r = record((0, mode, if drift { Kind::Drift } else { Kind::Timing }, 20), "long", "t", (100, 25, 100.0 / tps));
        speed_row(mode, 20, drift.then_some(150), &[&r])
    }

    #[test]
    fn auto_is_held_to_the_best_fixed_length() {
        let rows = [speed(T, false, 5.0), speed(Mode::Speculative(1), false, 10.0), speed(S, false, 8.0), speed(Mode::NoAhead(1), false, 20.0)];
        let within = |auto: f64| {
            let mut r = rows.to_vec();
            r.push(speed(Mode::Auto, false, auto));
            auto_vs_fixed(&r).unwrap()
        };
        let a = within(9.6);
        assert_eq!((a.best_fixed, a.best_fixed_tokens_per_s, a.fixed.len()), (1, 10.0, 2), "no-ahead lengths are not auto's rivals");
        assert!(a.met && (a.auto_vs_best + 0.04).abs() < 1e-9);
        assert!(!within(9.4).met);
        assert_eq!(within(9.0).fixed, vec![(1, 10.0), (4, 8.0)]);
        assert!(auto_vs_fixed(&rows).is_none(), "no auto row, no comparison");
        assert_eq!(speed(Mode::Auto, false, 1.0).auto_last_draft, Some(3.0));
    }

    #[test]
    fn auto_is_paired_with_the_best_fixed_length_within_each_repetition() {
        // Repetition 0 on a fast stretch of the host, repetition 1 on a slow one, 2 only for auto.
        let (a, d) = (Mode::Auto, Mode::Speculative(4));
        let records = [
            record((0, a, Kind::Timing, 0), "long-01", "x", (100, 30, 10.0)),
            record((0, d, Kind::Timing, 0), "long-01", "x", (100, 25, 8.0)),
            record((1, a, Kind::Timing, 0), "long-01", "x", (100, 30, 20.0)),
            record((1, d, Kind::Timing, 0), "long-01", "x", (100, 25, 25.0)),
            record((2, a, Kind::Timing, 0), "long-01", "x", (100, 30, 1.0)),
        ];
        let (auto, fixed): (Vec<&Record>, Vec<&Record>) = records.iter().partition(|r| r.mode == a);
        let p = paired_by_rep(&auto, &fixed).unwrap();
        assert_eq!(p.reps, 2, "a repetition without both modes is not a pair");
        assert!((p.min + 0.2).abs() < 1e-9 && (p.max - 0.25).abs() < 1e-9, "{p:?}");
        assert!(paired_by_rep(&auto, &[]).is_none());
    }

    #[test]
    fn on_the_drift_case_auto_must_beat_every_fixed_length() {
        let drift = |auto: f64| auto_vs_fixed(&[speed(Mode::Speculative(1), true, 10.0), speed(S, true, 8.0), speed(Mode::Auto, true, auto)]).unwrap();
        assert!(!drift(9.9).met, "within 5% is not enough under drift");
        assert!(drift(10.1).met);
        assert_eq!(drift(10.1).drift_to_ms, Some(150));
    }

    #[test]
    fn a_differing_greedy_output_anywhere_breaks_losslessness() {
        let mut results = run();
        results[1].records[1].outcome.text = "z".into();
        let s = summarise(&results, &MODES, &[0], None);
        assert!(!s.lossless);
        assert_eq!(s.greedy[1].identical.as_ref().unwrap().differing, vec!["b".to_string()]);
        assert_eq!(s.greedy[1].identical.as_ref().unwrap().share(), 0.5);

        let mut results = run();
        results.push(batch(vec![record((0, S, Kind::Drift, 20), "long", "other text", (160, 40, 20.0))], 0.0));
        let s = summarise(&results, &MODES, &[0, 50], Some(Drift { from_ms: 20, to_ms: 150 }));
        assert!(!s.lossless);
        assert_eq!(s.identity[0].drift.differing, vec!["long @ drift rep 0".to_string()]);
        assert_eq!(s.drift.len(), 1);
        assert_eq!((s.drift[0].switch_at_s, s.drift[0].switch_share), (Some(1.0), Some(0.5)));
    }

    #[test]
    fn the_report_shows_the_acceptance_tables() {
        use crate::plan::{Plan, Sizes};
        use crate::prompts::{Message, Prompt};
        let prompt = |id: &str, max_tokens| Prompt {
            id: id.into(),
            category: Category::Code,
            messages: vec![Message { role: "user".into(), content: id.into() }],
            max_tokens,
        };
        let sizes = Sizes {
            draft_lens: vec![4],
            no_ahead_lens: vec![],
            auto: true,
            draft_only: false,
            auto_max_draft_len: 8,
            accounting_prompts: 2,
            sampled_prompts: 0,
            long_prompts: 1,
            max_tokens: 24,
            long_max_tokens: 160,
            temperature: 0.8,
            reps: 1,
            rtts_ms: vec![0, 50],
            drift: Some(Drift { from_ms: 20, to_ms: 150 }),
        };
        let plan = Plan::new(vec![prompt("a", 64), prompt("b", 64), prompt("long", 256)], &sizes).unwrap();
        let mut results = run();
        for (kind, rtt, tps) in [(Kind::Timing, 0, 11.0), (Kind::Timing, 50, 7.0), (Kind::Drift, 20, 9.0)] {
            results.push(batch(vec![record((0, Mode::Auto, kind, rtt), "long", "long text", (160, 40, 160.0 / tps))], 0.0));
        }
        results.push(batch(vec![record((0, S, Kind::Drift, 20), "long", "long text", (160, 40, 20.0))], 0.0));
        let modes = [T, S, Mode::Auto];
        let s = summarise(&results, &modes, &plan.rtts_ms, plan.drift);
        assert!(s.lossless, "{:?}", s.identity);
        let machine = crate::machine::Machine::describe();
        let setup = ["pinned".to_string()];
        let ctx = crate::report::Context {
            stamp: "now",
            command: "spade-bench --quick",
            machine: &machine,
            git: "git x",
            draft_model: "d",
            target_model: "t",
            wall_s: 60.0,
            plan: &plan,
            setup: &setup,
            verifier_pass_ms: &[40.0, 72.0, 100.0],
            compute_floor: crate::report::compute_floor_summary(
                "## round 1/1, 1 thread(s)\n\nratio (ours / llama.cpp), 1 thread(s): 1.5B-decode 1.11x\n\n\
                 ## summary: median ratio over 1 round(s) [min, max]\n1 thread(s) 1.5B-block5-time       0.88x [0.88, 0.88]\n",
            ),
        };
        let md = crate::report::render(&ctx, &s);
        for needle in [
            "`spade-bench --quick`",
            "## auto vs the best fixed draft length",
            "| RTT 0 ms | 11.00 | d=4 | 10.00 | +10.0% |",
            "| drift 20→150 ms | 9.00 | d=4 | 8.00 | +12.5% |",
            "## Speculative (draft-ahead) vs target-only",
            "| 50 ms | 4.00 | 1.75x | speculative d=4 | 2.00x | 2.00x | ≥ 1.5x | yes | verifier | — |",
            "summary: median ratio over 1 round(s) [min, max]:\n\n- `1 thread(s) 1.5B-block5-time       0.88x [0.88, 0.88]`\n",
            "| RTT 50 ms | 7.00 | d=4 | 8.00 | -12.5% | -12.5% [-12.5, -12.5] | d=4: 8.00 | **no** |",
            "## Drift: RTT 20→150 ms mid-run",
            "switch at 1.0 s (50%)",
            "| speculative auto | — | 2/2 | 1/1 | identical |",
            "| long | 160 | 160 | yes |",
            "- Setup: pinned",
            "1 40 ms (1.0x) · 2 72 ms (1.8x) · 3 100 ms (2.5x)",
        ] {
            assert!(md.contains(needle), "missing {needle:?} in\n{md}");
        }
    }

    #[test]
    fn counter_mismatches_short_outputs_and_missing_drift_switches_are_reported() {
        let mut results = run();
        results[1].verifier.calls = 3.0;
        let s = summarise(&results, &MODES, &[0], None);
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);

        let mut results = run();
        results[2].records[0].outcome.completion_tokens = 90;
        let mut drift = batch(vec![record((0, S, Kind::Drift, 20), "long", "long text", (160, 40, 20.0))], 0.0);
        drift.drift_switch = None;
        results.push(drift);
        let s = summarise(&results, &MODES, &[0], Some(Drift { from_ms: 20, to_ms: 150 }));
        assert!(s.warnings.iter().any(|w| w.contains("produced 90 tokens")), "{:?}", s.warnings);
        assert!(s.warnings.iter().any(|w| w.contains("never changed")), "{:?}", s.warnings);
    }
}
