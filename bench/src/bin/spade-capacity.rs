//! spade-capacity: how many edges one verifier serves, with continuous batching and one call at a
//! time (`--max-batch-sessions 1`).
//!
//! 1. Records real edges: a gateway (its own core, one thread) drafts a few greedy generations
//!    through a recording relay in front of a verifier (`spade_bench::capacity`).
//! 2. Starts a fresh verifier per mode on the same core, one thread each, and for each N replays
//!    the recorded generations from N concurrent virtual edges (each waiting its recorded gaps),
//!    against each verifier in turn.
//!
//! Reports aggregate committed tokens/s, per-edge tokens/s, verify latency p50/p99, verifier
//! CPU-seconds per committed token and RSS (the largest read as edges finish), and how many edges one verifier core serves at
//! `--min-rate` tokens/s each. Exits 1 when a replayed verdict differs from the recorded one.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use spade_bench::capacity::{replay_edge, report, CapacityPoint, Recorder, Trace};
use spade_bench::machine::{cpu_seconds, rss_mb, utc_stamp};
use spade_bench::pinning::{allowed_cpus, find_in_path, Pinning};
use spade_bench::prom::Scrape;
use spade_bench::stack::{free_port, Ready, Server};
use spade_bench::{load_prompts, PROMPTS_PATH};

const KEY: &str = "capacity-bench";

#[derive(Debug, Parser)]
#[command(
    name = "spade-capacity",
    version,
    about = "Verifier capacity: recorded edges replayed against one verifier, batched and one call at a time"
)]
struct Args {
    /// The verifier's model.
    #[arg(long, default_value = "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")]
    target_model: String,
    /// The recording gateway's draft model.
    #[arg(long, default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]
    draft_model: String,
    /// Concurrent edges to measure, comma-separated.
    #[arg(long, default_value = "1,2,4,8,16,32", value_delimiter = ',')]
    edges: Vec<usize>,
    /// Generations recorded (spread over the prompt file's categories); edge i replays number i mod this.
    #[arg(long, default_value_t = 4)]
    traces: usize,
    /// Tokens per recorded generation.
    #[arg(long, default_value_t = 48)]
    max_tokens: u32,
    /// The recording gateway's draft length.
    #[arg(long, default_value_t = 4)]
    draft_len: u32,
    /// After recording: this many concurrent streams through the recording gateway, against one
    /// stream alone (aggregate tokens/s of the whole stack); 0 skips it.
    #[arg(long, default_value_t = 32)]
    gateway_streams: usize,
    /// Tokens per request in the gateway-streams measurement.
    #[arg(long, default_value_t = 64)]
    stream_tokens: u32,
    /// The recording gateway's `--verify-timeout-secs` (its default): the verifier turns prompts
    /// away with 429 while its backlog is long, so the calls it takes finish well within it.
    #[arg(long, default_value_t = 60.0)]
    verify_timeout_secs: f64,
    /// Skip the one-call-at-a-time verifier.
    #[arg(long)]
    batched_only: bool,
    /// Per-edge rate the operator's figure asks for.
    #[arg(long, default_value_t = 10.0)]
    min_rate: f64,
    /// Run the servers unpinned.
    #[arg(long)]
    no_pin: bool,
    /// Results folder [default: bench/results/capacity-<UTC time>].
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("spade-capacity: {e:#}");
            ExitCode::from(2)
        }
    }
}

struct Stack {
    bin_dir: PathBuf,
    pinning: Option<Pinning>,
    out: PathBuf,
    client: reqwest::Client,
}

impl Stack {
    fn wrap(
        &self,
        cpu: Option<usize>,
        program: PathBuf,
        args: Vec<String>,
    ) -> (PathBuf, Vec<String>) {
        match (&self.pinning, cpu) {
            (Some(p), Some(cpu)) => p.wrap(cpu, &program, &args),
            _ => (program, args),
        }
    }

