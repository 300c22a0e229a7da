//! spade-bench: the end-to-end benchmark. Starts the real stack on loopback (spade-verifier, a
//! spade-gateway per mode, a delay proxy between them), runs the prompt set in target-only,
//! draft-only and speculative modes, and writes results.json and results.md into a results folder.
//! Exits 1 when a greedy speculative output differs from target-only's (the system must be
//! lossless), 2 when the run itself failed (what was measured is still written).
//!
//! Two machines are emulated on one: the verifier pinned to one core and the gateways to another,
//! one compute thread each (see `spade_bench::pinning`), talking through an in-process delay proxy.
//! `--dry-run` prints the plan and its time estimate; `--quick` is a run of under 10 minutes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use spade_bench::machine::{git_state, utc_stamp, Machine};
use spade_bench::pinning::{allowed_cpus, find_in_path, Pinning};
use spade_bench::plan::{Drift, Plan, Sizes};
use spade_bench::report::{self, Context as ReportContext};
use spade_bench::runner::{Runner, Setup};
use spade_bench::stack::ModelArgs;
use spade_bench::summary::{summarise, BatchResult, Summary};
use spade_bench::{load_prompts, PROMPTS_PATH};

#[derive(Debug, Parser)]
#[command(
    name = "spade-bench",
    version,
    about = "End-to-end SPADE benchmark: cloud calls saved, losslessness, speed, and the network's effect",
    after_help = "Default paths are relative to the working directory: run it from the repository root (scripts/bench.sh does). \
                  Sizes marked [quick: …] take that value under --quick unless given."
)]
struct Args {
    /// A run that finishes in under 10 minutes on 2 cores: 1 repetition, RTTs 0,50,100, d=1,4 and auto
    /// (no draft-only, no no-ahead mode), 3 accounting prompts, no sampled ones, the long prompt at 128
    /// tokens, and the drift case. Options given explicitly still win.
    #[arg(long, env = "SPADE_BENCH_QUICK")]
    quick: bool,

    /// Fixed draft lengths, drafting ahead (the gateway's default). [default: 1,4,8; quick: 1,4]
    #[arg(long, env = "SPADE_BENCH_DRAFT_LENS", value_parser = parse_list)]
    draft_lens: Option<List>,

    /// Fixed draft lengths run again with --draft-ahead false, to show what drafting ahead buys;
    /// `none` for none. [default: 4; quick: none]
    #[arg(long, env = "SPADE_BENCH_NO_AHEAD_LENS", value_parser = parse_list)]
    no_ahead_lens: Option<List>,

    /// Run `--draft-len auto` (draft-ahead on).
    #[arg(long, env = "SPADE_BENCH_AUTO", action = clap::ArgAction::Set, default_value_t = true)]
    auto: bool,

    /// auto's cap (the gateway's --max-draft-len).
    #[arg(long, env = "SPADE_BENCH_AUTO_MAX_DRAFT_LEN", default_value_t = 8)]
    auto_max_draft_len: u32,

    /// Run the draft model alone (no verifier). [default: true; quick: false]
    #[arg(long, env = "SPADE_BENCH_DRAFT_ONLY", action = clap::ArgAction::Set)]
    draft_only: Option<bool>,

    /// Short prompts for the accounting figures and the greedy losslessness check (greedy, run once:
    /// greedy outputs are deterministic, so repetitions would repeat them). 30 covers the four
    /// categories 8/8/7/7; 0 skips accounting. [default: 30; quick: 3]
    #[arg(long, env = "SPADE_BENCH_PROMPTS")]
    prompts: Option<usize>,

    /// Most tokens per short request (each prompt's own max_tokens caps it too): enough for several
    /// verify rounds at every draft length.
    #[arg(long, env = "SPADE_BENCH_MAX_TOKENS", default_value_t = 24)]
    max_tokens: u32,

    /// Short prompts run at the sampled temperature in every repetition (seeded; a new seed per
    /// repetition). [default: 2; quick: 0]
    #[arg(long, env = "SPADE_BENCH_SAMPLED_PROMPTS")]
    sampled_prompts: Option<usize>,

