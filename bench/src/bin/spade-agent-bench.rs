//! spade-agent-bench: what each turn of a coding agent's conversation costs, speculative decoding
//! with the verifier's prefix cache against target-only decoding without it (today's behaviour).
//!
//! Plays the committed conversation (`bench/agent-conversation.json`) turn by turn in every mode, at
//! every RTT, each mode on a stack of its own (verifier pinned to one core, gateway to another, a
//! delay proxy between them), and writes results.json and results.md into a results folder. Exits 1
//! when a mode's greedy answer differs from target-only's on any turn, 2 when the run failed (what was
//! measured is still written). See `spade_bench::agent`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use spade_bench::agent::conversation::{Conversation, CONVERSATION_PATH};
use spade_bench::agent::report::{render, ReportContext};
use spade_bench::agent::run::{freeze_binaries, AgentRun, Setup};
use spade_bench::agent::{any_answer_differs, checks, totals, AgentMode, AgentPlan};
use spade_bench::machine::{git_state, utc_stamp, Machine};
use spade_bench::pinning::{allowed_cpus, find_in_path, Pinning};
use spade_bench::stack::ModelArgs;

#[derive(Debug, Parser)]
#[command(
    name = "spade-agent-bench",
    version,
    about = "Multi-turn agent benchmark: per-turn cost of a coding agent's conversation, speculative with the verifier's prefix cache vs target-only without",
    after_help = "Default paths are relative to the working directory: run it from the repository root."
)]
struct Args {
    /// Emulated round-trip times between gateway and verifier, milliseconds.
    #[arg(long, env = "SPADE_AGENT_BENCH_RTTS_MS", value_delimiter = ',', default_value = "0,50")]
    rtts: Vec<u64>,

    /// Play only the first N user turns (default: all of them).
    #[arg(long, env = "SPADE_AGENT_BENCH_TURNS")]
    turns: Option<usize>,

    /// Most tokens per answer.
    #[arg(long, env = "SPADE_AGENT_BENCH_MAX_TOKENS", default_value_t = 48)]
    max_tokens: u32,

    /// Also run target-only with the verifier's prefix cache on: what the cache alone buys.
    #[arg(long, env = "SPADE_AGENT_BENCH_TARGET_ONLY_CACHED")]
    target_only_cached: bool,

    /// Another conversation file of the same shape (default: the committed one, compiled in).
    #[arg(long, env = "SPADE_AGENT_BENCH_CONVERSATION")]
    conversation: Option<PathBuf>,

    /// Do not pin the servers (by default every verifier runs on one CPU with --threads 1 and every
    /// gateway on another with RAYON_NUM_THREADS=1, through `taskset -c`).
    #[arg(long, env = "SPADE_AGENT_BENCH_NO_PIN")]
    no_pin: bool,

    #[command(flatten)]
    models: ModelArgs,

    /// Folder with spade-verifier and spade-gateway (default: next to this binary).
    #[arg(long, env = "SPADE_BENCH_BIN_DIR")]
    bin_dir: Option<PathBuf>,

    /// Results folder name under bench/results (default: agent-<UTC timestamp>).
    #[arg(long, env = "SPADE_AGENT_BENCH_NAME")]
    name: Option<String>,

    /// Print the plan and its time estimate, then exit.
    #[arg(long)]
    dry_run: bool,
}

