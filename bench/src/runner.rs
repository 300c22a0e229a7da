//! Runs a [`Plan`] against the real stack: one verifier for the whole run behind an in-process delay
//! proxy, and fresh gateways as the plan groups the batches (a gateway's draft length is fixed at
//! start, and no gateway may see a greedy request twice; loading the 0.5B draft takes seconds, the
//! 1.5B verifier longer, so only gateways are restarted).
//!
//! Every gateway reaches the verifier through the proxy, RTT 0 included (then it only relays); the
//! proxy's link is set per batch. Requests run one at a time: on 2 cores concurrent requests were
//! slower in total, and timing must not mix requests.
//!
//! The server binaries are hard-linked (or copied) into the results folder first: other builds into
//! the same target folder during a long run must not change what is measured halfway.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::client::{stream_chat, ChatRequest};
use crate::link::LinkConfig;
use crate::machine::cpu_seconds;
use crate::plan::{Batch, Kind, Mode, Plan, GATEWAY_START_S, VERIFIER_START_S};
use crate::prom::{Scrape, VerifierCounters};
use crate::proxy::{spawn_proxy, ProxyHandle};
use crate::stack::{free_port, Ready, Server};
use crate::summary::{BatchResult, Record};

/// Where the servers and models are, and the link's extras.
#[derive(Debug, Clone)]
pub struct Setup {
    pub bin_dir: PathBuf,
    pub draft_model: String,
    pub target_model: String,
    pub verifier_threads: Option<usize>,
    pub out_dir: PathBuf,
    pub jitter: Duration,
    pub loss: f64,
    pub seed: u64,
}

/// The API key the benchmark's verifier is started with (loopback only).
const VERIFIER_KEY: &str = "spade-bench";
/// One retry per request: a single failure on a busy machine should not cost a 25-minute run.
const ATTEMPTS: usize = 2;

pub struct Runner<'a> {
    plan: &'a Plan,
    setup: &'a Setup,
    /// Where the run's own copies of the server binaries are.
    bin_dir: PathBuf,
    client: reqwest::Client,
    verifier: Server,
    proxy: ProxyHandle,
    pub results: Vec<BatchResult>,
    started: Instant,
    estimated_done: f64,
    estimated_total: f64,
}

impl<'a> Runner<'a> {
    /// Starts the verifier and the proxy in front of it.
    pub async fn start(plan: &'a Plan, setup: &'a Setup) -> anyhow::Result<Self> {
        let started = Instant::now();
        let client = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
        let port = free_port()?;
        // Every request leaves a session behind (evicted LRU): a small budget keeps the verifier's
        // memory modest on a shared machine; no session is reused across requests anyway.
        let mut args: Vec<String> =
            ["--model", &setup.target_model, "--port", &port.to_string(), "--api-key", VERIFIER_KEY, "--cache-budget-mb", "512"].map(String::from).to_vec();
        if let Some(t) = setup.verifier_threads {
            args.extend(["--threads".into(), t.to_string()]);
        }
        let bin_dir = freeze_binaries(&setup.bin_dir, &setup.out_dir)?;
        let mut verifier = Server::spawn("spade-verifier", &bin_dir.join("spade-verifier"), &args, &[], port, setup.out_dir.join("verifier.log"))?;
        let took = verifier.wait_ready(&client, Ready::Healthy).await?;
        println!("verifier ready in {:.1} s (pid {})", took.as_secs_f64(), verifier.pid());
        let link = LinkConfig { seed: Some(setup.seed), ..LinkConfig::default() };
        let proxy = spawn_proxy(format!("127.0.0.1:{port}"), link).await?;
        Ok(Self {
            plan,
            setup,
            bin_dir,
            client,
            verifier,
            proxy,
            results: Vec::new(),
            started,
            estimated_done: VERIFIER_START_S,
            estimated_total: plan.estimate_seconds(),
        })
    }

    /// Every repetition, every mode, every batch.
    pub async fn run(&mut self) -> anyhow::Result<()> {
        for rep in 0..self.plan.reps {
            for &mode in &self.plan.modes.clone() {
                for (n, batches) in self.plan.gateways(rep, mode).into_iter().enumerate() {
                    let mut gateway = self.start_gateway(mode, rep, n).await?;
                    self.estimated_done += GATEWAY_START_S;
                    for batch in batches {
                        let result = self
                            .run_batch(&gateway, &batch)
                            .await
                            .with_context(|| format!("{mode}, rep {rep}, {:?} at RTT {} ms", batch.kind, batch.rtt_ms))?;
                        self.estimated_done += self.plan.estimate_batch(&batch);
                        self.progress(&result);
                        self.results.push(result);
                    }
                    gateway.stop();
                }
            }
        }
        Ok(())
    }

