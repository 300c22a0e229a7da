//! From raw measurements to the figures the report shows.
//!
//! Accounting figures (calls, acceptance, cost per token, bytes, losslessness) come from the
//! accounting batches (greedy, every accounting prompt once) and the sampled batches. Timing figures
//! are per repetition (tokens over seconds of that repetition's requests) and then the median over
//! repetitions.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::client::Outcome;
use crate::plan::{Batch, Kind, Mode};
use crate::prom::VerifierCounters;
use crate::prompts::Category;
use crate::stats::{ratio, Spread};

/// One request's result.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub rep: u32,
    pub mode: Mode,
    pub kind: Kind,
    pub rtt_ms: u64,
    pub temperature: f64,
    pub prompt_id: String,
    pub category: Category,
    #[serde(flatten)]
    pub outcome: Outcome,
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
}

/// Greedy outputs of a mode compared with target-only's, prompt by prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Identity {
    pub identical: usize,
    pub compared: usize,
    /// Prompts whose output differs (ids).
    pub differing: Vec<String>,
}

impl Identity {
    pub fn share(&self) -> f64 {
        ratio(self.identical as f64, self.compared as f64).unwrap_or(0.0)
    }
}

/// One row of the main tables: a mode at one temperature, no link delay.
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
    #[serde(flatten)]
    pub timing: Timing,
    /// Greedy only: outputs identical to target-only.
    pub identical: Option<Identity>,
}

/// Timing through an emulated link: one mode at one RTT, greedy.
#[derive(Debug, Clone, Serialize)]
pub struct RttSummary {
    pub rtt_ms: u64,
    pub mode: Mode,
    pub label: String,
    pub calls_per_request: f64,
    #[serde(flatten)]
    pub timing: Timing,
}

/// The fastest mode at one RTT.
#[derive(Debug, Clone, Serialize)]
pub struct BestAtRtt {
    pub rtt_ms: u64,
    pub best: Mode,
    pub best_tokens_per_s: f64,
    pub target_only_tokens_per_s: Option<f64>,
    /// Fastest speculative draft length and its tokens/s (it may lose to target-only).
    pub best_draft_len: Option<u32>,
    pub best_speculative_tokens_per_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub greedy: Vec<ModeSummary>,
    pub sampled: Vec<ModeSummary>,
    pub rtt: Vec<RttSummary>,
    pub best_by_rtt: Vec<BestAtRtt>,
    /// True when every speculative mode's greedy output matched target-only on every prompt.
    pub lossless: bool,
    /// Things a reader should know (counter mismatches, degraded answers, missing baselines).
    pub warnings: Vec<String>,
}

/// Timing figures of one mode: each is computed per repetition, then spread over repetitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Completion tokens / request seconds, end to end.
    pub tokens_per_s: Option<Spread>,
    /// Tokens after the first / seconds after the first: the steady pace once prompts are processed.
    /// None for draft-only, whose text arrives in one piece (it drafts whole completions at once).
    pub decode_tokens_per_s: Option<Spread>,
    /// Mean seconds to the first text.
    pub ttft_s: Option<Spread>,
}

/// The [`Timing`] of some requests.
pub fn timing<'a>(records: impl IntoIterator<Item = &'a Record>) -> Timing {
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
    let spread = |f: &dyn Fn(&Rep) -> Option<f64>| Spread::of(&by_rep.values().filter_map(f).collect::<Vec<_>>());
    Timing {
        tokens_per_s: spread(&|r| ratio(r.tokens, r.secs)),
        decode_tokens_per_s: spread(&|r| if r.burst { None } else { ratio(r.after_tokens, r.after_secs) }),
        ttft_s: spread(&|r| ratio(r.ttft, r.n)),
    }
}

/// Greedy outputs of `mode` vs target-only, by prompt id.
pub fn identity(candidate: &[&Record], target: &HashMap<&str, &str>) -> Identity {
    let mut id = Identity { identical: 0, compared: 0, differing: Vec::new() };
    for r in candidate {
        if let Some(reference) = target.get(r.prompt_id.as_str()) {
            id.compared += 1;
            if *reference == r.outcome.text {
                id.identical += 1;
            } else {
                id.differing.push(r.prompt_id.clone());
            }
        }
    }
    id
}

