//! What a benchmark run does, in order, and how long that should take.
//!
//! A run is a list of batches (one mode, one kind of measurement, one link RTT, a list of prompts),
//! grouped into gateway sessions: each group runs on a freshly started gateway. The order is
//! repetition-major, so the repetitions of a mode are spread over the whole run, and slow patches of
//! a shared machine land in one repetition of every mode rather than in every repetition of one.
//! Timing figures are medians over the repetitions.
//!
//! No gateway sees the same greedy request twice. The draft engine (mistral.rs 0.8.1 with its prefix
//! cache) drafts about 5 s per round slower when a request repeats a finished one token for token (the
//! whole context is a cache hit): measured at 0.4 instead of 2.3 tokens/s. Timing the one timing
//! prompt at four RTTs on one gateway measured that instead of the link, so every RTT > 0 gets a
//! gateway of its own.

use std::fmt;

use serde::Serialize;

use crate::prompts::{Category, Prompt};

/// The gateway's largest draft length (`--draft-len` is refused above it).
pub const MAX_DRAFT_LEN: u32 = 32;

/// How the gateway decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `--draft-len 0`: every token is one verifier forward pass (the baseline for cloud calls).
    TargetOnly,
    /// The draft model alone (no verifier listens; `--offline-fallback draft`). Drafts
    /// [`MAX_DRAFT_LEN`] tokens per call so the draft model runs as a plain generator.
    DraftOnly,
    /// Speculative decoding with this many draft tokens per verify call.
    Speculative(u32),
}

impl Mode {
    pub fn gateway_draft_len(self) -> u32 {
        match self {
            Mode::TargetOnly => 0,
            Mode::DraftOnly => MAX_DRAFT_LEN,
            Mode::Speculative(d) => d,
        }
    }

    /// Whether the mode talks to the verifier (and so feels the link).
    pub fn uses_verifier(self) -> bool {
        self != Mode::DraftOnly
    }

    /// Draft length on the plots' x axis: target-only is draft length 0.
    pub fn plot_x(self) -> Option<u32> {
        match self {
            Mode::TargetOnly => Some(0),
            Mode::DraftOnly => None,
            Mode::Speculative(d) => Some(d),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::TargetOnly => write!(f, "target-only"),
            Mode::DraftOnly => write!(f, "draft-only"),
            Mode::Speculative(d) => write!(f, "speculative d={d}"),
        }
    }
}

/// What a batch measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Greedy, no link delay, the full prompt list, once: calls, acceptance, cost, losslessness.
    Accounting,
    /// Seeded sampling at the sampled temperature, no link delay, every repetition.
    Sampled,
    /// Greedy on the timing prompts through a link of some RTT, every repetition.
    Timing,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Batch {
    pub rep: u32,
    pub mode: Mode,
    pub kind: Kind,
    pub rtt_ms: u64,
    pub temperature: f64,
    /// Indices into [`Plan::prompts`].
    pub prompts: Vec<usize>,
}

/// Everything a run will do, decided before it starts.
#[derive(Debug, Clone)]
pub struct Plan {
    pub prompts: Vec<Prompt>,
    pub modes: Vec<Mode>,
    pub max_tokens: u32,
    pub temperature: f64,
    pub reps: u32,
    pub rtts_ms: Vec<u64>,
    /// Prompts (indices) of each kind; the timing prompts are the first of the accounting prompts,
    /// so repetition 0 at RTT 0 reuses the accounting requests instead of running them twice.
    pub accounting: Vec<usize>,
    pub sampled: Vec<usize>,
    pub timing: Vec<usize>,
}

/// The sizes the command line chose.
#[derive(Debug, Clone)]
pub struct Sizes {
    pub draft_lens: Vec<u32>,
    pub accounting_prompts: usize,
    pub sampled_prompts: usize,
    pub timing_prompts: usize,
    pub max_tokens: u32,
    pub temperature: f64,
    pub reps: u32,
    pub rtts_ms: Vec<u64>,
}

impl Plan {
    pub fn new(prompts: Vec<Prompt>, sizes: &Sizes) -> Result<Self, String> {
        let order = interleave_categories(&prompts);
        let n = sizes.accounting_prompts.min(order.len());
        if n == 0 || sizes.reps == 0 || sizes.rtts_ms.is_empty() {
            return Err("need at least one prompt, one repetition and one RTT".into());
        }
        if sizes.timing_prompts == 0 || sizes.timing_prompts > n || sizes.sampled_prompts > order.len() {
            return Err(format!("timing prompts must be 1..={n} (the accounting prompts), sampled prompts at most {}", order.len()));
        }
        if let Some(d) = sizes.draft_lens.iter().find(|&&d| d == 0 || d > MAX_DRAFT_LEN) {
            return Err(format!("draft length {d} is outside 1..={MAX_DRAFT_LEN}"));
        }
        let mut draft_lens = sizes.draft_lens.clone();
        draft_lens.sort_unstable();
        draft_lens.dedup();
        let mut rtts_ms = sizes.rtts_ms.clone();
        rtts_ms.sort_unstable();
        rtts_ms.dedup();
        let modes = [Mode::TargetOnly, Mode::DraftOnly].into_iter().chain(draft_lens.into_iter().map(Mode::Speculative)).collect();
        Ok(Self {
            modes,
            max_tokens: sizes.max_tokens,
            temperature: sizes.temperature,
            reps: sizes.reps,
            rtts_ms,
            accounting: order[..n].to_vec(),
            sampled: order[..sizes.sampled_prompts].to_vec(),
            timing: order[..sizes.timing_prompts].to_vec(),
            prompts,
        })
    }