    async fn start_gateway(&self, mode: Mode, rep: u32, n: usize) -> anyhow::Result<Server> {
        let port = free_port()?;
        // Draft-only: a verifier address where nothing listens, so every request is answered by the
        // draft model alone at once (no retries to wait out).
        let verifier_url = if mode.uses_verifier() { format!("http://{}", self.proxy.addr()) } else { format!("http://127.0.0.1:{}", free_port()?) };
        let mut args = vec![
            "--draft-model".into(),
            self.setup.draft_model.clone(),
            "--verifier-url".into(),
            verifier_url,
            "--port".into(),
            port.to_string(),
            "--draft-len".into(),
            mode.gateway_draft_len().to_string(),
        ];
        if !mode.uses_verifier() {
            args.extend(["--offline-fallback".into(), "draft".into(), "--verify-retries".into(), "0".into()]);
        }
        let log = self.setup.out_dir.join(format!("gateway-{}-rep{rep}-{n}.log", mode.to_string().replace(' ', "-").replace('=', "")));
        let mut gateway = Server::spawn("spade-gateway", &self.bin_dir.join("spade-gateway"), &args, &[("SPADE_VERIFIER_API_KEY", VERIFIER_KEY)], port, log)?;
        let ready = if mode.uses_verifier() { Ready::Healthy } else { Ready::DraftLoaded };
        gateway.wait_ready(&self.client, ready).await?;
        Ok(gateway)
    }

    async fn run_batch(&mut self, gateway: &Server, batch: &Batch) -> anyhow::Result<BatchResult> {
        let ms = Duration::from_millis(batch.rtt_ms);
        self.proxy.set_link(LinkConfig { rtt: ms, jitter: self.setup.jitter, loss: self.setup.loss, seed: Some(self.setup.seed) })?;
        let started = Instant::now();
        let (verifier_before, vcpu_before, gcpu_before) = (self.counters().await?, cpu_seconds(self.verifier.pid())?, cpu_seconds(gateway.pid())?);
        let mut records = Vec::with_capacity(batch.prompts.len());
        for &i in &batch.prompts {
            let prompt = &self.plan.prompts[i];
            // Seeds differ per prompt and repetition, so sampled repetitions are new samples.
            let seed = self.setup.seed + 1000 * u64::from(batch.rep) + i as u64;
            let request = ChatRequest { messages: &prompt.messages, max_tokens: self.plan.max_tokens_of(i), temperature: batch.temperature, seed };
            let mut attempt = 0;
            let outcome = loop {
                attempt += 1;
                match stream_chat(&self.client, &gateway.url, &request).await {
                    Ok(o) => break o,
                    Err(e) if attempt < ATTEMPTS => eprintln!("  {}: {e:#}; retrying", prompt.id),
                    Err(e) => return Err(e.context(format!("prompt {}", prompt.id))),
                }
            };
            records.push(Record {
                rep: batch.rep,
                mode: batch.mode,
                kind: batch.kind,
                rtt_ms: batch.rtt_ms,
                temperature: batch.temperature,
                prompt_id: prompt.id.clone(),
                category: prompt.category,
                outcome,
            });
        }
        let verifier = self.counters().await?.since(&verifier_before);
        Ok(BatchResult {
            batch: batch.clone(),
            records,
            verifier,
            verifier_cpu_s: cpu_seconds(self.verifier.pid())? - vcpu_before,
            gateway_cpu_s: cpu_seconds(gateway.pid())? - gcpu_before,
            wall_s: started.elapsed().as_secs_f64(),
        })
    }

    /// The verifier's counters now (read directly, not through the proxy: scrapes are not traffic).
    async fn counters(&self) -> anyhow::Result<VerifierCounters> {
        let text = self.client.get(format!("{}/metrics", self.verifier.url)).bearer_auth(VERIFIER_KEY).send().await?.error_for_status()?.text().await?;
        Ok(VerifierCounters::from_scrape(&Scrape::parse(&text)))
    }

    /// One line per batch, with the ETA scaled by how fast the run has gone against the estimate.
    fn progress(&self, r: &BatchResult) {
        let elapsed = self.started.elapsed().as_secs_f64();
        let pace = elapsed / self.estimated_done.max(1.0);
        let left = (self.estimated_total - self.estimated_done).max(0.0) * pace;
        let tokens: u64 = r.records.iter().map(|x| x.outcome.completion_tokens).sum();
        let calls: u64 = r.records.iter().map(|x| x.outcome.verify_calls).sum();
        let kind = match r.batch.kind {
            Kind::Accounting => "accounting".to_string(),
            Kind::Sampled => format!("T={}", r.batch.temperature),
            Kind::Timing => format!("RTT {} ms", r.batch.rtt_ms),
        };
        println!(
            "[{:>5.1} min, ~{:.1} min left] rep {} {:<18} {:<12} {:>3} req {:>5} tok {:>5} calls {:>6.2} tok/s",
            elapsed / 60.0,
            left / 60.0,
            r.batch.rep,
            r.batch.mode.to_string(),
            kind,
            r.records.len(),
            tokens,
            calls,
            tokens as f64 / r.records.iter().map(|x| x.outcome.total_s).sum::<f64>().max(1e-9)
        );
    }
}

/// Hard-links (or, across file systems, copies) spade-verifier and spade-gateway into `out/bin`.
/// Cargo replaces a rebuilt binary with a new file, so the links keep the versions of this moment.
fn freeze_binaries(from: &std::path::Path, out: &std::path::Path) -> anyhow::Result<PathBuf> {
    let dir = out.join("bin");
    std::fs::create_dir_all(&dir)?;
    for name in ["spade-verifier", "spade-gateway"] {
        let (src, dst) = (from.join(name), dir.join(name));
        if std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst).with_context(|| format!("copying {} (build the workspace first)", src.display()))?;
        }
    }
    Ok(dir)
}
