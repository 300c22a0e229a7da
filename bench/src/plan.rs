//! What a benchmark run does, in order, and how long that should take.
//!
//! A run is a list of batches (one mode, one kind of measurement, one link, a list of prompts),
//! grouped into gateway sessions: each group runs on a freshly started gateway. The order is
//! repetition-major, so the repetitions of a mode are spread over the whole run, and slow patches of
//! a shared machine land in one repetition of every mode rather than in every repetition of one.
//! Within a repetition the run goes link by link ([`Plan::links`]): every mode's gateway for a link is
//! up at once, and the long prompts take turns, one prompt of each mode after another, so the modes
//! compared at a link are timed seconds apart. Timing figures are medians over the repetitions.
//!
//! Two sets of prompts: the short ones (the prompt file's `max_tokens` < [`LONG_MIN_TOKENS`]) for the
//! accounting and sampled figures, at `--max-tokens`; the long ones (`max_tokens` >=
//! [`LONG_MIN_TOKENS`]) for speed through the link and the drift case, at `--long-max-tokens`, so
//! that decoding, not the first token, dominates the time measured.
//!
//! No gateway sees the same greedy request twice. The draft engine (mistral.rs with its prefix
//! cache) behaves differently when a request repeats a finished one token for token (the whole
//! context is a cache hit), so every RTT > 0, and the drift case, get a gateway of their own: every
//! link measures the same path from a cold draft cache.

use std::fmt;

use serde::Serialize;

use crate::prompts::{Category, Prompt};

/// The verifier's largest draft length (its `--max-draft` default; the gateway refuses more).
pub const MAX_DRAFT_LEN: u32 = 32;
/// The gateway's default `--max-draft-len`: fixed lengths above it raise the gateway's cap too.
pub const GATEWAY_MAX_DRAFT_LEN: u32 = 8;
/// A prompt whose own `max_tokens` is at least this is a long prompt (timing and drift).
pub const LONG_MIN_TOKENS: u32 = 128;

/// How the gateway decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `--draft-len 0`: every token is one verifier forward pass (the baseline for cloud calls).
    TargetOnly,
    /// The draft model alone (no verifier listens; `--offline-fallback draft`). Drafts
    /// [`MAX_DRAFT_LEN`] tokens per call so the draft model runs as a plain generator.
    DraftOnly,
    /// Speculative decoding with this many draft tokens per verify call, drafting ahead while a
    /// block is verified (the gateway's default).
    Speculative(u32),
    /// `--draft-len auto` (the gateway's default): the draft length is chosen each round; drafting ahead.
    Auto,
    /// A fixed draft length without drafting ahead (`--draft-ahead false`): what draft-ahead buys.
    NoAhead(u32),
}