    /// Long prompts (max_tokens >= 128 in the prompt file) timed at every RTT and in the drift case,
    /// every repetition. Each one roughly doubles the speed part of the run.
    #[arg(long, alias = "timing-prompts", env = "SPADE_BENCH_LONG_PROMPTS", default_value_t = 1)]
    long_prompts: usize,

    /// Most tokens per long request: enough that decoding, not the first token, dominates. [default: 160; quick: 128]
    #[arg(long, env = "SPADE_BENCH_LONG_MAX_TOKENS")]
    long_max_tokens: Option<u32>,

    /// Repetitions; timing figures are their median. [default: 3; quick: 1]
    #[arg(long, env = "SPADE_BENCH_REPS")]
    reps: Option<u32>,

    /// Emulated round-trip times between gateway and verifier, milliseconds. [default: 0,20,50,100,200; quick: 0,50,100]
    #[arg(long, env = "SPADE_BENCH_RTTS_MS", value_delimiter = ',')]
    rtts_ms: Option<Vec<u64>>,

    /// The drift case, FROM,TO milliseconds: the RTT is FROM until half the batch's output has
    /// arrived, then TO; `none` to skip it.
    #[arg(long, env = "SPADE_BENCH_DRIFT_MS", default_value = "20,150", value_parser = parse_drift)]
    drift_ms: DriftArg,

    /// Do not pin the servers (by default the verifier runs on one CPU with --threads 1 and every
    /// gateway on another with RAYON_NUM_THREADS=1, through `taskset -c`).
    #[arg(long, env = "SPADE_BENCH_NO_PIN")]
    no_pin: bool,

    /// Extra one-way delay per chunk, uniform in [0, N] ms (0 = none).
    #[arg(long, env = "SPADE_BENCH_JITTER_MS", default_value_t = 0)]
    jitter_ms: u64,

    /// Share of chunks, in [0, 1], that pay a TCP retransmission timeout on the link.
    #[arg(long, env = "SPADE_BENCH_LOSS", default_value_t = 0.0)]
    loss: f64,

    /// Temperature of the sampled runs.
    #[arg(long, env = "SPADE_BENCH_TEMPERATURE", default_value_t = 0.8)]
    temperature: f64,

    /// Base seed for sampling and the link.
    #[arg(long, env = "SPADE_BENCH_SEED", default_value_t = 1234)]
    seed: u64,

    #[command(flatten)]
    models: ModelArgs,

    /// The prompt set (JSON lines, see bench/PROMPTS.md).
    #[arg(long, env = "SPADE_BENCH_PROMPTS_FILE", default_value = PROMPTS_PATH)]
    prompts_file: PathBuf,

    /// Compute threads of the verifier (default: 1 when pinned, else all cores).
    #[arg(long, env = "SPADE_BENCH_VERIFIER_THREADS")]
    verifier_threads: Option<usize>,

    /// Folder with spade-verifier and spade-gateway (default: next to this binary).
    #[arg(long, env = "SPADE_BENCH_BIN_DIR")]
    bin_dir: Option<PathBuf>,

    /// Results folder (default: bench/results/<UTC timestamp>).
    #[arg(long, env = "SPADE_BENCH_OUT")]
    out: Option<PathBuf>,

    /// The output of `bash bench/compute-floor.sh` (our kernels against llama.cpp's on the same files
    /// and thread count), run just before: its summary goes into the report beside the verifier's pass
    /// times, and the file into the results folder. scripts/bench.sh --compute-floor-rounds N runs it.
    #[arg(long, env = "SPADE_BENCH_COMPUTE_FLOOR")]
    compute_floor: Option<PathBuf>,

    /// Print the plan and its time estimate, then exit.
    #[arg(long)]
    dry_run: bool,

    /// The command line to state in the report (scripts/bench.sh sets it to its own).
    #[arg(long, env = "SPADE_BENCH_COMMAND", hide = true)]
    reported_command: Option<String>,
}

/// A list of draft lengths (`none` or empty: no lengths).
#[derive(Debug, Clone)]
struct List(Vec<u32>);

