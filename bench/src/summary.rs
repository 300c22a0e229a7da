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
//!
//! By concept: [`Record`]s and [`BatchResult`]s are what a run measured; `accounting` holds the
//! accounting figures and losslessness ([`ModeSummary`], [`Identity`]), `speed` the speed figures
//! ([`SpeedRow`], [`Timing`], [`PerRound`]), `goals` what they are held to ([`AutoVsFixed`],
//! [`VsTargetOnly`]); [`summarise`] puts them together into a [`Summary`].

mod accounting;
mod goals;
mod speed;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

pub use accounting::{identity, Identity, ModeIdentity, ModeSummary};
use accounting::{mode_summary, Outputs};
pub use goals::{auto_vs_fixed, AutoVsFixed, GoalGap, VsTargetOnly, AUTO_TOLERANCE, SPEEDUP_GOALS};
use goals::{paired_by_rep, vs_target_only};
use speed::{against_target_only, speed_row};
pub use speed::{per_round, timing, PerRound, SpeedRow, Timing};

use crate::client::Outcome;
use crate::plan::{Batch, Drift, Kind, Mode, LONG_MIN_TOKENS};
use crate::prom::VerifierCounters;
use crate::prompts::Category;
use crate::stats::{median, ratio};

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

/// Every figure of a run.
pub fn summarise(
    results: &[BatchResult],
    modes: &[Mode],
    rtts_ms: &[u64],
    drift: Option<Drift>,
) -> Summary {
    let mut warnings = Vec::new();
    let of = |mode: Mode, kind: Kind| {
        results
            .iter()
            .filter(move |b| b.batch.mode == mode && b.batch.kind == kind)
            .collect::<Vec<_>>()
    };
    let records = |mode: Mode, kind: Kind, rtt_ms: u64| -> Vec<&Record> {
        results
            .iter()
            .filter(|b| b.batch.mode == mode && b.batch.kind == kind && b.batch.rtt_ms == rtt_ms)
            .flat_map(|b| &b.records)
            .collect()
    };

    // Target-only's greedy outputs, the reference for every other mode; it must agree with itself.
    let mut outputs: Outputs = HashMap::new();
    for r in results
        .iter()
        .filter(|b| b.batch.mode == Mode::TargetOnly && b.batch.temperature == 0.0)
        .flat_map(|b| &b.records)
    {
        let seen =
            *outputs.entry((r.prompt_id.as_str(), r.max_tokens)).or_insert(r.outcome.text.as_str());
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
        let target_records: Vec<&Record> =
            of(Mode::TargetOnly, kind).into_iter().flat_map(|b| &b.records).collect();
        let calls_per_token = ratio(
            target_records.iter().map(|r| r.outcome.verify_calls as f64).sum(),
            target_records.iter().map(|r| r.outcome.completion_tokens as f64).sum(),
        );
        if target_records.is_empty() && results.iter().any(|b| b.batch.kind == kind) {
            warnings.push(format!("no target-only {kind:?} batch: calls saved are not computed"));
        }
        let mut rows = Vec::new();
        for &mode in modes {
            let batches = of(mode, kind);
            let Some(first) = batches.first() else { continue };
            rows.push(mode_summary(
                mode,
                first.batch.temperature,
                &batches,
                calls_per_token,
                &outputs,
            ));
        }
        sections.push(rows);
    }
    let sampled = sections.pop().unwrap_or_default();
    let greedy = sections.pop().unwrap_or_default();

    let identity: Vec<ModeIdentity> = modes
        .iter()
        .filter(|m| m.speculates() || **m == Mode::DraftOnly)
        .map(|&mode| {
            let greedy_of = |kind| {
                of(mode, kind)
                    .into_iter()
                    .filter(|b| b.batch.temperature == 0.0)
                    .flat_map(|b| &b.records)
            };
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
        let degraded = b
            .records
            .iter()
            .filter(|r| r.outcome.degraded != (b.batch.mode == Mode::DraftOnly))
            .count();
        if degraded > 0 {
            warnings.push(format!(
                "{} {:?} rep {}: {degraded} answers with an unexpected `degraded` flag",
                b.batch.mode, b.batch.kind, b.batch.rep
            ));
        }
        if b.batch.kind == Kind::Drift && b.drift_switch.is_none() {
            warnings.push(format!(
                "{} drift rep {}: the link never changed (the output was shorter than expected)",
                b.batch.mode, b.batch.rep
            ));
        }
    }

    // Long outputs: how many tokens the long prompts really produced.
    let mut long_outputs: BTreeMap<(String, u32), (Option<u64>, u64)> = BTreeMap::new();
    for r in results
        .iter()
        .filter(|b| {
            matches!(b.batch.kind, Kind::Timing | Kind::Drift) && b.batch.temperature == 0.0
        })
        .flat_map(|b| &b.records)
    {
        let e = long_outputs.entry((r.prompt_id.clone(), r.max_tokens)).or_insert((None, u64::MAX));
        if r.mode == Mode::TargetOnly {
            e.0.get_or_insert(r.outcome.completion_tokens);
        }
        e.1 = e.1.min(r.outcome.completion_tokens);
    }
    let long_outputs: Vec<LongOutput> = long_outputs
        .into_iter()
        .map(|((prompt_id, max_tokens), (target, min))| LongOutput {
            prompt_id,
            max_tokens,
            tokens: target.unwrap_or(min),
        })
        .collect();
    for l in long_outputs.iter().filter(|l| l.tokens < u64::from(LONG_MIN_TOKENS)) {
        warnings.push(format!(
            "long prompt {} produced {} tokens (< {LONG_MIN_TOKENS}; asked {}): its timing is less dominated by decoding",
            l.prompt_id, l.tokens, l.max_tokens
        ));
    }

    let paired = |a: AutoVsFixed, kind: Kind, rtt: u64| AutoVsFixed {
        paired_vs_best: paired_by_rep(
            &records(Mode::Auto, kind, rtt),
            &records(Mode::Speculative(a.best_fixed), kind, rtt),
        ),
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
                    let switches: Vec<DriftSwitch> =
                        of(mode, Kind::Drift).iter().filter_map(|b| b.drift_switch).collect();
                    let at: Vec<f64> = switches.iter().map(|s| s.at_s).collect();
                    let share: Vec<f64> =
                        switches.iter().filter_map(|s| s.share_of_request).collect();
                    SpeedRow {
                        switch_at_s: median(&at),
                        switch_share: median(&share),
                        ..speed_row(mode, d.from_ms, Some(d.to_ms), &recs)
                    }
                })
            })
            .collect();
        against_target_only(&mut drift_rows);
        auto_vs.extend(auto_vs_fixed(&drift_rows).map(|a| paired(a, Kind::Drift, d.from_ms)));
    }
    Summary {
        greedy,
        sampled,
        speed,
        drift: drift_rows,
        auto_vs_fixed: auto_vs,
        vs_target_only: vs_target,
        identity,
        long_outputs,
        lossless,
        warnings,
    }
}
