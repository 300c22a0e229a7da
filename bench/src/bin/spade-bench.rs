//! spade-bench: the end-to-end benchmark. Starts the real stack on loopback (spade-verifier, a
//! spade-gateway per mode, a delay proxy between them), runs the prompt set in target-only,
//! draft-only and speculative modes, and writes results.json and results.md into a results folder.
//! Exits 1 when a greedy speculative output differs from target-only's (the system must be
//! lossless), 2 when the run itself failed (what was measured is still written).
//!
//! The default sizes fit the whole run in under 30 minutes on the 2-core development machine: see
//! `Args` for why each is what it is, and `--dry-run` for the plan and its estimate. What sizes a run
//! is the number of requests, not their length: on 2 cores a speculative request spends most of its
//! 6–10 s before the first token (both models process the prompt), a target-only one about 3 s.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use spade_bench::machine::{utc_stamp, Machine};
use spade_bench::plan::{Plan, Sizes};
use spade_bench::report::{self, Context as ReportContext};
use spade_bench::runner::{Runner, Setup};
use spade_bench::summary::{summarise, BatchResult, Summary};
use spade_bench::{load_prompts, PROMPTS_PATH};

#[derive(Debug, Parser)]
#[command(
    name = "spade-bench",
    version,
    about = "End-to-end SPADE benchmark: cloud calls saved, losslessness, speed, and the network's effect",
    after_help = "Default paths are relative to the working directory: run it from the repository root (scripts/bench.sh does)."
)]
struct Args {
    /// Speculative draft lengths: short, the gateway's default, long. Each one costs about 5
    /// minutes of the default run on 2 cores (mostly its 30 accounting requests), so 1,2,4,6,8
    /// takes ~35 minutes.
    #[arg(long, env = "SPADE_BENCH_DRAFT_LENS", value_delimiter = ',', default_value = "1,4,8")]
    draft_lens: Vec<u32>,

    /// Prompts for the accounting figures and the greedy losslessness check (greedy, run once:
    /// greedy outputs are deterministic, so repetitions would repeat them). 30 covers the four
    /// categories 8/8/7/7.
    #[arg(long, env = "SPADE_BENCH_PROMPTS", default_value_t = 30)]
    prompts: usize,

    /// Most tokens per request (each prompt's own max_tokens caps it too). 24 spans several verify
    /// rounds at every draft length; going to 16 would save only ~10% of the run (see above).
    #[arg(long, env = "SPADE_BENCH_MAX_TOKENS", default_value_t = 24)]
    max_tokens: u32,

    /// Prompts run at the sampled temperature in every repetition (seeded; a new seed per
    /// repetition, so 2 x 3 = 6 samples per mode: enough for the timing medians, a rough
    /// acceptance figure).
    #[arg(long, env = "SPADE_BENCH_SAMPLED_PROMPTS", default_value_t = 2)]
    sampled_prompts: usize,

    /// Prompts timed at every RTT in every repetition (the first accounting prompts, code first:
    /// the pair is a coding model). One prompt x 3 reps x 4 RTTs x 5 modes is ~6 minutes; each
    /// more doubles it.
    #[arg(long, env = "SPADE_BENCH_TIMING_PROMPTS", default_value_t = 1)]
    timing_prompts: usize,

    /// Repetitions; timing figures are their median.
    #[arg(long, env = "SPADE_BENCH_REPS", default_value_t = 3)]
    reps: u32,

    /// Emulated round-trip times between gateway and verifier, milliseconds.
    #[arg(long, env = "SPADE_BENCH_RTTS_MS", value_delimiter = ',', default_value = "0,20,50,100")]
    rtts_ms: Vec<u64>,

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

    #[arg(long, env = "SPADE_BENCH_DRAFT_MODEL", default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]
    draft_model: String,

    #[arg(long, env = "SPADE_BENCH_TARGET_MODEL", default_value = "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")]
    target_model: String,

    /// The prompt set (JSON lines, see bench/PROMPTS.md).
    #[arg(long, env = "SPADE_BENCH_PROMPTS_FILE", default_value = PROMPTS_PATH)]
    prompts_file: PathBuf,

    /// Compute threads of the verifier (default: all cores).
    #[arg(long, env = "SPADE_BENCH_VERIFIER_THREADS")]
    verifier_threads: Option<usize>,

    /// Folder with spade-verifier and spade-gateway (default: next to this binary).
    #[arg(long, env = "SPADE_BENCH_BIN_DIR")]
    bin_dir: Option<PathBuf>,

    /// Results folder (default: bench/results/<UTC timestamp>).
    #[arg(long, env = "SPADE_BENCH_OUT")]
    out: Option<PathBuf>,

    /// Print the plan and its time estimate, then exit.
    #[arg(long)]
    dry_run: bool,

    /// The command line to state in the report (scripts/bench.sh sets it to its own).
    #[arg(long, env = "SPADE_BENCH_COMMAND", hide = true)]
    reported_command: Option<String>,
}

impl Args {
    fn sizes(&self) -> Sizes {
        Sizes {
            draft_lens: self.draft_lens.clone(),
            accounting_prompts: self.prompts,
            sampled_prompts: self.sampled_prompts,
            timing_prompts: self.timing_prompts,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            reps: self.reps,
            rtts_ms: self.rtts_ms.clone(),
        }
    }