/// The figures of one mode from its accounting (or sampled) batches. `timing_records` give its
/// tokens/s and TTFT; `target` its baseline calls per token and greedy outputs.
fn mode_summary(mode: Mode, temperature: f64, batches: &[&BatchResult], timing_records: &[&Record], baseline: Option<&Baseline>) -> ModeSummary {
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
    let uses_verifier = mode.uses_verifier();
    ModeSummary {
        mode,
        label: mode.to_string(),
        temperature,
        requests: records.len(),
        tokens: tokens as u64,
        calls_per_request: ratio(calls, records.len() as f64).unwrap_or(0.0),
        calls_saved: baseline.filter(|_| uses_verifier).and_then(|b| Some(1.0 - ratio(calls, tokens)? / b.calls_per_token?)),
        acceptance: ratio(accepted, drafted),
        tokens_per_call: ratio(tokens, calls),
        acceptance_by_position: verifier.acceptance_by_position(),
        acceptance_by_category: by_category.into_iter().filter_map(|(c, (a, d))| Some((c, ratio(a, d)?))).collect(),
        verifier_cpu_s_per_token: per_token(batches.iter().map(|b| b.verifier_cpu_s).sum()),
        gateway_cpu_s_per_token: per_token(batches.iter().map(|b| b.gateway_cpu_s).sum()),
        verifier_forward_s_per_token: per_token(verifier.forward_seconds),
        bytes_per_token: per_token(sum(|o| o.bytes_sent + o.bytes_received)),
        timing: timing(timing_records.iter().copied()),
        identical: (temperature == 0.0 && mode != Mode::TargetOnly).then(|| identity(&records, &baseline.map(|b| b.outputs.clone()).unwrap_or_default())),
    }
}

fn records_of<'a>(batches: &[&'a BatchResult]) -> Vec<&'a Record> {
    batches.iter().flat_map(|b| b.records.iter()).collect()
}

/// Target-only's figures that the other modes are measured against.
struct Baseline<'a> {
    calls_per_token: Option<f64>,
    outputs: HashMap<&'a str, &'a str>,
}

