//! The Markdown report (`results.md`): the tables a reader compares, with the machine and the exact
//! command above them, and what each column means below.

use std::fmt::Write;

use crate::machine::Machine;
use crate::plan::{Plan, LONG_MIN_TOKENS};
use crate::stats::Spread;
use crate::summary::{
    Identity, ModeSummary, PerRound, SpeedRow, Summary, AUTO_TOLERANCE, SPEEDUP_GOALS,
};

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
    /// How the servers were placed (pinning, threads), one line each; warnings first.
    pub setup: &'a [String],
    /// The verifier's forward pass of one call's block by rows (entry i: i + 1 rows), in ms, at the end of the run.
    pub verifier_pass_ms: &'a [f64],
    /// The summary lines of `bench/compute-floor.sh`'s output, if the run was given one.
    pub compute_floor: Vec<String>,
}

/// The summary of `bench/compute-floor.sh`'s output: the lines after its `## summary` heading.
pub fn compute_floor_summary(text: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| !l.starts_with("## summary"));
    let heading = lines.next().map(|h| h.trim_start_matches('#').trim().to_string());
    heading
        .into_iter()
        .chain(lines.map(str::trim).filter(|l| !l.is_empty()).map(String::from))
        .collect()
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
    s.map_or_else(
        || "—".to_string(),
        |s| format!("{:.digits$} [{:.digits$}–{:.digits$}]", s.median, s.min, s.max),
    )
}

fn ms(v: f64) -> String {
    format!("{:.0}", 1000.0 * v)
}

fn check(met: bool) -> &'static str {
    if met {
        "yes"
    } else {
        "**no**"
    }
}