    fn command(&self) -> String {
        self.reported_command
            .as_deref()
            .map(str::trim)
            .map(String::from)
            .unwrap_or_else(|| std::env::args().map(|a| shell_quote(&a)).collect::<Vec<_>>().join(" "))
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// A model's file name: the report states which weights ran, not where this machine keeps them.
fn file_name(path: &str) -> &str {
    Path::new(path).file_name().and_then(|f| f.to_str()).unwrap_or(path)
}

/// The commit measured, and whether the working tree differed from it.
fn git_state() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git").args(args).output().ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match (git(&["rev-parse", "--short", "HEAD"]), git(&["status", "--porcelain", "--untracked-files=no"])) {
        (Some(head), Some(changes)) if !changes.is_empty() => format!("git {head} with uncommitted changes"),
        (Some(head), _) => format!("git {head}"),
        _ => "unknown (not a git checkout)".into(),
    }
}

fn print_plan(plan: &Plan) {
    let ids = |list: &[usize]| list.iter().map(|&i| plan.prompts[i].id.as_str()).collect::<Vec<_>>().join(" ");
    println!("spade-bench plan");
    println!("  modes: {}", plan.modes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "));
    println!("  accounting (greedy, RTT 0, once): {} prompts, <= {} tokens each", plan.accounting.len(), plan.max_tokens);
    println!("  sampled (T={}, RTT 0, every rep): {}", plan.temperature, ids(&plan.sampled));
    println!("  timing (greedy, RTTs {:?} ms, every rep): {}", plan.rtts_ms, ids(&plan.timing));
    println!("  repetitions: {}", plan.reps);
    let eta = plan.estimate_seconds();
    let (starts, parts) = plan.estimate_parts();
    let parts: Vec<String> = parts.iter().map(|(k, s)| format!("{k:?} {:.1}", s / 60.0)).collect();
    println!("  estimate by part, minutes: server starts {:.1}, {}", starts / 60.0, parts.join(", "));
    println!("  estimated time: {:.0} min on an idle 2-core machine (ETA {} UTC; slower when the machine is shared)", eta / 60.0, eta_clock(eta));
}

fn eta_clock(seconds: f64) -> String {
    let now = std::time::SystemTime::now() + Duration::from_secs_f64(seconds);
    let secs = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    format!("{:02}:{:02}", secs / 3600, secs / 60 % 60)
}

fn write_results(out: &Path, ctx: &ReportContext, summary: &Summary, results: &[BatchResult], error: Option<&str>) -> anyhow::Result<()> {
    let json = json!({
        "stamp": ctx.stamp,
        "command": ctx.command,
        "machine": ctx.machine,
        "source": ctx.git,
        "models": {"draft": ctx.draft_model, "target": ctx.target_model},
        "plan": {
            "modes": ctx.plan.modes.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "accounting_prompts": ctx.plan.accounting.iter().map(|&i| &ctx.plan.prompts[i].id).collect::<Vec<_>>(),
            "sampled_prompts": ctx.plan.sampled.iter().map(|&i| &ctx.plan.prompts[i].id).collect::<Vec<_>>(),
            "timing_prompts": ctx.plan.timing.iter().map(|&i| &ctx.plan.prompts[i].id).collect::<Vec<_>>(),
            "max_tokens": ctx.plan.max_tokens,
            "temperature": ctx.plan.temperature,
            "reps": ctx.plan.reps,
            "rtts_ms": ctx.plan.rtts_ms,
        },
        "wall_s": ctx.wall_s,
        "error": error,
        "summary": summary,
        "batches": results,
    });
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(&json)?)?;
    let mut md = report::render(ctx, summary);
    if let Some(e) = error {
        md = format!("**This run did not finish: {e}. The figures cover what was measured before.**\n\n{md}");
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
    print_plan(&plan);
    if args.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    for model in [&args.draft_model, &args.target_model] {
        anyhow::ensure!(Path::new(model).exists(), "{model} not found: run `bash scripts/fetch-models.sh pair`");
    }
    let stamp = utc_stamp();
    let out = args.out.clone().unwrap_or_else(|| Path::new("bench/results").join(&stamp));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?.parent().context("no folder around this binary")?.to_path_buf(),
    };
    let setup = Setup {
        bin_dir,
        draft_model: args.draft_model.clone(),
        target_model: args.target_model.clone(),
        verifier_threads: args.verifier_threads,
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
    drop(runner); // stops the verifier and the proxy
                  // The run's links to the server binaries were only needed while it ran.
    let _ = std::fs::remove_dir_all(out.join("bin"));

    let timing_ids: HashSet<String> = plan.timing.iter().map(|&i| plan.prompts[i].id.clone()).collect();
    let summary = summarise(&results, &plan.modes, &plan.rtts_ms, &timing_ids);
    let (machine, command, git) = (Machine::describe(), args.command(), git_state());
    let ctx = ReportContext {
        stamp: &stamp,
        command: &command,
        machine: &machine,
        git: &git,
        draft_model: file_name(&args.draft_model),
        target_model: file_name(&args.target_model),
        wall_s: started.elapsed().as_secs_f64(),
        plan: &plan,
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
