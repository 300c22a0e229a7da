//! The multi-turn agent benchmark (`spade-agent-bench`): what a coding agent's conversation costs
//! turn by turn.
//!
//! Agents resend the whole conversation every turn, so without a prefix cache the target prefills
//! the entire, ever longer context again on every turn: the cost of a conversation grows with the
//! square of its length. With the verifier's prefix cache, turn k+1 prefills only what is new since
//! turn k (its user message, and whatever of the last answer the cache does not hold). The benchmark
//! runs one fixed conversation ([`conversation`]) in each [`AgentMode`] and records, per turn, what
//! the client sees (tokens, cached tokens, time to first token, total time) and what the cloud spends
//! (the verifier's CPU seconds and prompt positions computed).
//!
//! Pieces: [`conversation`] (the scenario and each turn's request), [`stream`] (one streamed turn and
//! the usage fields it reports), [`run`] (the stacks and the turn loop), [`report`] (results.md). This
//! file holds the modes, the plan and its time estimate, the per-turn record, and the figures and
//! checks computed from the records.

pub mod conversation;
pub mod report;
pub mod run;
pub mod stream;

use std::fmt;

use serde::Serialize;

use conversation::Conversation;

/// How one mode's stack decodes, and whether its verifier keeps a prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AgentMode {
    /// Gateway `--draft-len auto` against a verifier with its prefix cache on (the default).
    Speculative,
    /// Gateway `--draft-len 0` against a verifier with `--prefix-cache false`: today's behaviour, the
    /// baseline every other mode is compared with.
    TargetOnly,
    /// Gateway `--draft-len 0` with the verifier's prefix cache on: what the cache alone buys.
    TargetOnlyCached,
}

impl AgentMode {
    /// The gateway's arguments for this mode.
    pub fn gateway_args(self) -> Vec<String> {
        let draft_len = if self == AgentMode::Speculative { "auto" } else { "0" };
        vec!["--draft-len".into(), draft_len.into()]
    }

    /// The verifier's `--prefix-cache` setting for this mode.
    pub fn prefix_cache(self) -> bool {
        self != AgentMode::TargetOnly
    }

    /// Whether the gateway drafts (only then does the draft model's own prompt cache matter).
    pub fn drafts(self) -> bool {
        self == AgentMode::Speculative
    }

    /// Short column label in the tables.
    pub fn label(self) -> &'static str {
        match self {
            AgentMode::Speculative => "spec",
            AgentMode::TargetOnly => "target",
            AgentMode::TargetOnlyCached => "target+cache",
        }
    }
}

impl fmt::Display for AgentMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AgentMode::Speculative => "speculative",
            AgentMode::TargetOnly => "target-only",
            AgentMode::TargetOnlyCached => "target-only-cached",
        })
    }
}

/// What a run does: every mode's conversation at every RTT, `turns` user turns of
/// `max_tokens` each. At one RTT the modes' stacks are all up and take turns turn by turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentPlan {
    pub modes: Vec<AgentMode>,
    pub rtts_ms: Vec<u64>,
    pub turns: usize,
    pub max_tokens: u32,
}

/// Rough speeds on the 2-core development machine, one pinned core per side, from a smoke run
/// (2 turns of 1,410 and 1,462 prompt tokens): the 1.5B target's prompt processing (~28 tokens/s:
/// 50 CPU-s for 1,410) and the 0.5B draft's (the speculative first turn's TTFT was 23 s longer than
/// target-only's: the gateway prefills its draft before the first verify call brings the prompt to
/// the verifier, so the two add up); target-only's time per token, speculative's per committed token
/// (verify blocks at ~2.5 tokens per call); and starting one mode's stack (the verifier timing its
/// passes at start-up, then a gateway).
const TARGET_PREFILL_TOK_S: f64 = 28.0;
const DRAFT_PREFILL_TOK_S: f64 = 60.0;
const TARGET_ONLY_TOKEN_S: f64 = 0.07;
const SPECULATIVE_TOKEN_S: f64 = 0.1;
const TOKENS_PER_VERIFY_CALL: f64 = 2.5;
const STACK_START_S: f64 = 16.0;

