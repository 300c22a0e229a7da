//! The Markdown report (`results.md`): the tables a reader compares, with the machine and the exact
//! command above them, and what each column means below.

use std::fmt::Write;

use crate::machine::Machine;
use crate::plan::Plan;
use crate::stats::Spread;
use crate::summary::{ModeSummary, Summary};

/// What the report says about the run besides the figures.
pub struct Context<'a> {
    pub stamp: &'a str,
    pub command: &'a str,
    pub machine: &'a Machine,
    pub git: &'a str,
    pub draft_model: &'a str,
    pub target_model: &'a str,
    pub wall_s: f64,
    pub plan: &'a Plan,
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "—".to_string(), f)
}

fn pct(v: Option<f64>) -> String {
    opt(v, |x| format!("{:.1}%", 100.0 * x))
}

fn num(v: Option<f64>, digits: usize) -> String {
    opt(v, |x| format!("{x:.digits$}"))
}

fn spread(s: Option<Spread>, digits: usize) -> String {
    s.map_or_else(|| "—".to_string(), |s| format!("{:.digits$} [{:.digits$}–{:.digits$}]", s.median, s.min, s.max))
}

/// The greedy or sampled table.
fn modes_table(out: &mut String, rows: &[ModeSummary], greedy: bool) {
    let _ = writeln!(
        out,
        "| mode | target calls / request | calls saved vs target-only | acceptance | tokens / call | tokens/s | decode tokens/s | TTFT s | verifier CPU-s / token | edge CPU-s / token | wire bytes / token |{}",
        if greedy { " identical to target-only |" } else { "" }
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{}", if greedy { "---:|" } else { "" });
    for r in rows {
        let identity = r.identical.as_ref().map_or("(reference)".to_string(), |i| format!("{:.0}% ({}/{})", 100.0 * i.share(), i.identical, i.compared));
        let _ = writeln!(
            out,
            "| {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} |{}",
            r.label,
            r.calls_per_request,
            pct(r.calls_saved),
            pct(r.acceptance.filter(|_| r.mode.uses_verifier() && r.mode.gateway_draft_len() > 0)),
            num(r.tokens_per_call, 2),
            spread(r.timing.tokens_per_s, 2),
            spread(r.timing.decode_tokens_per_s, 1),
            spread(r.timing.ttft_s, 2),
            num(r.verifier_cpu_s_per_token, 3),
            num(r.gateway_cpu_s_per_token, 3),
            num(r.bytes_per_token, 0),
            if greedy { format!(" {identity} |") } else { String::new() }
        );
    }
}

pub fn render(ctx: &Context, s: &Summary) -> String {
    let plan = ctx.plan;
    let mut out = String::new();
    let _ = writeln!(out, "# SPADE benchmark — {}\n", ctx.stamp);
    let _ = writeln!(
        out,
        "- Machine: {} CPUs (`nproc`), {}, {:.1} GiB memory, Linux {}; no GPU. Shared with other work: timings are noisy, \
         so timing figures are medians over repetitions with [min–max].",
        ctx.machine.cpus, ctx.machine.cpu_model, ctx.machine.memory_gib, ctx.machine.kernel
    );
    let _ = writeln!(out, "- Command: `{}`", ctx.command);
    let _ = writeln!(out, "- Source: {}", ctx.git);
    let _ = writeln!(out, "- Models: draft `{}`, target `{}`", ctx.draft_model, ctx.target_model);
    let _ = writeln!(
        out,
        "- Plan: accounting on {} prompts (greedy, once); sampled T={} on {} prompts × {} reps; timing on {} prompts × {} reps per RTT; \
         at most {} tokens per request. Wall time {:.1} min.",
        plan.accounting.len(),
        plan.temperature,
        plan.sampled.len(),
        plan.reps,
        plan.timing.len(),
        plan.reps,
        plan.max_tokens,
        ctx.wall_s / 60.0
    );
    let identity: Vec<String> = s
        .greedy
        .iter()
        .filter(|m| matches!(m.mode, crate::plan::Mode::Speculative(_)))
        .filter_map(|m| m.identical.as_ref().map(|i| format!("{} {}/{}", m.label.trim_start_matches("speculative "), i.identical, i.compared)))
        .collect();
    let _ = writeln!(
        out,
        "\n**Greedy speculative output identical to target-only: {}** ({}).\n",
        if s.lossless { "100% — lossless" } else { "NO — see the greedy table" },
        identity.join(", ")
    );

    let _ = writeln!(out, "## Greedy (temperature 0), no link delay\n");
    modes_table(&mut out, &s.greedy, true);
    let _ = writeln!(out, "\n## Sampled (temperature {}, seeded), no link delay\n", plan.temperature);
    modes_table(&mut out, &s.sampled, false);

    let longest = s.greedy.iter().chain(&s.sampled).map(|m| m.acceptance_by_position.len()).max().unwrap_or(0);
    if longest > 0 {
        let _ = writeln!(out, "\n## Acceptance by draft position\n\nShare of verify calls whose first k drafts were all accepted (verifier `/metrics`).\n");
        let _ = writeln!(out, "| mode | T |{}", (1..=longest).map(|k| format!(" k={k} |")).collect::<String>());
        let _ = writeln!(out, "|---|---:|{}", "---:|".repeat(longest));
        for m in s.greedy.iter().chain(&s.sampled).filter(|m| !m.acceptance_by_position.is_empty()) {
            let cells: String = (0..longest).map(|i| format!(" {} |", num(m.acceptance_by_position.get(i).copied(), 2))).collect();
            let _ = writeln!(out, "| {} | {} |{cells}", m.label, m.temperature);
        }
    }

    let categories: Vec<String> =
        s.greedy.iter().flat_map(|m| m.acceptance_by_category.keys().cloned()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    if !categories.is_empty() {
        let _ = writeln!(out, "\n## Greedy acceptance by prompt category\n");
        let _ = writeln!(out, "| mode |{}", categories.iter().map(|c| format!(" {c} |")).collect::<String>());
        let _ = writeln!(out, "|---|{}", "---:|".repeat(categories.len()));
        for m in s.greedy.iter().filter(|m| !m.acceptance_by_category.is_empty() && matches!(m.mode, crate::plan::Mode::Speculative(_))) {
            let cells: String = categories.iter().map(|c| format!(" {} |", pct(m.acceptance_by_category.get(c).copied()))).collect();
            let _ = writeln!(out, "| {} |{cells}", m.label);
        }
    }

    let _ = writeln!(
        out,
        "\n## Emulated edge–cloud link (greedy)\n\nTokens/s, median [min–max] over {} reps of {} prompts; the link is a userspace delay proxy \
         (RTT/2 each way, no jitter or loss unless the command says so). Draft-only never touches the link.\n",
        plan.reps,
        plan.timing.len()
    );
    let _ = writeln!(out, "| mode |{}", plan.rtts_ms.iter().map(|r| format!(" RTT {r} ms |")).collect::<String>());
    let _ = writeln!(out, "|---|{}", "---:|".repeat(plan.rtts_ms.len()));
    for &mode in &plan.modes {
        let cells: String = plan
            .rtts_ms
            .iter()
            .map(|&rtt| {
                let cell = s.rtt.iter().find(|r| r.mode == mode && r.rtt_ms == rtt).map_or("—".to_string(), |r| spread(r.timing.tokens_per_s, 2));
                format!(" {cell} |")
            })
            .collect();
        let _ = writeln!(out, "| {mode} |{cells}");
    }
    let _ = writeln!(out, "\n| RTT | best draft length (tokens/s) | target-only tokens/s | speculative vs target-only | fastest lossless mode |");
    let _ = writeln!(out, "|---:|---:|---:|---:|---|");
    for b in &s.best_by_rtt {
        let speedup = b.best_speculative_tokens_per_s.zip(b.target_only_tokens_per_s).map(|(a, t)| a / t);
        let _ = writeln!(
            out,
            "| {} ms | {} | {} | {} | {} |",
            b.rtt_ms,
            b.best_draft_len.map_or("—".to_string(), |d| format!("d={d} ({})", num(b.best_speculative_tokens_per_s, 2))),
            num(b.target_only_tokens_per_s, 2),
            opt(speedup, |x| format!("{x:.2}x")),
            b.best
        );
    }

    if !s.warnings.is_empty() {
        let _ = writeln!(out, "\n## Warnings\n");
        for w in &s.warnings {
            let _ = writeln!(out, "- {w}");
        }
    }
    out.push_str(NOTES);
    out
}

const NOTES: &str = "
## What the columns mean

- **target calls / request**: verifier forward passes (`/verify` calls) per request; target-only makes one per token.
  **Calls saved** compares calls per generated token with target-only's at the same temperature (under greedy
  decoding the outputs are identical, so this is also the saving per request).
- **acceptance**: accepted draft tokens / drafted tokens (the gateway's `usage.completion_tokens_details`);
  **tokens / call**: committed tokens per verify call (accepted drafts + the verifier's own token).
- **tokens/s**: completion tokens / seconds from sending the request to `[DONE]`, per repetition over its
  requests, streamed; **TTFT**: seconds to the first non-empty text delta, mean per repetition. Both end to end at
  the client, prompt processing included. **Decode tokens/s**: tokens after the first / seconds after the first
  (the pace once both models have processed the prompt); none for draft-only, whose text arrives in one piece.
- **verifier CPU-s / token**: user+system CPU seconds of the verifier process (`/proc/PID/stat`) over the
  accounting requests, per generated token: the cloud's cost. **Edge CPU-s / token**: the same for the gateway
  (drafting). Both processes share the same 2 cores, so neither ran alone.
- **wire bytes / token**: `/verify` request and response bodies (the gateway's `usage.spade.bytes_*`), headers
  excluded. Sampled drafts carry their draft distribution q (up to `--draft-top-k` 32 entries per token).
- **identical to target-only**: share of prompts whose greedy output text equals target-only's greedy output.
- **draft-only**: the draft model alone (the gateway with no verifier and `--offline-fallback draft`, drafting
  32 tokens per step); its output is the small model's, not the target's.
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_missing_values_as_dashes() {
        assert_eq!(pct(None), "—");
        assert_eq!(pct(Some(0.756)), "75.6%");
        assert_eq!(num(Some(1.23456), 3), "1.235");
        assert_eq!(spread(Spread::of(&[1.0, 3.0, 2.0]), 1), "2.0 [1.0–3.0]");
        assert_eq!(spread(None, 1), "—");
    }
}