/// Every figure of a run. `timing_prompts` are the ids whose accounting requests double as
/// repetition 0 of the RTT-0 timing.
pub fn summarise(results: &[BatchResult], modes: &[Mode], rtts_ms: &[u64], timing_prompts: &HashSet<String>) -> Summary {
    let mut warnings = Vec::new();
    let of = |mode: Mode, kind: Kind| results.iter().filter(move |b| b.batch.mode == mode && b.batch.kind == kind).collect::<Vec<_>>();
    let greedy_timing = |mode: Mode, rtt: u64| -> Vec<&Record> {
        results
            .iter()
            .filter(|b| b.batch.mode == mode && b.batch.rtt_ms == rtt)
            .flat_map(|b| {
                b.records.iter().filter(move |r| b.batch.kind == Kind::Timing || (b.batch.kind == Kind::Accounting && timing_prompts.contains(&r.prompt_id)))
            })
            .collect()
    };

    let mut sections = Vec::new();
    for kind in [Kind::Accounting, Kind::Sampled] {
        let target = of(Mode::TargetOnly, kind);
        let target_records = records_of(&target);
        let baseline = (!target.is_empty()).then(|| Baseline {
            calls_per_token: ratio(
                target_records.iter().map(|r| r.outcome.verify_calls as f64).sum(),
                target_records.iter().map(|r| r.outcome.completion_tokens as f64).sum(),
            ),
            outputs: target_records.iter().map(|r| (r.prompt_id.as_str(), r.outcome.text.as_str())).collect(),
        });
        if baseline.is_none() && results.iter().any(|b| b.batch.kind == kind) {
            warnings.push(format!("no target-only {kind:?} batch: calls saved and identity are not computed"));
        }
        let mut rows = Vec::new();
        for &mode in modes {
            let batches = of(mode, kind);
            let Some(first) = batches.first() else { continue };
            let timing_records = if kind == Kind::Accounting { greedy_timing(mode, 0) } else { records_of(&batches) };
            rows.push(mode_summary(mode, first.batch.temperature, &batches, &timing_records, baseline.as_ref()));
        }
        sections.push(rows);
    }
    let sampled = sections.pop().unwrap_or_default();
    let greedy = sections.pop().unwrap_or_default();

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
    }

    let mut rtt = Vec::new();
    let mut best_by_rtt = Vec::new();
    for &r in rtts_ms {
        let rows: Vec<RttSummary> = modes
            .iter()
            .filter(|m| m.uses_verifier() || r == 0)
            .filter_map(|&mode| {
                let recs = greedy_timing(mode, r);
                (!recs.is_empty()).then(|| {
                    let calls = recs.iter().map(|x| x.outcome.verify_calls as f64).sum::<f64>();
                    RttSummary { rtt_ms: r, mode, label: mode.to_string(), calls_per_request: calls / recs.len() as f64, timing: timing(recs.iter().copied()) }
                })
            })
            .collect();
        best_by_rtt.extend(best_at(r, &rows));
        rtt.extend(rows);
    }

    let lossless = greedy
        .iter()
        .filter(|m| matches!(m.mode, Mode::Speculative(_)))
        .all(|m| m.identical.as_ref().is_some_and(|i| i.compared > 0 && i.identical == i.compared))
        && greedy.iter().any(|m| matches!(m.mode, Mode::Speculative(_)));
    Summary { greedy, sampled, rtt, best_by_rtt, lossless, warnings }
}