fn parse_list(s: &str) -> Result<List, String> {
    let s = s.trim();
    if s.is_empty() || s == "none" {
        return Ok(List(Vec::new()));
    }
    s.split(',')
        .map(|x| x.trim().parse::<u32>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()
        .map(List)
}

#[derive(Debug, Clone)]
struct DriftArg(Option<Drift>);

fn parse_drift(s: &str) -> Result<DriftArg, String> {
    if s.trim() == "none" {
        return Ok(DriftArg(None));
    }
    match parse_list(s)?.0[..] {
        [from, to] => Ok(DriftArg(Some(Drift { from_ms: from.into(), to_ms: to.into() }))),
        _ => Err("expected FROM,TO milliseconds (e.g. 20,150) or none".into()),
    }
}

impl Args {
    fn sizes(&self) -> Sizes {
        let q = self.quick;
        let pick = |quick: Vec<u32>, full: Vec<u32>| if q { quick } else { full };
        Sizes {
            draft_lens: self
                .draft_lens
                .clone()
                .map_or_else(|| pick(vec![1, 4], vec![1, 4, 8]), |l| l.0),
            no_ahead_lens: self
                .no_ahead_lens
                .clone()
                .map_or_else(|| pick(vec![], vec![4]), |l| l.0),
            auto: self.auto,
            draft_only: self.draft_only.unwrap_or(!q),
            auto_max_draft_len: self.auto_max_draft_len,
            accounting_prompts: self.prompts.unwrap_or(if q { 3 } else { 30 }),
            sampled_prompts: self.sampled_prompts.unwrap_or(if q { 0 } else { 2 }),
            long_prompts: self.long_prompts,
            max_tokens: self.max_tokens,
            long_max_tokens: self.long_max_tokens.unwrap_or(if q { 128 } else { 160 }),
            temperature: self.temperature,
            reps: self.reps.unwrap_or(if q { 1 } else { 3 }),
            rtts_ms: self.rtts_ms.clone().unwrap_or_else(|| {
                if q {
                    vec![0, 50, 100]
                } else {
                    vec![0, 20, 50, 100, 200]
                }
            }),
            drift: self.drift_ms.0,
        }
    }

    fn command(&self) -> String {
        self.reported_command.as_deref().map(str::trim).map(String::from).unwrap_or_else(|| {
            std::env::args().map(|a| shell_quote(&a)).collect::<Vec<_>>().join(" ")
        })
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn print_plan(plan: &Plan, setup: &[String]) {
    let ids = |list: &[usize]| {
        list.iter().map(|&i| plan.prompts[i].id.as_str()).collect::<Vec<_>>().join(" ")
    };
    println!("spade-bench plan");
    println!(
        "  modes: {}",
        plan.modes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    );
    println!(
        "  accounting (greedy, RTT 0, once): {} short prompts, <= {} tokens each",
        plan.accounting.len(),
        plan.max_tokens
    );
    println!("  sampled (T={}, RTT 0, every rep): {}", plan.temperature, ids(&plan.sampled));
    println!(
        "  timing (greedy, RTTs {:?} ms, every rep): {}, <= {} tokens each",
        plan.rtts_ms,
        ids(&plan.long),
        plan.long_max_tokens
    );
    match plan.drift {
        Some(d) => println!(
            "  drift (greedy, RTT {} ms, then {} ms from half the output on, every rep): {}",
            d.from_ms,
            d.to_ms,
            ids(&plan.long)
        ),
        None => println!("  drift: none"),
    }
    println!("  repetitions: {}", plan.reps);
    for line in setup {
        println!("  setup: {line}");
    }
    let eta = plan.estimate_seconds();
    let (starts, parts) = plan.estimate_parts();
    let parts: Vec<String> = parts
        .iter()
        .filter(|(_, s)| *s > 0.0)
        .map(|(k, s)| format!("{k:?} {:.1}", s / 60.0))
        .collect();
    println!(
        "  estimate by part, minutes: server starts {:.1}, {}",
        starts / 60.0,
        parts.join(", ")
    );
    println!("  estimated time: {:.0} min on an idle 2-core machine (ETA {} UTC; slower when the machine is shared)", eta / 60.0, eta_clock(eta));
}

fn eta_clock(seconds: f64) -> String {
    let now = std::time::SystemTime::now() + Duration::from_secs_f64(seconds);
    let secs = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    format!("{:02}:{:02}", secs / 3600, secs / 60 % 60)
}

fn write_results(
    out: &Path,
    ctx: &ReportContext,
    summary: &Summary,
    results: &[BatchResult],
    error: Option<&str>,
) -> anyhow::Result<()> {
    let json = json!({
        "stamp": ctx.stamp,
        "command": ctx.command,
        "machine": ctx.machine,
        "setup": ctx.setup,
        "source": ctx.git,
        "models": {"draft": ctx.draft_model, "target": ctx.target_model},
        "plan": {
            "modes": ctx.plan.modes.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "accounting_prompts": ctx.plan.accounting.iter().map(|&i| &ctx.plan.prompts[i].id).collect::<Vec<_>>(),
            "sampled_prompts": ctx.plan.sampled.iter().map(|&i| &ctx.plan.prompts[i].id).collect::<Vec<_>>(),
            "long_prompts": ctx.plan.long.iter().map(|&i| &ctx.plan.prompts[i].id).collect::<Vec<_>>(),
            "max_tokens": ctx.plan.max_tokens,
            "long_max_tokens": ctx.plan.long_max_tokens,
            "drift": ctx.plan.drift,
            "auto_max_draft_len": ctx.plan.auto_max_draft_len,
            "temperature": ctx.plan.temperature,
            "reps": ctx.plan.reps,
            "rtts_ms": ctx.plan.rtts_ms,
        },
        "wall_s": ctx.wall_s,
        "verifier_pass_ms": ctx.verifier_pass_ms,
        "error": error,
        "summary": summary,
        "batches": results,
    });
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(&json)?)?;
    let mut md = report::render(ctx, summary);
    if let Some(e) = error {
        md = format!(
            "**This run did not finish: {e}. The figures cover what was measured before.**\n\n{md}"
        );
    }
    std::fs::write(out.join("results.md"), md)?;
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("spade-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let prompts = load_prompts(&args.prompts_file)?;
    let plan = Plan::new(prompts, &args.sizes()).map_err(anyhow::Error::msg)?;
    anyhow::ensure!((0.0..=1.0).contains(&args.loss), "--loss must be in [0, 1]");
    let (pinning, why_not) =
        Pinning::decide(!args.no_pin, &allowed_cpus(), find_in_path("taskset"));
    let mut setup_lines = Vec::new();
    if let Some(why) = &why_not {
        if !args.no_pin {
            eprintln!("spade-bench: warning: {why}");
        }
        setup_lines.push(format!("**{why}**"));
    }
    if let Some(p) = &pinning {
        setup_lines.push(format!(
            "two machines on one: verifier on CPU {} ({}), gateways on CPU {} (RAYON_NUM_THREADS=1), via `{} -c`; \
             spade-bench itself (client, delay proxy) unpinned",
            p.verifier_cpu,
            args.verifier_threads.map_or("--threads 1".into(), |t| format!("--threads {t}")),
            p.gateway_cpu,
            p.taskset.display()
        ));
    }
    print_plan(&plan, &setup_lines);
    if args.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    args.models.ensure_present()?;
    let compute_floor = match &args.compute_floor {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading --compute-floor {}", path.display()))?,
        ),
        None => None,
    };
    let stamp = utc_stamp();
    let out = args.out.clone().unwrap_or_else(|| Path::new("bench/results").join(&stamp));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    if let Some(text) = &compute_floor {
        std::fs::write(out.join("compute-floor.txt"), text)?;
    }
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => {
            std::env::current_exe()?.parent().context("no folder around this binary")?.to_path_buf()
        }
    };
    let setup = Setup {
        bin_dir,
        draft_model: args.models.draft_model.clone(),
        target_model: args.models.target_model.clone(),
        verifier_threads: args.verifier_threads,
        pinning,
        out_dir: out.clone(),
        jitter: Duration::from_millis(args.jitter_ms),
        loss: args.loss,
        seed: args.seed,
    };
    println!("results and server logs: {}", out.display());

    let started = Instant::now();
    let mut runner = Runner::start(&plan, &setup).await?;
    let outcome = tokio::select! {
        r = runner.run() => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    let error = outcome.err().map(|e| format!("{e:#}"));
    let results = std::mem::take(&mut runner.results);
    let pass_ms = runner.verifier_pass_ms().await;
    setup_lines.extend(runner.placement.iter().map(|p| format!("as run: {p}")));
    drop(runner); // stops the verifier and the proxy
                  // The run's links to the server binaries were only needed while it ran.
    let _ = std::fs::remove_dir_all(out.join("bin"));

    let summary = summarise(&results, &plan.modes, &plan.rtts_ms, plan.drift);
    let (machine, command, git) = (Machine::describe(), args.command(), git_state());
    let ctx = ReportContext {
        stamp: &stamp,
        command: &command,
        machine: &machine,
        git: &git,
        draft_model: args.models.draft_file(),
        target_model: args.models.target_file(),
        wall_s: started.elapsed().as_secs_f64(),
        plan: &plan,
        setup: &setup_lines,
        verifier_pass_ms: &pass_ms,
        compute_floor: compute_floor
            .as_deref()
            .map(report::compute_floor_summary)
            .unwrap_or_default(),
    };
    write_results(&out, &ctx, &summary, &results, error.as_deref())?;
    println!("\n{}", std::fs::read_to_string(out.join("results.md"))?);
    println!("results: {}", out.display());
    if let Some(e) = error {
        eprintln!("spade-bench: the run failed: {e}");
        return Ok(ExitCode::from(2));
    }
    if !summary.lossless {
        eprintln!("spade-bench: greedy speculative output differs from target-only: not lossless");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(args: &[&str]) -> Sizes {
        Args::try_parse_from(["spade-bench"].iter().chain(args)).unwrap().sizes()
    }

    #[test]
    fn quick_shrinks_what_is_not_given() {
        let full = sizes(&[]);
        assert_eq!(
            (full.draft_lens, full.no_ahead_lens, full.reps, full.rtts_ms),
            (vec![1, 4, 8], vec![4], 3, vec![0, 20, 50, 100, 200])
        );
        assert_eq!(
            (full.accounting_prompts, full.sampled_prompts, full.long_max_tokens, full.draft_only),
            (30, 2, 160, true)
        );
        assert_eq!(full.drift, Some(Drift { from_ms: 20, to_ms: 150 }));
        let quick = sizes(&["--quick"]);
        assert_eq!(
            (quick.draft_lens, quick.no_ahead_lens, quick.reps, quick.rtts_ms),
            (vec![1, 4], vec![], 1, vec![0, 50, 100])
        );
        assert_eq!(
            (
                quick.accounting_prompts,
                quick.sampled_prompts,
                quick.long_max_tokens,
                quick.draft_only,
                quick.auto
            ),
            (3, 0, 128, false, true)
        );
        let given = sizes(&[
            "--quick",
            "--reps",
            "2",
            "--no-ahead-lens",
            "2,4",
            "--draft-only",
            "true",
            "--drift-ms",
            "none",
            "--auto",
            "false",
        ]);
        assert_eq!(
            (given.reps, given.no_ahead_lens, given.draft_only, given.drift, given.auto),
            (2, vec![2, 4], true, None, false)
        );
    }

    #[test]
    fn lists_and_drift_parse_or_are_refused() {
        assert_eq!(parse_list("1, 4,8").unwrap().0, vec![1, 4, 8]);
        assert!(parse_list("none").unwrap().0.is_empty());
        assert!(parse_list("1,x").is_err());
        assert_eq!(parse_drift("30,200").unwrap().0, Some(Drift { from_ms: 30, to_ms: 200 }));
        assert!(parse_drift("30").is_err());
    }
}