impl AgentPlan {
    /// Refuses plans that cannot run: no modes or RTTs, 0 turns or more than the conversation has,
    /// 0 tokens per turn, no target-only baseline.
    pub fn new(
        modes: Vec<AgentMode>,
        mut rtts_ms: Vec<u64>,
        turns: usize,
        max_tokens: u32,
        conversation: &Conversation,
    ) -> Result<Self, String> {
        rtts_ms.sort_unstable();
        rtts_ms.dedup();
        if rtts_ms.is_empty() {
            return Err("--rtts: at least one RTT".into());
        }
        if turns == 0 || turns > conversation.turns.len() {
            return Err(format!(
                "--turns must be 1..={} (the conversation's user turns)",
                conversation.turns.len()
            ));
        }
        if max_tokens == 0 {
            return Err("--max-tokens must be at least 1".into());
        }
        if !modes.contains(&AgentMode::TargetOnly) {
            return Err("target-only is the baseline: it must run".into());
        }
        Ok(Self { modes, rtts_ms, turns, max_tokens })
    }

    /// Seconds the plan should take (a rough model; prompt sizes from characters, every answer
    /// `max_tokens` long). Target-only without a cache prefills the whole prompt every turn; with a
    /// cache a turn prefills what is new since the last one, and speculative's draft model likewise
    /// before it.
    pub fn estimate_seconds(&self, conversation: &Conversation) -> f64 {
        let prompts: Vec<f64> = (0..self.turns)
            .map(|t| conversation.approx_prompt_tokens(t, self.max_tokens) as f64)
            .collect();
        let answer = f64::from(self.max_tokens);
        let mut total = 0.0;
        for &rtt_ms in &self.rtts_ms {
            let rtt_s = rtt_ms as f64 / 1000.0;
            for &mode in &self.modes {
                total += STACK_START_S;
                for (t, &prompt) in prompts.iter().enumerate() {
                    let new =
                        if mode.prefix_cache() && t > 0 { prompt - prompts[t - 1] } else { prompt };
                    total += match mode {
                        AgentMode::Speculative => {
                            new / DRAFT_PREFILL_TOK_S
                                + new / TARGET_PREFILL_TOK_S
                                + answer * (SPECULATIVE_TOKEN_S + rtt_s / TOKENS_PER_VERIFY_CALL)
                        }
                        _ => new / TARGET_PREFILL_TOK_S + answer * (TARGET_ONLY_TOKEN_S + rtt_s),
                    };
                }
            }
        }
        total
    }
}

/// One turn of one mode's conversation at one RTT.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnRecord {
    pub rtt_ms: u64,
    pub mode: AgentMode,
    /// 1-based.
    pub turn: usize,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the target did not recompute
    /// (`None`: the gateway did not report it).
    pub cached_tokens: Option<u64>,
    /// Context positions the draft model computed over the turn (the gateway's
    /// `spade_gateway_draft_context_tokens_computed_total`): its prefill of what its prefix cache
    /// did not hold, at each round's start.
    pub draft_computed: Option<f64>,
    pub completion_tokens: u64,
    pub verify_calls: u64,
    /// The gateway answered without its verifier (the figures are then not the stack's).
    pub degraded: bool,
    /// Seconds to the first SSE chunk with content (the whole request when none had any).
    pub ttft_s: f64,
    pub total_s: f64,
    /// The verifier process's CPU seconds during this turn.
    pub verifier_cpu_s: f64,
    /// Deltas of the verifier's prompt-position counters over the turn (`None`: it has no such counter).
    pub verifier_prompt_computed: Option<f64>,
    pub verifier_prompt_cached: Option<f64>,
    /// The answer, sent back as the assistant message of the mode's later turns.
    pub text: String,
}