    async fn verifier(&self, model: &str, extra: &[&str], log: &str) -> anyhow::Result<Server> {
        let port = free_port()?;
        let mut args: Vec<String> = [
            "--model",
            model,
            "--port",
            &port.to_string(),
            "--api-key",
            KEY,
            "--cache-budget-mb",
            "4096",
            "--log",
            "warn",
        ]
        .map(String::from)
        .to_vec();
        if self.pinning.is_some() {
            args.extend(["--threads".into(), "1".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let (program, args) = self.wrap(
            self.pinning.as_ref().map(|p| p.verifier_cpu),
            self.bin_dir.join("spade-verifier"),
            args,
        );
        let mut server =
            Server::spawn("spade-verifier", &program, &args, &[], port, self.out.join(log))?;
        server.wait_ready(&self.client, Ready::Healthy).await?;
        Ok(server)
    }

    /// Greedy generations of `prompts` through a gateway whose verifier calls pass the recorder; then
    /// the gateway-streams measurement, if asked for (not recorded).
    async fn record(&self, args: &Args) -> anyhow::Result<(Vec<Trace>, Option<StreamsResult>)> {
        let verifier = self.verifier(&args.target_model, &[], "record-verifier.log").await?;
        let recorder = Recorder::start(verifier.url.clone()).await?;
        let port = free_port()?;
        let gateway_args: Vec<String> = [
            "--draft-model",
            &args.draft_model,
            "--verifier-url",
            &format!("http://{}", recorder.addr),
            "--port",
            &port.to_string(),
            "--draft-len",
            &args.draft_len.to_string(),
            "--verify-timeout-secs",
            &args.verify_timeout_secs.to_string(),
        ]
        .map(String::from)
        .to_vec();
        let mut env = vec![("SPADE_VERIFIER_API_KEY", KEY)];
        if self.pinning.is_some() {
            env.push(("RAYON_NUM_THREADS", "1"));
        }
        let (program, gateway_args) = self.wrap(
            self.pinning.as_ref().map(|p| p.gateway_cpu),
            self.bin_dir.join("spade-gateway"),
            gateway_args,
        );
        let mut gateway = Server::spawn(
            "spade-gateway",
            &program,
            &gateway_args,
            &env,
            port,
            self.out.join("record-gateway.log"),
        )?;
        gateway.wait_ready(&self.client, Ready::Healthy).await?;
        let prompts = load_prompts(PROMPTS_PATH)?;
        let step = (prompts.len() / args.traces.max(1)).max(1);
        for prompt in prompts.iter().step_by(step).take(args.traces) {
            let body = json!({"model": "spade", "messages": prompt.messages, "max_tokens": args.max_tokens, "temperature": 0});
            let r = self
                .client
                .post(format!("{}/v1/chat/completions", gateway.url))
                .json(&body)
                .send()
                .await?;
            let status = r.status();
            let answer: serde_json::Value = r.json().await?;
            anyhow::ensure!(status.is_success(), "recording {}: {status} {answer}", prompt.id);
            println!("recorded {}: {} tokens", prompt.id, answer["usage"]["completion_tokens"]);
        }
        let traces = recorder.traces();
        let streams = if args.gateway_streams > 0 {
            let stack = StreamStack {
                client: &self.client,
                gateway: &gateway,
                verifier: &verifier,
                prompts: &prompts,
                max_tokens: args.stream_tokens,
            };
            let one = stack.run(1).await?;
            let many = stack.run(args.gateway_streams).await?;
            Some(StreamsResult { one, many, n: args.gateway_streams })
        } else {
            None
        };
        gateway.stop();
        Ok((traces, streams))
    }
}

/// One stream alone and N at once through one gateway: (completion tokens, wall seconds, requests failed).
struct StreamsResult {
    one: StreamRun,
    many: StreamRun,
    n: usize,
}

/// One measurement of concurrent streams through the recording gateway.
#[derive(Debug, Clone, Copy)]
struct StreamRun {
    tokens: u64,
    secs: f64,
    failed: usize,
    /// CPU-seconds each process used meanwhile: which side limits the stack.
    gateway_cpu: f64,
    verifier_cpu: f64,
    /// Prompts the verifier turned away with 429 `verifier_busy` meanwhile.
    busy: f64,
}

impl StreamRun {
    fn rate(&self) -> f64 {
        self.tokens as f64 / self.secs.max(1e-9)
    }

    fn describe(&self) -> String {
        format!(
            "{:.2} tokens/s in all ({} tokens in {:.1} s, {} failed; CPU busy: gateway {:.0}%, verifier {:.0}%; {} prompts told to retry later)",
            self.rate(),
            self.tokens,
            self.secs,
            self.failed,
            100.0 * self.gateway_cpu / self.secs.max(1e-9),
            100.0 * self.verifier_cpu / self.secs.max(1e-9),
            self.busy
        )
    }
}

impl StreamsResult {
    fn describe(&self) -> String {
        format!(
            "Through one gateway (verifier batched): 1 stream {}; {} concurrent streams {}: {:.2}x one stream's.\n",
            self.one.describe(),
            self.n,
            self.many.describe(),
            self.many.rate() / self.one.rate().max(1e-9)
        )
    }
}

/// What the streams measurement sends requests through and watches.
struct StreamStack<'a> {
    client: &'a reqwest::Client,
    gateway: &'a Server,
    verifier: &'a Server,
    prompts: &'a [spade_bench::Prompt],
    max_tokens: u32,
}

impl StreamStack<'_> {
    /// `n` greedy chat requests at once (prompts in turn).
    async fn run(&self, n: usize) -> anyhow::Result<StreamRun> {
        let cpu = || -> anyhow::Result<(f64, f64)> {
            Ok((cpu_seconds(self.gateway.pid())?, cpu_seconds(self.verifier.pid())?))
        };
        let busy = || async {
            Ok::<_, anyhow::Error>(
                Scrape::parse(
                    &self
                        .client
                        .get(format!("{}/metrics", self.verifier.url))
                        .bearer_auth(KEY)
                        .send()
                        .await?
                        .text()
                        .await?,
                )
                .value("spade_verify_busy_total"),
            )
        };
        let (cpu_before, busy_before) = (cpu()?, busy().await?);
        let started = Instant::now();
        let requests: Vec<_> = (0..n)
            .map(|i| {
                let body =
                    json!({"model": "spade", "messages": self.prompts[i % self.prompts.len()].messages, "max_tokens": self.max_tokens, "temperature": 0});
                let (client, url) = (self.client.clone(), self.gateway.url.clone());
                tokio::spawn(async move {
                    let r = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.ok()?;
                    let v: serde_json::Value = r.error_for_status().ok()?.json().await.ok()?;
                    v["usage"]["completion_tokens"].as_u64()
                })
            })
            .collect();
        let (mut tokens, mut failed) = (0, 0);
        for r in requests {
            match r.await? {
                Some(t) => tokens += t,
                None => failed += 1,
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let (cpu_after, busy_after) = (cpu()?, busy().await?);
        Ok(StreamRun {
            tokens,
            secs,
            failed,
            gateway_cpu: cpu_after.0 - cpu_before.0,
            verifier_cpu: cpu_after.1 - cpu_before.1,
            busy: busy_after - busy_before,
        })
    }
}

/// N edges replaying the traces at once against `verifier`, with its CPU time and RSS.
async fn measure(
    client: &reqwest::Client,
    verifier: &Server,
    mode: &str,
    traces: &[Trace],
    n: usize,
    run: usize,
) -> anyhow::Result<CapacityPoint> {
    let pid = verifier.pid();
    let cpu_before = cpu_seconds(pid)?;
    let started = Instant::now();
    let edges: Vec<_> = (0..n)
        .map(|i| {
            let (client, url, trace) =
                (client.clone(), verifier.url.clone(), traces[i % traces.len()].clone());
            tokio::spawn(async move {
                replay_edge(&client, &url, KEY, &trace, &format!("r{run}-e{i}")).await
            })
        })
        .collect();
    // RSS is read as each edge ends (the others' sessions still held): the model's load peak,
    // which VmHWM would report, is larger than anything serving holds.
    let (mut results, mut rss) = (Vec::with_capacity(n), rss_mb(pid));
    for edge in edges {
        results.push(edge.await.context("an edge task failed")??);
        rss = rss.max(rss_mb(pid));
    }
    let wall = started.elapsed();
    Ok(CapacityPoint::of(mode, &results, wall, cpu_seconds(pid)? - cpu_before, rss))
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("bench/results/capacity-{}", utc_stamp())));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let bin_dir = std::env::current_exe()?.parent().context("the binary's folder")?.to_path_buf();
    let (pinning, why_not) =
        Pinning::decide(!args.no_pin, &allowed_cpus(), find_in_path("taskset"));
    if let Some(why) = why_not {
        println!("{why}");
    }
    let stack = Stack { bin_dir, pinning, out: out.clone(), client: reqwest::Client::new() };
    let (traces, streams) = stack.record(&args).await?;
    let streams = streams.map(|s| s.describe()).unwrap_or_default();
    print!("{streams}");
    anyhow::ensure!(!traces.is_empty(), "no verify calls were recorded");
    let calls: usize = traces.iter().map(Vec::len).sum();
    println!("recorded {} generations, {calls} verify calls", traces.len());

    let mut modes: Vec<(&str, Vec<&str>)> = vec![("batched", vec![])];
    if !args.batched_only {
        modes.push(("one at a time", vec!["--max-batch-sessions", "1"]));
    }
    // Both verifiers run side by side (the idle one sleeps) and take turns at each N, so a machine
    // that slows down during the run affects both modes alike.
    let mut verifiers = Vec::new();
    for (mode, extra) in &modes {
        verifiers.push((
            *mode,
            stack
                .verifier(
                    &args.target_model,
                    extra,
                    &format!("verifier-{}.log", mode.replace(' ', "-")),
                )
                .await?,
        ));
    }
    let mut points = Vec::new();
    let mut run = 0;
    for &n in &args.edges {
        for (mode, verifier) in &verifiers {
            run += 1;
            let point = measure(&stack.client, verifier, mode, &traces, n, run).await?;
            println!(
                "{mode:>14} N={n:>2}: {:.2} tokens/s, edge median {:.2}, p50/p99 {:.0}/{:.0} ms, {:.3} CPU-s/token, RSS {:.0} MB, {} differing",
                point.tokens_per_s,
                point.edge_tokens_per_s_median,
                point.latency_p50_ms,
                point.latency_p99_ms,
                point.verifier_cpu_s_per_token,
                point.verifier_rss_peak_mb,
                point.mismatches
            );
            points.push(point);
        }
    }
    points.sort_by(|a, b| a.mode.cmp(&b.mode).then(a.edges.cmp(&b.edges)));
    let cores = if stack.pinning.is_some() { 1 } else { allowed_cpus().len() };
    let table = report(&points, args.min_rate, cores);
    let header = format!(
        "# Verifier capacity ({})\n\n`spade-capacity {}`: {} recorded generations ({calls} calls, draft length {}, {} tokens each), verifier {}.\n\n",
        utc_stamp(),
        std::env::args().skip(1).collect::<Vec<_>>().join(" "),
        traces.len(),
        args.draft_len,
        args.max_tokens,
        if stack.pinning.is_some() { "on one core with one thread" } else { "unpinned" }
    );
    std::fs::write(out.join("capacity.md"), format!("{header}{table}\n{streams}"))?;
    std::fs::write(out.join("capacity.json"), serde_json::to_string_pretty(&points)?)?;
    println!("\n{header}{table}\n{streams}\nwritten to {}", out.display());
    Ok(points.iter().all(|p| p.mismatches == 0))
}