impl Mode {
    /// The gateway's command-line arguments for this mode; `auto_max` caps `auto`.
    pub fn gateway_args(self, auto_max: u32) -> Vec<String> {
        let fixed = |d: u32, ahead: bool| {
            let mut a = vec![
                "--draft-len".to_string(),
                d.to_string(),
                "--draft-ahead".into(),
                ahead.to_string(),
            ];
            if d > GATEWAY_MAX_DRAFT_LEN {
                a.extend(["--max-draft-len".into(), d.to_string()]);
            }
            a
        };
        match self {
            Mode::TargetOnly => vec!["--draft-len".into(), "0".into()],
            Mode::DraftOnly => [
                "--draft-len",
                "32",
                "--max-draft-len",
                "32",
                "--offline-fallback",
                "draft",
                "--verify-retries",
                "0",
            ]
            .map(String::from)
            .to_vec(),
            Mode::Speculative(d) => fixed(d, true),
            Mode::NoAhead(d) => fixed(d, false),
            Mode::Auto => [
                "--draft-len",
                "auto",
                "--draft-ahead",
                "true",
                "--max-draft-len",
                &auto_max.to_string(),
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    /// Whether the mode talks to the verifier (and so feels the link).
    pub fn uses_verifier(self) -> bool {
        self != Mode::DraftOnly
    }

    /// Whether the mode drafts and verifies (its greedy output must equal target-only's).
    pub fn speculates(self) -> bool {
        matches!(self, Mode::Speculative(_) | Mode::Auto | Mode::NoAhead(_))
    }

    /// The fixed draft length with draft-ahead: the modes `auto` is compared against.
    pub fn fixed_with_ahead(self) -> Option<u32> {
        match self {
            Mode::Speculative(d) => Some(d),
            _ => None,
        }
    }

    /// Draft length on the plots' x axis: target-only is draft length 0.
    pub fn plot_x(self) -> Option<u32> {
        match self {
            Mode::TargetOnly => Some(0),
            Mode::Speculative(d) => Some(d),
            _ => None,
        }
    }

    /// The mode in a file name.
    pub fn slug(self) -> String {
        self.to_string().replace(' ', "-").replace('=', "")
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::TargetOnly => write!(f, "target-only"),
            Mode::DraftOnly => write!(f, "draft-only"),
            Mode::Speculative(d) => write!(f, "speculative d={d}"),
            Mode::Auto => write!(f, "speculative auto"),
            Mode::NoAhead(d) => write!(f, "speculative d={d} no-ahead"),
        }
    }
}

/// What a batch measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Greedy, no link delay, the short prompts, once: calls, acceptance, cost, losslessness.
    Accounting,
    /// Seeded sampling at the sampled temperature, no link delay, every repetition.
    Sampled,
    /// Greedy on the long prompts through a link of some RTT, every repetition.
    Timing,
    /// Greedy on the long prompts while the RTT changes halfway through the batch's output.
    Drift,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Batch {
    pub rep: u32,
    pub mode: Mode,
    pub kind: Kind,
    /// The link's RTT (for drift: before the change).
    pub rtt_ms: u64,
    /// Drift only: the RTT after the change.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift_to_ms: Option<u64>,
    pub temperature: f64,
    /// Most tokens per request (each prompt's own `max_tokens` caps it too).
    pub max_tokens: u32,
    /// Indices into [`Plan::prompts`].
    pub prompts: Vec<usize>,
}

/// The drift case: the RTT changes from `from_ms` to `to_ms` halfway through a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Drift {
    pub from_ms: u64,
    pub to_ms: u64,
}

/// Everything a run will do, decided before it starts.
#[derive(Debug, Clone)]
pub struct Plan {
    pub prompts: Vec<Prompt>,
    pub modes: Vec<Mode>,
    pub max_tokens: u32,
    pub long_max_tokens: u32,
    pub temperature: f64,
    pub reps: u32,
    pub rtts_ms: Vec<u64>,
    pub drift: Option<Drift>,
    pub auto_max_draft_len: u32,
    /// Prompts (indices) of each kind: accounting and sampled from the short prompts, interleaved by
    /// category; long ones in file order.
    pub accounting: Vec<usize>,
    pub sampled: Vec<usize>,
    pub long: Vec<usize>,
}

/// The sizes the command line chose.
#[derive(Debug, Clone)]
pub struct Sizes {
    pub draft_lens: Vec<u32>,
    pub no_ahead_lens: Vec<u32>,
    pub auto: bool,
    pub draft_only: bool,
    pub auto_max_draft_len: u32,
    pub accounting_prompts: usize,
    pub sampled_prompts: usize,
    pub long_prompts: usize,
    pub max_tokens: u32,
    pub long_max_tokens: u32,
    pub temperature: f64,
    pub reps: u32,
    pub rtts_ms: Vec<u64>,
    pub drift: Option<Drift>,
}

fn sorted(list: &[u32]) -> Vec<u32> {
    let mut v = list.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

impl Plan {
    pub fn new(prompts: Vec<Prompt>, sizes: &Sizes) -> Result<Self, String> {
        let short: Vec<Prompt> =
            prompts.iter().filter(|p| p.max_tokens < LONG_MIN_TOKENS).cloned().collect();
        let short_index: Vec<usize> =
            (0..prompts.len()).filter(|&i| prompts[i].max_tokens < LONG_MIN_TOKENS).collect();
        let order: Vec<usize> =
            interleave_categories(&short).into_iter().map(|i| short_index[i]).collect();
        let long: Vec<usize> =
            (0..prompts.len()).filter(|&i| prompts[i].max_tokens >= LONG_MIN_TOKENS).collect();
        if sizes.reps == 0 || sizes.rtts_ms.is_empty() {
            return Err("need at least one repetition and one RTT".into());
        }
        if sizes.accounting_prompts > order.len() || sizes.sampled_prompts > order.len() {
            return Err(format!(
                "accounting and sampled prompts: at most {} (the short prompts)",
                order.len()
            ));
        }
        if sizes.long_prompts == 0 || sizes.long_prompts > long.len() {
            return Err(format!(
                "long prompts must be 1..={} (prompts with max_tokens >= {LONG_MIN_TOKENS})",
                long.len()
            ));
        }
        if sizes.max_tokens == 0 || sizes.long_max_tokens == 0 {
            return Err("--max-tokens and --long-max-tokens must be at least 1".into());
        }
        if let Some(d) = sizes
            .draft_lens
            .iter()
            .chain(&sizes.no_ahead_lens)
            .chain([&sizes.auto_max_draft_len])
            .find(|&&d| d == 0 || d > MAX_DRAFT_LEN)
        {
            return Err(format!("draft length {d} is outside 1..={MAX_DRAFT_LEN}"));
        }
        let mut modes = vec![Mode::TargetOnly];
        if sizes.draft_only {
            modes.push(Mode::DraftOnly);
        }
        modes.extend(sorted(&sizes.draft_lens).into_iter().map(Mode::Speculative));
        if sizes.auto {
            modes.push(Mode::Auto);
        }
        modes.extend(sorted(&sizes.no_ahead_lens).into_iter().map(Mode::NoAhead));
        let mut rtts_ms = sizes.rtts_ms.clone();
        rtts_ms.sort_unstable();
        rtts_ms.dedup();
        Ok(Self {
            modes,
            max_tokens: sizes.max_tokens,
            long_max_tokens: sizes.long_max_tokens,
            temperature: sizes.temperature,
            reps: sizes.reps,
            rtts_ms,
            drift: sizes.drift,
            auto_max_draft_len: sizes.auto_max_draft_len,
            accounting: order[..sizes.accounting_prompts].to_vec(),
            sampled: order[..sizes.sampled_prompts].to_vec(),
            long: long[..sizes.long_prompts].to_vec(),
            prompts,
        })
    }

    /// Tokens asked of prompt `i` in `batch`: its own `max_tokens`, capped by the batch's.
    pub fn max_tokens_of(&self, batch: &Batch, i: usize) -> u32 {
        self.prompts[i].max_tokens.min(batch.max_tokens)
    }

    /// The batches of repetition `rep` for `mode`, one group per gateway, in the order they run.
    /// The first gateway runs everything without link delay, the long prompts first (so they meet
    /// a fresh gateway in every repetition); each RTT > 0 and the drift case have a gateway of their own.
    pub fn gateways(&self, rep: u32, mode: Mode) -> Vec<Vec<Batch>> {
        let batch = |kind, rtt_ms, temperature, prompts: &Vec<usize>| {
            let max_tokens = if matches!(kind, Kind::Timing | Kind::Drift) {
                self.long_max_tokens
            } else {
                self.max_tokens
            };
            Batch {
                rep,
                mode,
                kind,
                rtt_ms,
                drift_to_ms: None,
                temperature,
                max_tokens,
                prompts: prompts.clone(),
            }
        };
        let mut first = Vec::new();
        if self.rtts_ms.contains(&0) {
            first.push(batch(Kind::Timing, 0, 0.0, &self.long));
        }
        if rep == 0 && !self.accounting.is_empty() {
            first.push(batch(Kind::Accounting, 0, 0.0, &self.accounting));
        }
        if !self.sampled.is_empty() {
            first.push(batch(Kind::Sampled, 0, self.temperature, &self.sampled));
        }
        let mut out = vec![first];
        // The draft model alone has no link.
        if mode.uses_verifier() {
            out.extend(
                self.rtts_ms
                    .iter()
                    .filter(|&&rtt| rtt > 0)
                    .map(|&rtt| vec![batch(Kind::Timing, rtt, 0.0, &self.long)]),
            );
            if let Some(d) = self.drift {
                out.push(vec![Batch {
                    drift_to_ms: Some(d.to_ms),
                    ..batch(Kind::Drift, d.from_ms, 0.0, &self.long)
                }]);
            }
        }
        out.retain(|g| !g.is_empty());
        out
    }

    /// Every gateway of repetition `rep` in the order they start, with its mode and its index among the
    /// mode's [`Plan::gateways`]: link by link (a gateway index is one link for every mode), so that
    /// the modes compared at a link meet the host at the same time ([`Plan::links`]); the host's speed
    /// moved 7-33% over the 3-4 minutes between `auto`'s batch and d=4's when a repetition ran each mode
    /// at every link in turn (docs/benchmarks.md, "Dec 3, four texts"). Odd repetitions reverse the
    /// modes after the first (target-only), so the turns of [`turns`] differ between repetitions.
    pub fn schedule(&self, rep: u32) -> Vec<(Mode, usize, Vec<Batch>)> {
        let mut modes = self.modes.clone();
        if rep % 2 == 1 && modes.len() > 1 {
            modes[1..].reverse();
        }
        let mut gateways: Vec<(Mode, usize, Vec<Batch>)> = modes
            .iter()
            .flat_map(|&mode| {
                self.gateways(rep, mode)
                    .into_iter()
                    .enumerate()
                    .map(move |(n, batches)| (mode, n, batches))
            })
            .collect();
        gateways.sort_by_key(|&(_, n, _)| n);
        gateways
    }

    /// [`Plan::schedule`] cut into links: the gateways of one link (one per mode) are up together, and
    /// their timed batches (the long prompts) take turns prompt by prompt ([`turns`]), so that every
    /// mode meets the host within seconds of the others on every prompt. Run mode after mode, the
    /// modes of a link were a minute or more apart, and the host's speed moved by more than the 5%
    /// `auto` is held to in that time.
    pub fn links(&self, rep: u32) -> Vec<Vec<(Mode, usize, Vec<Batch>)>> {
        let mut links: Vec<Vec<(Mode, usize, Vec<Batch>)>> = Vec::new();
        for gateway in self.schedule(rep) {
            match links.last_mut() {
                Some(link) if link[0].1 == gateway.1 => link.push(gateway),
                _ => links.push(vec![gateway]),
            }
        }
        links
    }

    /// Seconds the whole plan should take on the machine this was written on (2 cores, servers
    /// pinned one core each): a rough model, for the ETA printed at the start and refined as
    /// batches finish.
    pub fn estimate_seconds(&self) -> f64 {
        let (starts, by_kind) = self.estimate_parts();
        starts + by_kind.iter().map(|(_, s)| s).sum::<f64>()
    }

    /// The estimate split into starting servers and each kind of batch.
    pub fn estimate_parts(&self) -> (f64, [(Kind, f64); 4]) {
        let mut starts = VERIFIER_START_S;
        let mut by_kind = [
            (Kind::Accounting, 0.0),
            (Kind::Sampled, 0.0),
            (Kind::Timing, 0.0),
            (Kind::Drift, 0.0),
        ];
        for rep in 0..self.reps {
            for (_, _, batches) in self.schedule(rep) {
                starts += GATEWAY_START_S;
                for b in &batches {
                    if let Some(slot) = by_kind.iter_mut().find(|(k, _)| *k == b.kind) {
                        slot.1 += self.estimate_batch(b);
                    }
                }
            }
        }
        (starts, by_kind)
    }

    pub fn estimate_batch(&self, b: &Batch) -> f64 {
        // Drift: half the output at each RTT.
        let rtt_s = (b.rtt_ms + b.drift_to_ms.unwrap_or(b.rtt_ms)) as f64 / 2000.0;
        b.prompts.iter().map(|&i| estimate_request(b.mode, self.max_tokens_of(b, i), rtt_s)).sum()
    }
}

/// Measured on the 2-core development machine (Qwen2.5-Coder 0.5B drafting for 1.5B, one core
/// each): loading the target, and starting (and stopping) a gateway with the draft model.
pub const VERIFIER_START_S: f64 = 6.0;
pub const GATEWAY_START_S: f64 = 4.5;

/// Rough seconds for one request of `tokens` tokens, fitted to a `--quick` run on the development
/// machine with the servers pinned to a core each (2026-12-01): about 3 s before the first token in
/// every mode (both models process the prompt, in parallel), then per token (target-only: 68 ms a
/// forward pass) or per verify round (speculative: a block of d drafts costs the verifier about
/// 38 ms more per draft on one core, and the drafting not hidden under the verify call), plus one
/// RTT per verify call. Rounds assume a per-token acceptance of 0.8 (0.6–0.9 measured on this
/// pair); `auto` is costed as d=4.
pub fn estimate_request(mode: Mode, tokens: u32, rtt_s: f64) -> f64 {
    const FIRST_S: f64 = 3.0;
    const VERIFY_S: f64 = 0.068;
    const VERIFY_PER_DRAFT_S: f64 = 0.038;
    const DRAFT_S: f64 = 0.05;
    let tokens = f64::from(tokens);
    let speculative = |d: f64, ahead: bool| {
        let alpha = 0.8_f64;
        let per_round = (1.0 - alpha.powf(d + 1.0)) / (1.0 - alpha);
        let verify = VERIFY_S + VERIFY_PER_DRAFT_S * d + rtt_s;
        let draft = DRAFT_S * d;
        // Drafting ahead hides most of the next block's drafting under this block's verify call.
        let exposed = if ahead { (draft - 0.6 * verify).max(0.3 * draft) } else { draft };
        FIRST_S + (tokens / per_round) * (verify + exposed)
    };
    match mode {
        Mode::TargetOnly => FIRST_S + tokens * (VERIFY_S + rtt_s),
        Mode::DraftOnly => 2.5 + tokens * DRAFT_S * 1.4,
        Mode::Speculative(d) => speculative(f64::from(d), true),
        Mode::NoAhead(d) => speculative(f64::from(d), false),
        Mode::Auto => speculative(4.0, true),
    }
}

/// The order in which the `gateways` of a link run their `k`-th timed prompt in repetition `rep`:
/// [`Plan::schedule`]'s order rotated by one for every prompt and repetition, so that each mode runs
/// first, second, … equally often, and no mode is always the one after a cold start or after the
/// slowest mode.
pub fn turns(rep: u32, k: usize, gateways: usize) -> Vec<usize> {
    (0..gateways).map(|i| (i + k + rep as usize) % gateways).collect()
}

/// Prompt indices taking one of each category in turn (code, chat, summarization, qa, code, …), so
/// any prefix of the order covers the categories evenly.
pub fn interleave_categories(prompts: &[Prompt]) -> Vec<usize> {
    let by_category: Vec<Vec<usize>> = Category::ALL
        .iter()
        .map(|c| {
            prompts.iter().enumerate().filter(|(_, p)| p.category == *c).map(|(i, _)| i).collect()
        })
        .collect();
    let longest = by_category.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|k| by_category.iter().filter_map(move |list| list.get(k).copied()))
        .collect()
}

#[cfg(test)]
mod tests;