/// One mode's whole conversation at one RTT.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModeTotals {
    pub mode: AgentMode,
    pub rtt_ms: u64,
    pub turns: usize,
    pub total_s: f64,
    pub verifier_cpu_s: f64,
    pub prompt_tokens: u64,
    /// `None` when any turn lacks the figure: a partial sum would read as a measurement.
    pub cached_tokens: Option<u64>,
    pub verifier_prompt_computed: Option<f64>,
    pub completion_tokens: u64,
}

/// The records of one mode at one RTT, in turn order.
pub fn turns_of(records: &[TurnRecord], rtt_ms: u64, mode: AgentMode) -> Vec<&TurnRecord> {
    let mut out: Vec<&TurnRecord> =
        records.iter().filter(|r| r.rtt_ms == rtt_ms && r.mode == mode).collect();
    out.sort_by_key(|r| r.turn);
    out
}

/// Sums of one mode's conversation at one RTT; `None` when it has no turn there.
pub fn totals(records: &[TurnRecord], rtt_ms: u64, mode: AgentMode) -> Option<ModeTotals> {
    let turns = turns_of(records, rtt_ms, mode);
    if turns.is_empty() {
        return None;
    }
    Some(ModeTotals {
        mode,
        rtt_ms,
        turns: turns.len(),
        total_s: turns.iter().map(|r| r.total_s).sum(),
        verifier_cpu_s: turns.iter().map(|r| r.verifier_cpu_s).sum(),
        prompt_tokens: turns.iter().map(|r| r.prompt_tokens).sum(),
        cached_tokens: turns.iter().map(|r| r.cached_tokens).sum(),
        verifier_prompt_computed: turns.iter().map(|r| r.verifier_prompt_computed).sum(),
        completion_tokens: turns.iter().map(|r| r.completion_tokens).sum(),
    })
}

/// `a / b`, or `None` when `b` is not positive (a ratio to nothing is no measurement).
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

/// Whole-conversation comparison of `mode` with target-only at one RTT: target-only's total time
/// over the mode's (how many times faster it is), and the mode's verifier CPU seconds over
/// target-only's (its share of the cloud's cost). `None` unless both played the same turns.
pub fn versus_target_only(
    records: &[TurnRecord],
    rtt_ms: u64,
    mode: AgentMode,
) -> (Option<f64>, Option<f64>) {
    match (totals(records, rtt_ms, mode), totals(records, rtt_ms, AgentMode::TargetOnly)) {
        (Some(m), Some(base)) if m.turns == base.turns => {
            (ratio(base.total_s, m.total_s), ratio(m.verifier_cpu_s, base.verifier_cpu_s))
        }
        _ => (None, None),
    }
}

/// Per turn at one RTT: whether `mode`'s answer equals target-only's (greedy decoding must be
/// lossless, cache or not); `None` where either is missing.
pub fn same_answers(
    records: &[TurnRecord],
    rtt_ms: u64,
    mode: AgentMode,
) -> Vec<(usize, Option<bool>)> {
    let base = turns_of(records, rtt_ms, AgentMode::TargetOnly);
    let other = turns_of(records, rtt_ms, mode);
    let last = base.iter().chain(&other).map(|r| r.turn).max().unwrap_or(0);
    (1..=last)
        .map(|turn| {
            let text =
                |list: &[&TurnRecord]| list.iter().find(|r| r.turn == turn).map(|r| r.text.clone());
            (turn, text(&base).zip(text(&other)).map(|(a, b)| a == b))
        })
        .collect()
}

/// Whether any mode's answer differs from target-only's anywhere in the run.
pub fn any_answer_differs(records: &[TurnRecord], plan: &AgentPlan) -> bool {
    plan.rtts_ms.iter().any(|&rtt| {
        plan.modes
            .iter()
            .any(|&m| same_answers(records, rtt, m).iter().any(|(_, same)| *same == Some(false)))
    })
}

/// One of the goals the benchmark judges, as measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub rtt_ms: u64,
    pub measured: String,
    pub goal: &'static str,
    /// `None`: not measurable in this run (too few turns, a figure not reported, an RTT not run).
    pub pass: Option<bool>,
}

