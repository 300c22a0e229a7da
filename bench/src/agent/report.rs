//! results.md of the agent benchmark: the goals as measured, then per RTT a table of the turns (every
//! mode side by side) and the whole conversation's totals, then how the run was set up.

use std::fmt::Write;

use super::conversation::Conversation;
use super::{
    checks, same_answers, totals, turns_of, versus_target_only, AgentMode, AgentPlan, TurnRecord,
};
use crate::machine::Machine;

/// What the report states besides the records.
#[derive(Debug, Clone)]
pub struct ReportContext<'a> {
    pub stamp: &'a str,
    pub command: &'a str,
    pub git: &'a str,
    pub machine: &'a Machine,
    pub draft_model: &'a str,
    pub target_model: &'a str,
    /// Placement and pinning, one line each.
    pub setup: &'a [String],
    pub conversation: &'a Conversation,
    pub plan: &'a AgentPlan,
    pub wall_s: f64,
    /// Why the run stopped early, if it did.
    pub error: Option<&'a str>,
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "—".into(), |v| v.to_string())
}

fn times(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.2}x"))
}

/// One row of cells.
fn row(cells: &[String]) -> String {
    format!("| {} |\n", cells.join(" | "))
}

/// A table's header and its separator line.
fn header(names: &[String]) -> String {
    format!("{}|{}\n", row(names), "---|".repeat(names.len()))
}

pub fn render(ctx: &ReportContext, records: &[TurnRecord]) -> String {
    let plan = ctx.plan;
    let mut md = String::from("# SPADE multi-turn agent benchmark\n\n");
    if let Some(e) = ctx.error {
        let _ = writeln!(
            md,
            "**This run did not finish: {e}. The figures cover what was measured before.**\n"
        );
    }
    let modes: Vec<String> =
        plan.modes.iter().map(|m| format!("`{m}` ({})", describe(*m))).collect();
    let _ = writeln!(
        md,
        "Conversation `{}`: {} of its {} user turns, up to {} tokens per answer, greedy, streamed. Every turn resends the whole \
         conversation (system prompt, {} tools, every earlier message with the mode's own answers). Modes: {}. RTTs {:?} ms through \
         the delay proxy between gateway and verifier; a fresh stack per mode and RTT; the modes take turns turn by turn.\n",
        ctx.conversation.id,
        plan.turns,
        ctx.conversation.turns.len(),
        plan.max_tokens,
        ctx.conversation.tools.len(),
        modes.join("; "),
        plan.rtts_ms
    );

    md.push_str("## Goals\n\n");
    md.push_str(&header(&[
        "check".into(),
        "RTT ms".into(),
        "measured".into(),
        "goal".into(),
        "result".into(),
    ]));
    for c in checks(records, plan) {
        let result = match c.pass {
            Some(true) => "met".to_string(),
            Some(false) => "**not met**".to_string(),
            None => "—".to_string(),
        };
        md.push_str(&row(&[
            c.name.into(),
            c.rtt_ms.to_string(),
            c.measured,
            c.goal.into(),
            result,
        ]));
    }
    md.push_str("\n`cached` is `usage.prompt_tokens_details.cached_tokens` (prompt tokens the target did not recompute), as the gateway reports it.\n");

    for &rtt_ms in &plan.rtts_ms {
        let _ = writeln!(md, "\n## RTT {rtt_ms} ms\n");
        md.push_str(&turn_table(records, plan, rtt_ms));
        md.push('\n');
        md.push_str(&totals_table(records, plan, rtt_ms));
    }

    md.push_str("\n## Setup\n\n");
    let _ = writeln!(md, "- models: draft `{}`, target `{}`", ctx.draft_model, ctx.target_model);
    let m = ctx.machine;
    let _ = writeln!(
        md,
        "- machine: {} CPUs, {}, {:.1} GiB, kernel {}",
        m.cpus, m.cpu_model, m.memory_gib, m.kernel
    );
    for line in ctx.setup {
        let _ = writeln!(md, "- {line}");
    }
    let _ =
        writeln!(md, "- source: {}; run {} UTC, {:.1} min", ctx.git, ctx.stamp, ctx.wall_s / 60.0);
    let _ = writeln!(md, "- command: `{}`", ctx.command);
    md
}

/// What a mode runs, in words.
fn describe(mode: AgentMode) -> &'static str {
    match mode {
        AgentMode::Speculative => "gateway `--draft-len auto`, verifier prefix cache on",
        AgentMode::TargetOnly => {
            "gateway `--draft-len 0`, verifier `--prefix-cache false`: today's behaviour"
        }
        AgentMode::TargetOnlyCached => "gateway `--draft-len 0`, verifier prefix cache on",
    }
}