    /// Tokens asked of prompt `i`: its own `max_tokens`, capped by the run's.
    pub fn max_tokens_of(&self, i: usize) -> u32 {
        self.prompts[i].max_tokens.min(self.max_tokens)
    }

    /// The batches of repetition `rep` for `mode`, one group per gateway, in the order they run.
    /// The first gateway runs everything without link delay (timing first, so the timing prompts
    /// meet the gateway in the same state in every repetition: nothing run before them but the
    /// accounting prompts of repetition 0, which are distinct); each RTT > 0 has a gateway of its own.
    pub fn gateways(&self, rep: u32, mode: Mode) -> Vec<Vec<Batch>> {
        let batch = |kind, rtt_ms, temperature, prompts: &Vec<usize>| Batch { rep, mode, kind, rtt_ms, temperature, prompts: prompts.clone() };
        let mut first = Vec::new();
        if rep == 0 {
            // Also repetition 0 of the RTT-0 timing: the timing prompts are the first accounting ones.
            first.push(batch(Kind::Accounting, 0, 0.0, &self.accounting));
        } else if self.rtts_ms.contains(&0) {
            first.push(batch(Kind::Timing, 0, 0.0, &self.timing));
        }
        if !self.sampled.is_empty() {
            first.push(batch(Kind::Sampled, 0, self.temperature, &self.sampled));
        }
        let mut out = vec![first];
        // The draft model alone has no link.
        if mode.uses_verifier() {
            out.extend(self.rtts_ms.iter().filter(|&&rtt| rtt > 0).map(|&rtt| vec![batch(Kind::Timing, rtt, 0.0, &self.timing)]));
        }
        out
    }

    /// Seconds the whole plan should take on the machine this was written on (2 cores): a rough
    /// model, for the ETA printed at the start and refined as batches finish.
    pub fn estimate_seconds(&self) -> f64 {
        let (starts, by_kind) = self.estimate_parts();
        starts + by_kind.iter().map(|(_, s)| s).sum::<f64>()
    }

    /// The estimate split into starting servers and each kind of batch.
    pub fn estimate_parts(&self) -> (f64, [(Kind, f64); 3]) {
        let mut starts = VERIFIER_START_S;
        let mut by_kind = [(Kind::Accounting, 0.0), (Kind::Timing, 0.0), (Kind::Sampled, 0.0)];
        for rep in 0..self.reps {
            for &mode in &self.modes {
                let gateways = self.gateways(rep, mode);
                starts += gateways.len() as f64 * GATEWAY_START_S;
                for b in gateways.iter().flatten() {
                    if let Some(slot) = by_kind.iter_mut().find(|(k, _)| *k == b.kind) {
                        slot.1 += self.estimate_batch(b);
                    }
                }
            }
        }
        (starts, by_kind)
    }

    pub fn estimate_batch(&self, b: &Batch) -> f64 {
        b.prompts.iter().map(|&i| estimate_request(b.mode, self.max_tokens_of(i), b.rtt_ms as f64 / 1000.0)).sum()
    }
}

/// Measured on the 2-core development machine (Qwen2.5-Coder 0.5B drafting for 1.5B): loading the
/// target, and loading the draft model into a fresh gateway.
pub const VERIFIER_START_S: f64 = 10.0;
pub const GATEWAY_START_S: f64 = 4.0;

/// Rough seconds for one request of `tokens` tokens, fitted to runs on the development machine:
/// a fixed cost before the first token (prompt processing: the target's, and for speculative
/// decoding the draft model's too, plus the first block), then per token (target-only) or per
/// verify round (speculative: drafting grows with d), plus one RTT per verify call. Rounds assume a
/// per-token acceptance of 0.75 (0.64–0.8 measured on this pair).
pub fn estimate_request(mode: Mode, tokens: u32, rtt_s: f64) -> f64 {
    let tokens = f64::from(tokens);
    match mode {
        Mode::TargetOnly => 1.8 + tokens * (0.05 + rtt_s),
        Mode::DraftOnly => 1.5 + tokens * 0.08,
        Mode::Speculative(d) => {
            let (alpha, d) = (0.75_f64, f64::from(d));
            let per_round = (1.0 - alpha.powf(d + 1.0)) / (1.0 - alpha);
            let first = 3.0 + 0.4 * d + rtt_s;
            first + (tokens - per_round).max(0.0) / per_round * (0.15 + 0.07 * d + rtt_s)
        }
    }
}