/// The RTT at which the whole-conversation speed-up is judged.
pub const SPEEDUP_RTT_MS: u64 = 50;
const MIN_CACHED_SHARE: f64 = 0.9;
const MAX_TTFT_GROWTH: f64 = 1.5;
const MIN_SPEEDUP: f64 = 3.0;
const MAX_CPU_SHARE: f64 = 0.35;

/// The goals, at every RTT of the plan (the speed-up at [`SPEEDUP_RTT_MS`] only), all judged on the
/// speculative mode against target-only.
pub fn checks(records: &[TurnRecord], plan: &AgentPlan) -> Vec<Check> {
    let mut out = Vec::new();
    for &rtt_ms in &plan.rtts_ms {
        let spec = turns_of(records, rtt_ms, AgentMode::Speculative);
        let later = spec.iter().filter(|r| r.turn >= 2);
        let shares: Option<Vec<f64>> = later
            .map(|r| r.cached_tokens.map(|c| c as f64 / r.prompt_tokens.max(1) as f64))
            .collect();
        let (measured, pass) = match shares {
            _ if spec.len() < 2 => ("needs 2 turns".to_string(), None),
            None => ("cached_tokens not reported".to_string(), None),
            Some(s) => {
                let lowest = s.iter().copied().fold(f64::INFINITY, f64::min);
                (format!("lowest {:.1}%", 100.0 * lowest), Some(lowest >= MIN_CACHED_SHARE))
            }
        };
        out.push(Check {
            name: "cached_tokens from turn 2 on",
            rtt_ms,
            measured,
            goal: ">= 90% of prompt tokens",
            pass,
        });

        let growth = match (spec.first(), spec.last()) {
            (Some(first), Some(last)) if spec.len() >= 2 => ratio(last.ttft_s, first.ttft_s),
            _ => None,
        };
        out.push(Check {
            name: "last turn's TTFT vs the first's",
            rtt_ms,
            measured: growth.map_or("needs 2 turns".into(), |g| format!("{g:.2}x")),
            goal: "<= 1.5x",
            pass: growth.map(|g| g <= MAX_TTFT_GROWTH),
        });

        let (speedup, cpu_share) = versus_target_only(records, rtt_ms, AgentMode::Speculative);
        if rtt_ms == SPEEDUP_RTT_MS {
            out.push(Check {
                name: "whole conversation, target-only time / speculative",
                rtt_ms,
                measured: speedup.map_or("not measured".into(), |s| format!("{s:.2}x")),
                goal: ">= 3x",
                pass: speedup.map(|s| s >= MIN_SPEEDUP),
            });
        }
        out.push(Check {
            name: "verifier CPU-s per conversation, speculative / target-only",
            rtt_ms,
            measured: cpu_share.map_or("not measured".into(), |s| format!("{s:.3}")),
            goal: "<= 0.35",
            pass: cpu_share.map(|s| s <= MAX_CPU_SHARE),
        });

        let compared: Vec<Option<bool>> = same_answers(records, rtt_ms, AgentMode::Speculative)
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        let differing = compared.iter().filter(|s| **s == Some(false)).count();
        let known = compared.iter().filter(|s| s.is_some()).count();
        out.push(Check {
            name: "speculative answers identical to target-only's",
            rtt_ms,
            measured: format!("{} of {known} turns identical", known - differing),
            goal: "every turn",
            pass: (known > 0).then_some(differing == 0),
        });
    }
    if !plan.rtts_ms.contains(&SPEEDUP_RTT_MS) {
        let name = "whole conversation, target-only time / speculative";
        out.push(Check {
            name,
            rtt_ms: SPEEDUP_RTT_MS,
            measured: "RTT 50 not in --rtts".into(),
            goal: ">= 3x",
            pass: None,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turn at RTT 50 ms; `times`: TTFT, total and verifier CPU seconds.
    fn record(
        mode: AgentMode,
        turn: usize,
        prompt: u64,
        cached: Option<u64>,
        times: (f64, f64, f64),
        text: &str,
    ) -> TurnRecord {
        let (ttft_s, total_s, cpu_s) = times;
        TurnRecord {
            rtt_ms: 50,
            mode,
            turn,
            prompt_tokens: prompt,
            cached_tokens: cached,
            draft_computed: None,
            completion_tokens: 48,
            verify_calls: 0,
            degraded: false,
            ttft_s,
            total_s,
            verifier_cpu_s: cpu_s,
            verifier_prompt_computed: None,
            verifier_prompt_cached: None,
            text: text.into(),
        }
    }

    /// Speculative 4x faster with a fifth of the CPU and warm caches; target-only recomputes.
    fn run() -> Vec<TurnRecord> {
        use AgentMode::*;
        vec![
            record(TargetOnly, 2, 1200, Some(0), (40.0, 48.0, 45.0), "b"),
            record(TargetOnly, 1, 1000, Some(0), (30.0, 32.0, 35.0), "a"),
            record(Speculative, 1, 1000, Some(0), (10.0, 14.0, 12.0), "a"),
            record(Speculative, 2, 1200, Some(1100), (2.0, 6.0, 4.0), "b"),
        ]
    }

    fn plan(rtts_ms: Vec<u64>) -> AgentPlan {
        AgentPlan {
            modes: vec![AgentMode::Speculative, AgentMode::TargetOnly],
            rtts_ms,
            turns: 2,
            max_tokens: 48,
        }
    }

    #[test]
    fn modes_map_to_gateway_and_verifier_flags() {
        assert_eq!(AgentMode::Speculative.gateway_args(), ["--draft-len", "auto"]);
        assert_eq!(AgentMode::TargetOnly.gateway_args(), ["--draft-len", "0"]);
        assert_eq!(AgentMode::TargetOnlyCached.gateway_args(), ["--draft-len", "0"]);
        assert!(
            AgentMode::Speculative.prefix_cache()
                && AgentMode::TargetOnlyCached.prefix_cache()
                && !AgentMode::TargetOnly.prefix_cache()
        );
        assert_eq!(AgentMode::TargetOnlyCached.to_string(), "target-only-cached");
        assert_eq!(
            serde_json::to_value(AgentMode::TargetOnlyCached).unwrap(),
            "target-only-cached"
        );
    }

    #[test]
    fn totals_sum_a_conversation_and_refuse_partial_sums() {
        let mut records = run();
        let spec = totals(&records, 50, AgentMode::Speculative).unwrap();
        assert_eq!(
            (spec.turns, spec.total_s, spec.verifier_cpu_s, spec.prompt_tokens, spec.cached_tokens),
            (2, 20.0, 16.0, 2200, Some(1100))
        );
        assert_eq!(spec.verifier_prompt_computed, None);
        assert!(totals(&records, 0, AgentMode::Speculative).is_none());
        records[3].cached_tokens = None;
        assert_eq!(totals(&records, 50, AgentMode::Speculative).unwrap().cached_tokens, None);
    }

    #[test]
    fn ratios_compare_whole_conversations() {
        let (speedup, cpu) = versus_target_only(&run(), 50, AgentMode::Speculative);
        assert_eq!(speedup, Some(80.0 / 20.0));
        assert_eq!(cpu, Some(16.0 / 80.0));
        assert_eq!(ratio(1.0, 0.0), None);
        // A conversation cut short in one mode is not compared with a whole one.
        let short: Vec<TurnRecord> = run()
            .into_iter()
            .filter(|r| !(r.mode == AgentMode::Speculative && r.turn == 2))
            .collect();
        assert_eq!(versus_target_only(&short, 50, AgentMode::Speculative), (None, None));
        assert_eq!(versus_target_only(&run(), 50, AgentMode::TargetOnly), (Some(1.0), Some(1.0)));
    }

    #[test]
    fn checks_pass_on_a_good_run() {
        let checks = checks(&run(), &plan(vec![50]));
        let results: Vec<(&str, Option<bool>)> = checks.iter().map(|c| (c.name, c.pass)).collect();
        assert_eq!(results.len(), 5);
        assert!(results.iter().all(|(_, pass)| *pass == Some(true)), "{checks:#?}");
        assert_eq!(checks[0].measured, "lowest 91.7%");
        assert_eq!(checks[1].measured, "0.20x");
        assert_eq!(checks[2].measured, "4.00x");
        assert_eq!(checks[3].measured, "0.200");
    }

    #[test]
    fn checks_fail_or_abstain_as_measured() {
        let mut records = run();
        records[3].cached_tokens = Some(1000); // 83%
        records[3].ttft_s = 20.0; // 2x the first turn's
        records[3].text = "c".into();
        let checks = checks(&records, &plan(vec![0, 50]));
        let at50: Vec<Option<bool>> =
            checks.iter().filter(|c| c.rtt_ms == 50).map(|c| c.pass).collect();
        assert_eq!(at50, [Some(false), Some(false), Some(true), Some(true), Some(false)]);
        // RTT 0 was planned but not measured: nothing passes or fails there.
        assert!(checks.iter().filter(|c| c.rtt_ms == 0).all(|c| c.pass.is_none()), "{checks:#?}");
        records[3].cached_tokens = None;
        assert_eq!(
            super::checks(&records, &plan(vec![50]))[0].measured,
            "cached_tokens not reported"
        );
        // Without RTT 50 the speed-up goal is listed as not measured.
        let without = super::checks(&run(), &plan(vec![0]));
        assert_eq!(without.last().map(|c| (c.rtt_ms, c.pass)), Some((50, None)));
    }

    #[test]
    fn answers_are_compared_turn_by_turn() {
        let mut records = run();
        assert_eq!(
            same_answers(&records, 50, AgentMode::Speculative),
            [(1, Some(true)), (2, Some(true))]
        );
        assert!(!any_answer_differs(&records, &plan(vec![50])));
        records[2].text = "other".into();
        assert_eq!(
            same_answers(&records, 50, AgentMode::Speculative),
            [(1, Some(false)), (2, Some(true))]
        );
        assert!(any_answer_differs(&records, &plan(vec![50])));
        records.pop();
        assert_eq!(same_answers(&records, 50, AgentMode::Speculative)[1], (2, None));
    }

    #[test]
    fn plans_are_checked_and_estimated() {
        let conversation = Conversation::built_in();
        let modes = vec![AgentMode::Speculative, AgentMode::TargetOnly];
        let plan = AgentPlan::new(modes.clone(), vec![50, 0, 50], 8, 48, &conversation).unwrap();
        assert_eq!(plan.rtts_ms, [0, 50]);
        assert!(AgentPlan::new(modes.clone(), vec![0], 0, 48, &conversation).is_err());
        assert!(AgentPlan::new(
            modes.clone(),
            vec![0],
            conversation.turns.len() + 1,
            48,
            &conversation
        )
        .is_err());
        assert!(AgentPlan::new(modes.clone(), vec![], 2, 48, &conversation).is_err());
        assert!(AgentPlan::new(modes.clone(), vec![0], 2, 0, &conversation).is_err());
        assert!(
            AgentPlan::new(vec![AgentMode::Speculative], vec![0], 2, 48, &conversation).is_err()
        );
        // Without a cache every turn prefills everything: target-only dominates the estimate.
        let only =
            |mode| AgentPlan { modes: vec![mode], ..plan.clone() }.estimate_seconds(&conversation);
        assert!(only(AgentMode::TargetOnly) > 2.0 * only(AgentMode::Speculative));
        assert!(only(AgentMode::TargetOnly) > only(AgentMode::TargetOnlyCached));
        let short = AgentPlan { turns: 2, ..plan.clone() };
        assert!(short.estimate_seconds(&conversation) < plan.estimate_seconds(&conversation));
    }
}