/// Turns as rows, each mode's figures side by side, then whether each other mode's answer equals
/// target-only's.
fn turn_table(records: &[TurnRecord], plan: &AgentPlan, rtt_ms: u64) -> String {
    let mut names = vec!["turn".to_string()];
    for &m in &plan.modes {
        let l = m.label();
        names.extend([format!("{l} prompt"), format!("{l} cached")]);
        if m.drafts() {
            names.push(format!("{l} draft computed"));
        }
        names.extend([
            format!("{l} TTFT s"),
            format!("{l} total s"),
            format!("{l} verifier CPU s"),
            format!("{l} verifier computed"),
        ]);
    }
    let others: Vec<AgentMode> =
        plan.modes.iter().copied().filter(|&m| m != AgentMode::TargetOnly).collect();
    names.extend(others.iter().map(|m| format!("{} = target", m.label())));
    let mut out = header(&names);
    let sames: Vec<Vec<(usize, Option<bool>)>> =
        others.iter().map(|&m| same_answers(records, rtt_ms, m)).collect();
    for turn in 1..=plan.turns {
        let mut cells = vec![turn.to_string()];
        for &m in &plan.modes {
            let r = turns_of(records, rtt_ms, m).into_iter().find(|r| r.turn == turn);
            let width = if m.drafts() { 7 } else { 6 };
            let Some(r) = r else {
                cells.extend(std::iter::repeat_n("—".to_string(), width));
                continue;
            };
            cells.extend([r.prompt_tokens.to_string(), or_dash(r.cached_tokens)]);
            if m.drafts() {
                cells.push(or_dash(r.draft_computed.map(|c| format!("{c:.0}"))));
            }
            let computed = r.verifier_prompt_computed.map(|c| format!("{c:.0}"));
            cells.extend([
                format!("{:.2}", r.ttft_s),
                format!("{:.2}", r.total_s),
                format!("{:.2}", r.verifier_cpu_s),
                or_dash(computed),
            ]);
        }
        for same in &sames {
            let cell = match same.iter().find(|(t, _)| *t == turn).and_then(|(_, s)| *s) {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "—",
            };
            cells.push(cell.into());
        }
        out.push_str(&row(&cells));
    }
    if sames.iter().flatten().any(|(_, s)| *s == Some(false)) {
        out.push_str("\nAfter a turn whose answer differs, that mode's later turns carry a different conversation.\n");
    }
    out
}