/// Prompt indices taking one of each category in turn (code, chat, summarization, qa, code, …), so
/// any prefix of the order covers the categories evenly.
pub fn interleave_categories(prompts: &[Prompt]) -> Vec<usize> {
    let by_category: Vec<Vec<usize>> =
        Category::ALL.iter().map(|c| prompts.iter().enumerate().filter(|(_, p)| p.category == *c).map(|(i, _)| i).collect()).collect();
    let longest = by_category.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest).flat_map(|k| by_category.iter().filter_map(move |list| list.get(k).copied())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompts::Message;

    fn prompt(id: &str, category: Category) -> Prompt {
        Prompt { id: id.into(), category, messages: vec![Message { role: "user".into(), content: id.into() }], max_tokens: 64 }
    }

    fn sizes() -> Sizes {
        Sizes {
            draft_lens: vec![4, 1, 4],
            accounting_prompts: 6,
            sampled_prompts: 2,
            timing_prompts: 2,
            max_tokens: 24,
            temperature: 0.8,
            reps: 3,
            rtts_ms: vec![50, 0],
        }
    }

    fn prompts() -> Vec<Prompt> {
        let mut p: Vec<Prompt> = (0..3).map(|i| prompt(&format!("code-{i}"), Category::Code)).collect();
        p.extend((0..2).map(|i| prompt(&format!("qa-{i}"), Category::Qa)));
        p.push(prompt("chat-0", Category::Chat));
        p
    }

    #[test]
    fn categories_alternate() {
        let order: Vec<String> = interleave_categories(&prompts()).into_iter().map(|i| prompts()[i].id.clone()).collect();
        assert_eq!(order, ["code-0", "chat-0", "qa-0", "code-1", "qa-1", "code-2"]);
    }

    #[test]
    fn modes_and_rtts_are_sorted_and_deduplicated() {
        let plan = Plan::new(prompts(), &sizes()).unwrap();
        assert_eq!(plan.modes, vec![Mode::TargetOnly, Mode::DraftOnly, Mode::Speculative(1), Mode::Speculative(4)]);
        assert_eq!(plan.rtts_ms, vec![0, 50]);
        assert_eq!(plan.max_tokens_of(0), 24);
    }

    #[test]
    fn no_gateway_runs_the_timing_prompts_twice() {
        let plan = Plan::new(prompts(), &sizes()).unwrap();
        let kinds = |rep, mode| plan.gateways(rep, mode).iter().map(|g| g.iter().map(|b| (b.kind, b.rtt_ms)).collect::<Vec<_>>()).collect::<Vec<_>>();
        let spec = Mode::Speculative(4);
        assert_eq!(kinds(0, spec), vec![vec![(Kind::Accounting, 0), (Kind::Sampled, 0)], vec![(Kind::Timing, 50)]]);
        assert_eq!(kinds(1, spec), vec![vec![(Kind::Timing, 0), (Kind::Sampled, 0)], vec![(Kind::Timing, 50)]]);
        assert_eq!(kinds(1, Mode::DraftOnly), vec![vec![(Kind::Timing, 0), (Kind::Sampled, 0)]], "no link for the draft alone");
        let timing = &plan.gateways(1, spec)[0][0];
        assert_eq!(timing.prompts, plan.accounting[..2].to_vec());
    }

    #[test]
    fn bad_sizes_are_refused() {
        let with = |f: fn(&mut Sizes)| {
            let mut s = sizes();
            f(&mut s);
            Plan::new(prompts(), &s)
        };
        assert!(with(|s| s.draft_lens = vec![0]).is_err());
        assert!(with(|s| s.draft_lens = vec![33]).is_err());
        assert!(with(|s| s.timing_prompts = 7).is_err());
        assert!(with(|s| s.reps = 0).is_err());
        assert!(with(|s| s.rtts_ms.clear()).is_err());
    }

    #[test]
    fn estimates_grow_with_rtt_and_length() {
        assert!(estimate_request(Mode::TargetOnly, 24, 0.1) > estimate_request(Mode::TargetOnly, 24, 0.0) + 2.0);
        assert!(estimate_request(Mode::Speculative(4), 24, 0.0) > estimate_request(Mode::Speculative(4), 12, 0.0));
        let plan = Plan::new(prompts(), &sizes()).unwrap();
        assert!(plan.estimate_seconds() > VERIFIER_START_S);
    }
}