/// The greedy or sampled table.
fn modes_table(out: &mut String, rows: &[ModeSummary], greedy: bool) {
    let _ = writeln!(
        out,
        "| mode | target calls / request | calls saved vs target-only | acceptance | tokens / call | tokens/s | decode tokens/s | TTFT s | verifier CPU-s / token | edge CPU-s / token | wire bytes / token |{}",
        if greedy { " identical to target-only |" } else { "" }
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{}",
        if greedy { "---:|" } else { "" }
    );
    for r in rows {
        let identity = r.identical.as_ref().map_or("(reference)".to_string(), |i| {
            format!("{:.0}% ({}/{})", 100.0 * i.share(), i.identical, i.compared)
        });
        let _ = writeln!(
            out,
            "| {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} |{}",
            r.label,
            r.calls_per_request,
            pct(r.calls_saved),
            pct(r.acceptance.filter(|_| r.mode.speculates())),
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

/// Speed rows with their round breakdown; `first` names the first column (RTT, or the drift).
fn speed_table(out: &mut String, rows: &[SpeedRow], first: &dyn Fn(&SpeedRow) -> String) {
    let _ = writeln!(
        out,
        "| link | mode | tokens/s | decode tokens/s | TTFT s | tokens / call | pre-drafted used: of rounds (of drafted ahead) | \
         round ms | draft | link | verifier | other | overlap (hidden) | vs target-only | tokens / request |"
    );
    let _ =
        writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let p = r.per_round;
        let term = |f: fn(&PerRound) -> f64| p.as_ref().map_or("—".to_string(), |p| ms(f(p)));
        let ahead = r.ahead_used_per_round.map_or("—".to_string(), |x| {
            format!("{:.0}% ({})", 100.0 * x, pct(r.ahead_used_per_drafted))
        });
        let label = match r.auto_last_draft {
            Some(d) => format!("{} (last d={d:.1})", r.label),
            None => r.label.clone(),
        };
        let _ = writeln!(
            out,
            "| {} | {label} | {} | {} | {} | {} | {ahead} | {} | {} | {} | {} | {} | {} | {} | {} |",
            first(r),
            spread(r.timing.tokens_per_s, 2),
            spread(r.timing.decode_tokens_per_s, 1),
            spread(r.timing.ttft_s, 2),
            num(r.tokens_per_call, 2),
            term(|p| p.wall_s),
            term(|p| p.draft_s),
            term(|p| p.link_s),
            term(|p| p.verifier_s),
            term(|p| p.other_s),
            term(|p| p.overlap_s),
            opt(r.vs_target_only, |x| format!("{x:.2}x")),
            if r.min_tokens as f64 == r.mean_tokens { r.min_tokens.to_string() } else { format!("{:.0} (min {})", r.mean_tokens, r.min_tokens) },
        );
    }
}

/// The verifier's pass time by block rows, as multiples of one row's: what a verify round's largest term
/// is made of, beside the compute floor's figures.
fn verifier_passes(out: &mut String, pass_ms: &[f64], compute_floor: &[String]) {
    let Some(&single) = pass_ms.first().filter(|&&ms| ms > 0.0) else { return };
    let sizes: Vec<String> = pass_ms
        .iter()
        .enumerate()
        .map(|(i, ms)| format!("{} {ms:.0} ms ({:.1}x)", i + 1, ms / single))
        .collect();
    let _ = writeln!(
        out,
        "\nThe verifier's forward pass of one call's block, by rows (its `/v1/info` `pass_ms` after the run: timed at start-up, then updated by \
         every pass that scored one call alone), and as a multiple of one row's: {}. A block of d drafts is d + 1 rows. Where a block costs \
         nearly a single step per row, drafting saves calls but little verifier time, and the speed-up is bounded by the link's share of a \
         target-only step.",
        sizes.join(" · ")
    );
    match compute_floor.split_first() {
        Some((heading, lines)) => {
            let _ = writeln!(
                out,
                "\nThe compute floor beside it, run just before this benchmark (`bench/compute-floor.sh`, its output in `compute-floor.txt`): \
                 our time or rate over llama.cpp's on the same files and thread count (for `block5-time`, below 1 is faster than llama.cpp's \
                 5-token prompt pass; for rates, above 1 is faster), {heading}:\n"
            );
            for line in lines {
                let _ = writeln!(out, "- `{line}`");
            }
        }
        None => {
            let _ = writeln!(
                out,
                "The compute floor beside it (our kernels against llama.cpp on the same files and thread count) is `bash bench/compute-floor.sh` \
                 (docs/benchmarks.md); `scripts/bench.sh --compute-floor-rounds N` runs it before the benchmark and puts it here."
            );
        }
    }
}

fn drift_label(plan: &Plan) -> String {
    plan.drift.map_or("—".to_string(), |d| format!("{}→{} ms", d.from_ms, d.to_ms))
}

pub fn render(ctx: &Context, s: &Summary) -> String {
    let plan = ctx.plan;
    let mut out = String::new();
    let _ = writeln!(out, "# SPADE benchmark — {}\n", ctx.stamp);
    let _ = writeln!(
        out,
        "- Machine: {} CPUs (`nproc`), {}, {:.1} GiB memory, Linux {}; no GPU. Timing figures are medians over repetitions \
         with [min–max]; a shared machine makes them noisy.",
        ctx.machine.cpus, ctx.machine.cpu_model, ctx.machine.memory_gib, ctx.machine.kernel
    );
    let _ = writeln!(out, "- Command: `{}`", ctx.command);
    let _ = writeln!(out, "- Source: {}", ctx.git);
    let _ = writeln!(out, "- Models: draft `{}`, target `{}`", ctx.draft_model, ctx.target_model);
    for line in ctx.setup {
        let _ = writeln!(out, "- Setup: {line}");
    }
    let long: Vec<&str> = plan.long.iter().map(|&i| plan.prompts[i].id.as_str()).collect();
    let _ = writeln!(
        out,
        "- Plan: modes {}; speed on {} long prompt(s) ({}) × {} reps at RTTs {:?} ms and drift {}, at most {} tokens each; \
         accounting on {} short prompts (greedy, once) and sampled T={} on {} × {} reps, at most {} tokens. Wall time {:.1} min.",
        plan.modes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
        plan.long.len(),
        long.join(", "),
        plan.reps,
        plan.rtts_ms,
        drift_label(plan),
        plan.long_max_tokens,
        plan.accounting.len(),
        plan.temperature,
        plan.sampled.len(),
        plan.reps,
        plan.max_tokens,
        ctx.wall_s / 60.0
    );
    let identity: Vec<String> = s
        .identity
        .iter()
        .filter(|m| m.mode.speculates())
        .map(|m| {
            let t = m.total();
            format!("{} {}/{}", m.label.trim_start_matches("speculative "), t.identical, t.compared)
        })
        .collect();
    let _ = writeln!(
        out,
        "\n**Greedy speculative output identical to target-only on every request (accounting, timing, drift): {}** ({}).\n",
        if s.lossless { "100% — lossless" } else { "NO — see the identity table" },
        identity.join(", ")
    );

    if !s.auto_vs_fixed.is_empty() {
        let _ = writeln!(
            out,
            "## auto vs the best fixed draft length\n\nMedian tokens/s on the long prompts; fixed lengths draft ahead, as auto does. \
             Goal: auto within {:.0}% of the best fixed length at every RTT, and faster than every fixed length under drift. \
             Paired: auto over the best fixed length within each repetition (in one, the modes of a link take turns prompt by prompt), \
             median [min, max] over repetitions; the host's drift between repetitions moves the medians by as much as the goal.\n",
            100.0 * AUTO_TOLERANCE
        );
        let _ = writeln!(out, "| link | auto tokens/s | best fixed | its tokens/s | auto vs best | paired | every fixed length (tokens/s) | goal met |");
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---|---|");
        for a in &s.auto_vs_fixed {
            let link = a
                .drift_to_ms
                .map_or(format!("RTT {} ms", a.rtt_ms), |to| format!("drift {}→{to} ms", a.rtt_ms));
            let fixed: Vec<String> =
                a.fixed.iter().map(|(d, t)| format!("d={d}: {t:.2}")).collect();
            let _ = writeln!(
                out,
                "| {link} | {:.2} | d={} | {:.2} | {:+.1}% | {} | {} | {} |",
                a.auto_tokens_per_s,
                a.best_fixed,
                a.best_fixed_tokens_per_s,
                100.0 * a.auto_vs_best,
                a.paired_vs_best.map_or("—".into(), |p| format!(
                    "{:+.1}% [{:+.1}, {:+.1}]",
                    100.0 * p.median,
                    100.0 * p.min,
                    100.0 * p.max
                )),
                fixed.join(", "),
                check(a.met)
            );
        }
    }

    if !s.vs_target_only.is_empty() {
        let goals: Vec<String> =
            SPEEDUP_GOALS.iter().map(|(r, g)| format!("≥ {g:.1}× at {r} ms")).collect();
        let _ = writeln!(
            out,
            "\n## Speculative (draft-ahead) vs target-only\n\nMedian tokens/s on the long prompts over target-only's at the same RTT; goals {}. \
             Decode: tokens after the first over the time after it, as the same ratio. Where a goal is missed, the largest term of the fastest \
             mode's round (breakdown below) is what stops it, and the last column says what the goal would take: the round time at which the \
             fastest mode's ratio would reach it (with the same tokens per round), and the verifier's time per round within it, every other \
             term as measured. The verifier's time per round includes the first call's prompt processing, spread over the request's rounds. \
             A verifier faster at every pass would speed target-only up as well: what has to fall is a block's cost against one step's \
             (the pass times below).\n",
            goals.join(", ")
        );
        let _ = writeln!(
            out,
            "| RTT | target-only tokens/s | auto vs target-only | fastest draft-ahead mode | its ratio | decode | goal | met | largest round term | what the goal needs |"
        );
        let _ = writeln!(out, "|---:|---:|---:|---|---:|---:|---:|---|---|---|");
        for v in &s.vs_target_only {
            let needs = v.gap.map_or("—".to_string(), |g| {
                if g.verifier_can_close_it() {
                    format!(
                        "a {} ms round: verifier {} → {} ms of it",
                        ms(g.round_needed_s),
                        ms(g.verifier_s),
                        ms(g.verifier_needed_s)
                    )
                } else {
                    format!("a {} ms round: less than the other terms alone", ms(g.round_needed_s))
                }
            });
            let _ = writeln!(
                out,
                "| {} ms | {:.2} | {} | {} | {:.2}x | {} | {} | {} | {} | {needs} |",
                v.rtt_ms,
                v.target_only_tokens_per_s,
                opt(v.auto_ratio, |x| format!("{x:.2}x")),
                v.best,
                v.best_ratio,
                opt(v.decode_ratio, |x| format!("{x:.2}x")),
                opt(v.goal, |g| format!("≥ {g:.1}x")),
                v.met.map_or("—", check),
                v.dominant.as_deref().unwrap_or("—")
            );
        }
        verifier_passes(&mut out, ctx.verifier_pass_ms, &ctx.compute_floor);
    }

    let _ = writeln!(
        out,
        "\n## Speed on the long prompts through the emulated link (greedy)\n\n{} prompt(s) × {} reps, at most {} tokens; the link is a userspace delay \
         proxy (RTT/2 each way, no jitter or loss unless the command says so). Per round (ms): the request's time over its verify calls, split by the \
         gateway's `usage.spade.timing` into drafting waited for, link, verifier (the first call's includes processing the prompt), and other (gateway, \
         client); overlap is drafting hidden under verify calls, not part of the round. Pooled over repetitions.\n",
        plan.long.len(),
        plan.reps,
        plan.long_max_tokens
    );
    speed_table(&mut out, &s.speed, &|r| format!("RTT {} ms", r.rtt_ms));

    let _ = writeln!(out, "\n### Tokens/s by mode and link\n");
    let drift_col =
        plan.drift.map(|d| format!(" drift {}→{} ms |", d.from_ms, d.to_ms)).unwrap_or_default();
    let _ = writeln!(
        out,
        "| mode |{}{drift_col}",
        plan.rtts_ms.iter().map(|r| format!(" RTT {r} ms |")).collect::<String>()
    );
    let _ = writeln!(
        out,
        "|---|{}{}",
        "---:|".repeat(plan.rtts_ms.len()),
        if plan.drift.is_some() { "---:|" } else { "" }
    );
    for &mode in &plan.modes {
        let cell = |row: Option<&SpeedRow>| {
            format!(" {} |", row.map_or("—".to_string(), |r| spread(r.timing.tokens_per_s, 2)))
        };
        let cells: String = plan
            .rtts_ms
            .iter()
            .map(|&rtt| cell(s.speed.iter().find(|r| r.mode == mode && r.rtt_ms == rtt)))
            .collect();
        let drift = if plan.drift.is_some() {
            cell(s.drift.iter().find(|r| r.mode == mode))
        } else {
            String::new()
        };
        let _ = writeln!(out, "| {mode} |{cells}{drift}");
    }

    if !s.drift.is_empty() {
        let _ = writeln!(
            out,
            "\n## Drift: RTT {} mid-run\n\nThe RTT changes once the client has received half the characters of the batch's greedy output (the same \
             place of the text in every mode, inside a request); link column: where that was, median seconds into the request (share of its time).\n",
            drift_label(plan)
        );
        speed_table(&mut out, &s.drift, &|r| {
            r.switch_at_s.map_or("never switched".to_string(), |at| {
                format!("switch at {at:.1} s ({})", pct(r.switch_share).replace(".0%", "%"))
            })
        });
    }

    let _ = writeln!(out, "\n## Greedy output identical to target-only\n\nRequests whose text equals target-only's for the same prompt and length.\n");
    let _ = writeln!(out, "| mode | accounting (short) | timing (long, every RTT and rep) | drift | all | differing |");
    let _ = writeln!(out, "|---|---:|---:|---:|---|---|");
    for m in &s.identity {
        let cell = |i: &Identity| {
            if i.compared == 0 {
                "—".to_string()
            } else {
                format!("{}/{}", i.identical, i.compared)
            }
        };
        let status = if m.mode.speculates() {
            if m.lossless() {
                "identical"
            } else {
                "**DIFFERS**"
            }
        } else {
            "(not the target's output)"
        };
        let differing = m.total().differing;
        let shown = if differing.len() > 6 {
            format!("{} … ({} in all)", differing[..6].join(", "), differing.len())
        } else {
            differing.join(", ")
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {status} | {shown} |",
            m.label,
            cell(&m.accounting),
            cell(&m.timing),
            cell(&m.drift)
        );
    }

    if !s.long_outputs.is_empty() {
        let _ = writeln!(
            out,
            "\n## Long prompts' output\n\nCompletion tokens of target-only's greedy output (the fewest any mode produced where target-only did not run).\n"
        );
        let _ = writeln!(out, "| prompt | max tokens | completion tokens | ≥ {LONG_MIN_TOKENS} |");
        let _ = writeln!(out, "|---|---:|---:|---|");
        for l in &s.long_outputs {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                l.prompt_id,
                l.max_tokens,
                l.tokens,
                check(l.tokens >= u64::from(LONG_MIN_TOKENS))
            );
        }
    }

    if !s.greedy.is_empty() {
        let _ = writeln!(
            out,
            "\n## Accounting: greedy (temperature 0), short prompts, no link delay\n"
        );
        modes_table(&mut out, &s.greedy, true);
    }
    if !s.sampled.is_empty() {
        let _ = writeln!(
            out,
            "\n## Sampled (temperature {}, seeded), short prompts, no link delay\n",
            plan.temperature
        );
        modes_table(&mut out, &s.sampled, false);
    }

    let longest = s
        .greedy
        .iter()
        .chain(&s.sampled)
        .map(|m| m.acceptance_by_position.len())
        .max()
        .unwrap_or(0);
    if longest > 0 {
        let _ = writeln!(out, "\n## Acceptance by draft position\n\nShare of verify calls whose first k drafts were all accepted (verifier `/metrics`).\n");
        let _ = writeln!(
            out,
            "| mode | T |{}",
            (1..=longest).map(|k| format!(" k={k} |")).collect::<String>()
        );
        let _ = writeln!(out, "|---|---:|{}", "---:|".repeat(longest));
        for m in s.greedy.iter().chain(&s.sampled).filter(|m| !m.acceptance_by_position.is_empty())
        {
            let cells: String = (0..longest)
                .map(|i| format!(" {} |", num(m.acceptance_by_position.get(i).copied(), 2)))
                .collect();
            let _ = writeln!(out, "| {} | {} |{cells}", m.label, m.temperature);
        }
    }

    let categories: Vec<String> = s
        .greedy
        .iter()
        .flat_map(|m| m.acceptance_by_category.keys().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !categories.is_empty() {
        let _ = writeln!(out, "\n## Greedy acceptance by prompt category\n");
        let _ = writeln!(
            out,
            "| mode |{}",
            categories.iter().map(|c| format!(" {c} |")).collect::<String>()
        );
        let _ = writeln!(out, "|---|{}", "---:|".repeat(categories.len()));
        for m in
            s.greedy.iter().filter(|m| !m.acceptance_by_category.is_empty() && m.mode.speculates())
        {
            let cells: String = categories
                .iter()
                .map(|c| format!(" {} |", pct(m.acceptance_by_category.get(c).copied())))
                .collect();
            let _ = writeln!(out, "| {} |{cells}", m.label);
        }
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
  (the pace once both models have processed the prompt); none for draft-only, whose text arrives in large pieces.
- **pre-drafted used**: blocks drafted ahead (while the previous block was verified) that were sent because the
  verifier's answer confirmed the continuation they were drafted on (`usage.spade.ahead_used`), as a share of all
  verify rounds, and in brackets of the rounds that drafted ahead (`ahead_drafted`).
- **round ms**: request time per verify call. **draft**: drafting the gateway waited for (`timing.draft_s`);
  **link**: verify-call time minus the verifier's reported time (`timing.link_s`: the RTT, HTTP, serialisation);
  **verifier**: the verifier's queue and forward passes (`timing.verifier_s`; the first call's includes
  processing the prompt, about 3 s here, spread over the rounds); **draft** likewise includes the draft model's
  prompt processing where it was waited for; **other**: the rest (the gateway's own work, streaming to the
  client); **overlap**: drafting done
  while a verify call was in flight (`timing.overlap_s`), hidden, so not part of the round time.
- **auto (last d=…)**: the draft length of auto's last choice in each request (`usage.spade.auto.draft`), mean.
- **verifier CPU-s / token**: user+system CPU seconds of the verifier process (`/proc/PID/stat`) over the
  accounting requests, per generated token: the cloud's cost. **Edge CPU-s / token**: the same for the gateway
  (drafting).
- **wire bytes / token**: `/verify` request and response bodies (the gateway's `usage.spade.bytes_*`), headers
  excluded. Sampled drafts carry their draft distribution q (up to `--draft-top-k` 32 entries per token).
- **identical to target-only**: share of requests whose greedy output text equals target-only's greedy output
  for the same prompt and `max_tokens`.
- **draft-only**: the draft model alone (the gateway with no verifier and `--offline-fallback draft`, drafting
  32 tokens per step); its output is the small model's, not the target's. **no-ahead**: a fixed draft length with
  `--draft-ahead false`: what drafting ahead buys.
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