/// Each mode's whole conversation, and how it compares with target-only's.
fn totals_table(records: &[TurnRecord], plan: &AgentPlan, rtt_ms: u64) -> String {
    let names = [
        "mode",
        "turns",
        "total s",
        "verifier CPU s",
        "prompt tokens",
        "cached",
        "verifier computed",
        "completion tokens",
        "target-only time / mode's",
        "verifier CPU vs target-only",
    ];
    let mut out = String::from("Whole conversation:\n\n");
    out.push_str(&header(&names.map(String::from)));
    for &m in &plan.modes {
        let Some(t) = totals(records, rtt_ms, m) else { continue };
        let (speedup, cpu_share) = versus_target_only(records, rtt_ms, m);
        out.push_str(&row(&[
            m.to_string(),
            t.turns.to_string(),
            format!("{:.1}", t.total_s),
            format!("{:.1}", t.verifier_cpu_s),
            t.prompt_tokens.to_string(),
            or_dash(t.cached_tokens),
            or_dash(t.verifier_prompt_computed.map(|c| format!("{c:.0}"))),
            t.completion_tokens.to_string(),
            times(speedup),
            or_dash(cpu_share.map(|s| format!("{s:.3}"))),
        ]));
    }
    let (speedup, cpu_share) = versus_target_only(records, rtt_ms, AgentMode::Speculative);
    if let (Some(s), Some(c)) = (speedup, cpu_share) {
        let _ = writeln!(out, "\nSpeculative with the prefix cache: the conversation took target-only's time / {s:.2}, and {c:.3}x its verifier CPU-seconds.");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(mode: AgentMode, turn: usize, text: &str) -> TurnRecord {
        let spec = mode == AgentMode::Speculative;
        TurnRecord {
            rtt_ms: 50,
            mode,
            turn,
            prompt_tokens: 1000 * turn as u64,
            cached_tokens: Some(if spec && turn > 1 { 950 * turn as u64 } else { 0 }),
            draft_computed: spec.then_some(0.0),
            completion_tokens: 48,
            verify_calls: if spec { 16 } else { 48 },
            degraded: false,
            ttft_s: if spec { 2.0 } else { 20.0 * turn as f64 },
            total_s: if spec { 6.0 } else { 25.0 * turn as f64 },
            verifier_cpu_s: if spec { 3.0 } else { 24.0 * turn as f64 },
            verifier_prompt_computed: None,
            verifier_prompt_cached: None,
            text: text.into(),
        }
    }

    fn render_with(records: &[TurnRecord], error: Option<&str>) -> String {
        let conversation = Conversation::built_in();
        let plan = AgentPlan {
            modes: vec![AgentMode::Speculative, AgentMode::TargetOnly],
            rtts_ms: vec![50],
            turns: 2,
            max_tokens: 48,
        };
        let machine = Machine {
            cpus: 2,
            cpu_model: "Test CPU".into(),
            memory_gib: 8.0,
            kernel: "6.1".into(),
        };
        let setup = ["verifiers: CPUs 0".to_string()];
        let ctx = ReportContext {
            stamp: "20270101T000000Z",
            command: "spade-agent-bench --turns 2",
            git: "git abc",
            machine: &machine,
            draft_model: "draft.gguf",
            target_model: "target.gguf",
            setup: &setup,
            conversation: &conversation,
            plan: &plan,
            wall_s: 120.0,
            error,
        };
        render(&ctx, records)
    }

    #[test]
    fn renders_goals_turns_and_totals() {
        use AgentMode::*;
        let records = [
            record(Speculative, 1, "a"),
            record(TargetOnly, 1, "a"),
            record(Speculative, 2, "b"),
            record(TargetOnly, 2, "b"),
        ];
        let md = render_with(&records, None);
        assert!(md.starts_with("# SPADE multi-turn agent benchmark\n\nConversation `shopkeeper-inventory`: 2 of its"), "{md}");
        assert!(md.contains("| cached_tokens from turn 2 on | 50 | lowest 95.0% | >= 90% of prompt tokens | met |"), "{md}");
        assert!(
            md.contains(
                "| whole conversation, target-only time / speculative | 50 | 6.25x | >= 3x | met |"
            ),
            "{md}"
        );
        // Header: turn, spec's 7 columns, target's 6, one identity column.
        assert!(
            md.contains("| turn | spec prompt | spec cached | spec draft computed | spec TTFT s |")
        );
        assert!(md.contains("| target verifier computed | spec = target |\n|---|"));
        assert!(md.contains("| 2 | 2000 | 1900 | 0 | 2.00 | 6.00 | 3.00 | — | 2000 | 0 | 40.00 | 50.00 | 48.00 | — | yes |"), "{md}");
        assert!(
            md.contains("| speculative | 2 | 12.0 | 6.0 | 3000 | 1900 | — | 96 | 6.25x | 0.083 |"),
            "{md}"
        );
        assert!(
            md.contains("| target-only | 2 | 75.0 | 72.0 | 3000 | 0 | — | 96 | 1.00x | 1.000 |"),
            "{md}"
        );
        assert!(md.contains(
            "the conversation took target-only's time / 6.25, and 0.083x its verifier CPU-seconds"
        ));
        assert!(md.contains("- command: `spade-agent-bench --turns 2`"));
        assert!(!md.contains("did not finish") && !md.contains("**no**"));
    }

    #[test]
    fn marks_differences_missing_turns_and_failures() {
        use AgentMode::*;
        let records =
            [record(Speculative, 1, "a"), record(TargetOnly, 1, "x"), record(TargetOnly, 2, "b")];
        let md = render_with(&records, Some("interrupted"));
        assert!(md.contains("**This run did not finish: interrupted."));
        assert!(md.contains("| 1 | 1000 | 0 | 0 | 2.00 |"), "{md}");
        assert!(md.ends_with("`spade-agent-bench --turns 2`\n"));
        assert!(md.contains("| **no** |\n"), "{md}");
        assert!(md.contains("| 2 | — | — | — | — | — | — | — | 2000 |"), "{md}");
        assert!(md.contains("later turns carry a different conversation"));
        assert!(md.contains("| speculative answers identical to target-only's | 50 | 0 of 1 turns identical | every turn | **not met** |"), "{md}");
        // A conversation cut short is not compared with a whole one.
        assert!(md.contains("| speculative | 1 | 6.0 | 3.0 | 1000 | 0 | — | 48 | — | — |"), "{md}");
    }
}