/// The fastest verifier-using mode among one RTT's rows (draft-only is not an option: it is not
/// the target's output).
fn best_at(rtt_ms: u64, rows: &[RttSummary]) -> Option<BestAtRtt> {
    let speed = |r: &RttSummary| r.timing.tokens_per_s.map(|s| s.median);
    let fastest = |pred: fn(Mode) -> bool| rows.iter().filter(|r| pred(r.mode)).filter_map(|r| Some((r, speed(r)?))).max_by(|a, b| a.1.total_cmp(&b.1));
    let (best, best_tps) = fastest(Mode::uses_verifier)?;
    let spec = fastest(|m| matches!(m, Mode::Speculative(_)));
    Some(BestAtRtt {
        rtt_ms,
        best: best.mode,
        best_tokens_per_s: best_tps,
        target_only_tokens_per_s: rows.iter().find(|r| r.mode == Mode::TargetOnly).and_then(speed),
        best_draft_len: spec.and_then(|(r, _)| match r.mode {
            Mode::Speculative(d) => Some(d),
            _ => None,
        }),
        best_speculative_tokens_per_s: spec.map(|(_, s)| s),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request of batch `(rep, mode, kind, rtt_ms)` giving `(tokens, verify calls, seconds)`.
    fn record((rep, mode, kind, rtt_ms): (u32, Mode, Kind, u64), id: &str, text: &str, (tokens, calls, secs): (u64, u64, f64)) -> Record {
        let (accepted, rejected) = match mode {
            Mode::Speculative(_) => (tokens - calls, calls),
            _ => (0, 0),
        };
        Record {
            rep,
            mode,
            kind,
            rtt_ms,
            temperature: 0.0,
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
            },
        }
    }

    fn batch(records: Vec<Record>, verifier_cpu_s: f64) -> BatchResult {
        let r = &records[0];
        let calls = records.iter().map(|r| r.outcome.verify_calls as f64).sum();
        BatchResult {
            batch: Batch { rep: r.rep, mode: r.mode, kind: r.kind, rtt_ms: r.rtt_ms, temperature: 0.0, prompts: vec![] },
            verifier: VerifierCounters { calls, ..Default::default() },
            records,
            verifier_cpu_s,
            gateway_cpu_s: 0.0,
            wall_s: 0.0,
        }
    }

    fn run() -> Vec<BatchResult> {
        let (t, s) = (Mode::TargetOnly, Mode::Speculative(4));
        let acc = Kind::Accounting;
        vec![
            batch(vec![record((0, t, acc, 0), "a", "x", (20, 20, 2.0)), record((0, t, acc, 0), "b", "y", (20, 20, 2.0))], 4.0),
            batch(vec![record((0, s, acc, 0), "a", "x", (20, 5, 4.0)), record((0, s, acc, 0), "b", "y", (20, 5, 4.0))], 2.0),
            batch(vec![record((1, s, Kind::Timing, 0), "a", "x", (20, 5, 2.0))], 0.0),
            batch(vec![record((2, s, Kind::Timing, 0), "a", "x", (20, 5, 8.0))], 0.0),
            batch(vec![record((1, s, Kind::Timing, 50), "a", "x", (20, 5, 5.0))], 0.0),
            batch(vec![record((1, t, Kind::Timing, 50), "a", "x", (20, 20, 4.0))], 0.0),
        ]
    }

    fn timing_ids() -> HashSet<String> {
        ["a".to_string()].into()
    }

    #[test]
    fn accounting_figures_against_target_only() {
        let s = summarise(&run(), &[Mode::TargetOnly, Mode::Speculative(4)], &[0, 50], &timing_ids());
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        let spec = &s.greedy[1];
        assert_eq!(spec.calls_per_request, 5.0);
        assert!((spec.calls_saved.unwrap() - 0.75).abs() < 1e-12);
        assert_eq!(spec.tokens_per_call, Some(4.0));
        assert_eq!(spec.acceptance, Some(30.0 / 40.0));
        assert_eq!(spec.verifier_cpu_s_per_token, Some(2.0 / 40.0));
        assert_eq!(spec.bytes_per_token, Some(120.0 / 40.0));
        assert_eq!(spec.identical, Some(Identity { identical: 2, compared: 2, differing: vec![] }));
        assert!(s.lossless);
    }

    #[test]
    fn timing_is_the_median_over_repetitions_of_the_timing_prompts() {
        let s = summarise(&run(), &[Mode::TargetOnly, Mode::Speculative(4)], &[0, 50], &timing_ids());
        // RTT 0, speculative: rep 0 is the accounting request of "a" (20 tok / 4 s), reps 1 and 2 are
        // 20/2 and 20/8; prompt "b" is no timing prompt.
        let t = s.greedy[1].timing;
        let tps = t.tokens_per_s.unwrap();
        assert_eq!((tps.median, tps.min, tps.max, tps.reps), (5.0, 2.5, 10.0, 3));
        // TTFT is a quarter of each request: 1 s in rep 0, then 0.5 s and 2 s; 19 tokens after it.
        assert_eq!(t.ttft_s.unwrap().median, 1.0);
        assert_eq!(t.decode_tokens_per_s.unwrap().median, 19.0 / 3.0);
        let best50 = s.best_by_rtt.iter().find(|b| b.rtt_ms == 50).unwrap();
        assert_eq!(best50.best, Mode::TargetOnly);
        assert_eq!(best50.best_draft_len, Some(4));
        assert_eq!(best50.target_only_tokens_per_s, Some(5.0));
    }

    #[test]
    fn a_differing_greedy_output_breaks_losslessness() {
        let mut results = run();
        results[1].records[1].outcome.text = "z".into();
        let s = summarise(&results, &[Mode::TargetOnly, Mode::Speculative(4)], &[0], &timing_ids());
        assert!(!s.lossless);
        assert_eq!(s.greedy[1].identical.as_ref().unwrap().differing, vec!["b".to_string()]);
        assert_eq!(s.greedy[1].identical.as_ref().unwrap().share(), 0.5);
    }

    #[test]
    fn counter_mismatches_are_reported() {
        let mut results = run();
        results[1].verifier.calls = 3.0;
        let s = summarise(&results, &[Mode::TargetOnly, Mode::Speculative(4)], &[0], &timing_ids());
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    }
}
