//! Accounting figures: a mode's calls, acceptance and costs per token on the short prompts
//! ([`ModeSummary`]), and its greedy outputs against target-only's ([`Identity`]).

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::speed::{timing, Timing};
use super::{BatchResult, Record};
use crate::client::Outcome;
use crate::plan::{Kind, Mode};
use crate::prom::VerifierCounters;
use crate::stats::ratio;

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

/// Target-only's greedy outputs by (prompt id, max tokens).
pub(super) type Outputs<'a> = HashMap<(&'a str, u32), &'a str>;

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
pub(super) fn mode_summary(
    mode: Mode,
    temperature: f64,
    batches: &[&BatchResult],
    calls_per_token: Option<f64>,
    outputs: &Outputs,
) -> ModeSummary {
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
        calls_saved: calls_per_token
            .filter(|_| mode.uses_verifier())
            .and_then(|base| Some(1.0 - ratio(calls, tokens)? / base)),
        acceptance: ratio(accepted, drafted),
        tokens_per_call: ratio(tokens, calls),
        acceptance_by_position: verifier.acceptance_by_position(),
        acceptance_by_category: by_category
            .into_iter()
            .filter_map(|(c, (a, d))| Some((c, ratio(a, d)?)))
            .collect(),
        verifier_cpu_s_per_token: per_token(batches.iter().map(|b| b.verifier_cpu_s).sum()),
        gateway_cpu_s_per_token: per_token(batches.iter().map(|b| b.gateway_cpu_s).sum()),
        verifier_forward_s_per_token: per_token(verifier.forward_seconds),
        bytes_per_token: per_token(sum(|o| o.bytes_sent + o.bytes_received)),
        timing: timing(records.iter().copied()),
        identical: (temperature == 0.0 && mode != Mode::TargetOnly)
            .then(|| identity(records.iter().copied(), outputs)),
    }
}