impl Args {
    fn modes(&self) -> Vec<AgentMode> {
        let mut modes = vec![AgentMode::Speculative, AgentMode::TargetOnly];
        if self.target_only_cached {
            modes.push(AgentMode::TargetOnlyCached);
        }
        modes
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn print_plan(plan: &AgentPlan, conversation: &Conversation, setup: &[String]) {
    println!("spade-agent-bench plan");
    println!(
        "  conversation: {} ({} of {} user turns, {} tools)",
        conversation.id,
        plan.turns,
        conversation.turns.len(),
        conversation.tools.len()
    );
    let sizes: Vec<String> = (0..plan.turns)
        .map(|t| conversation.approx_prompt_tokens(t, plan.max_tokens).to_string())
        .collect();
    println!("  prompt tokens per turn, estimated from characters: {}", sizes.join(", "));
    println!(
        "  modes: {}",
        plan.modes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    );
    println!("  RTTs: {:?} ms; up to {} tokens per answer, greedy", plan.rtts_ms, plan.max_tokens);
    for line in setup {
        println!("  setup: {line}");
    }
    let eta = plan.estimate_seconds(conversation);
    println!(
        "  estimated time: {:.0} min on an idle 2-core machine (slower when the machine is shared)",
        eta / 60.0
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spade-agent-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let conversation = match &args.conversation {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Conversation::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => Conversation::built_in(),
    };
    let turns = args.turns.unwrap_or(conversation.turns.len());
    let plan =
        AgentPlan::new(args.modes(), args.rtts.clone(), turns, args.max_tokens, &conversation)
            .map_err(anyhow::Error::msg)?;
    let (pinning, why_not) =
        Pinning::decide(!args.no_pin, &allowed_cpus(), find_in_path("taskset"));
    let mut setup_lines = Vec::new();
    if let Some(why) = &why_not {
        if !args.no_pin {
            eprintln!("spade-agent-bench: warning: {why}");
        }
        setup_lines.push(format!("**{why}**"));
    }
    if let Some(p) = &pinning {
        setup_lines.push(format!(
            "two machines on one: verifiers on CPU {}, gateways on CPU {}, via `{} -c`",
            p.verifier_cpu,
            p.gateway_cpu,
            p.taskset.display()
        ));
    }
    print_plan(&plan, &conversation, &setup_lines);
    if args.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    args.models.ensure_present()?;
    let stamp = utc_stamp();
    let out = Path::new("bench/results")
        .join(args.name.clone().unwrap_or_else(|| format!("agent-{stamp}")));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => {
            std::env::current_exe()?.parent().context("no folder around this binary")?.to_path_buf()
        }
    };
    let setup = Setup {
        bin_dir: freeze_binaries(&bin_dir, &out)?,
        draft_model: args.models.draft_model.clone(),
        target_model: args.models.target_model.clone(),
        pinning,
        out_dir: out.clone(),
    };
    println!("results and server logs: {}", out.display());

    let started = Instant::now();
    let mut runner = AgentRun::new(&setup, &conversation, &plan)?;
    let outcome = tokio::select! {
        r = runner.run() => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    // Leaving select! dropped the run's future, and with it the servers still up.
    let error = outcome.err().map(|e| format!("{e:#}"));
    let records = std::mem::take(&mut runner.records);
    setup_lines.extend(runner.placement.iter().map(|p| format!("as run: {p}")));
    setup_lines.push(format!(
        "conversation: {}",
        args.conversation.as_ref().map_or(CONVERSATION_PATH.into(), |p| p.display().to_string())
    ));
    let _ = std::fs::remove_dir_all(out.join("bin"));

    let (machine, git) = (Machine::describe(), git_state());
    let command = std::env::args().map(|a| shell_quote(&a)).collect::<Vec<_>>().join(" ");
    let ctx = ReportContext {
        stamp: &stamp,
        command: &command,
        git: &git,
        machine: &machine,
        draft_model: args.models.draft_file(),
        target_model: args.models.target_file(),
        setup: &setup_lines,
        conversation: &conversation,
        plan: &plan,
        wall_s: started.elapsed().as_secs_f64(),
        error: error.as_deref(),
    };
    let all_totals: Vec<_> = plan
        .rtts_ms
        .iter()
        .flat_map(|&rtt| plan.modes.iter().map(move |&m| (rtt, m)))
        .filter_map(|(rtt, m)| totals(&records, rtt, m))
        .collect();
    let json = json!({
        "stamp": stamp,
        "command": command,
        "machine": machine,
        "setup": setup_lines,
        "source": git,
        "models": {"draft": ctx.draft_model, "target": ctx.target_model},
        "conversation": {"id": conversation.id, "turns": conversation.turns.len()},
        "plan": plan,
        "wall_s": ctx.wall_s,
        "error": error,
        "checks": checks(&records, &plan),
        "totals": all_totals,
        "turns": records,
    });
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(&json)?)?;
    let md = render(&ctx, &records);
    std::fs::write(out.join("results.md"), &md)?;
    println!("\n{md}");
    println!("results: {}", out.display());
    if let Some(e) = error {
        eprintln!("spade-agent-bench: the run failed: {e}");
        return Ok(ExitCode::from(2));
    }
    if any_answer_differs(&records, &plan) {
        eprintln!("spade-agent-bench: a greedy answer differs from target-only's: not lossless");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_flags() {
        let args = Args::try_parse_from(["spade-agent-bench"]).unwrap();
        assert_eq!(
            (args.rtts.as_slice(), args.max_tokens, args.turns, args.modes()),
            (&[0, 50][..], 48, None, vec![AgentMode::Speculative, AgentMode::TargetOnly])
        );
        let args = Args::try_parse_from([
            "spade-agent-bench",
            "--rtts",
            "0,20",
            "--turns",
            "2",
            "--max-tokens",
            "8",
            "--target-only-cached",
        ])
        .unwrap();
        assert_eq!((args.rtts.as_slice(), args.turns, args.max_tokens), (&[0, 20][..], Some(2), 8));
        assert_eq!(args.modes().last(), Some(&AgentMode::TargetOnlyCached));
        assert_eq!(shell_quote("--rtts"), "--rtts");
        assert_eq!(shell_quote("a b"), "'a b'");
    }
}
