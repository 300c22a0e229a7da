//! Runs a [`Plan`] against the real stack: one verifier for the whole run behind an in-process delay
//! proxy, and fresh gateways as the plan groups the batches (a gateway's draft length is fixed at
//! start, and no gateway may see a greedy request twice; loading the 0.5B draft takes seconds, the
//! 1.5B verifier longer, so only gateways are restarted).
//!
//! Every gateway reaches the verifier through the proxy, RTT 0 included (then it only relays); the
//! proxy's link is set per request. Requests run one at a time: on 2 cores concurrent requests were
//! slower in total, and timing must not mix requests. The gateways of a link are up together and take
//! turns (idle ones only wait), so the servers' counters are read around each request.
//!
//! With [`Pinning`], the verifier runs on one core with one compute thread and every gateway on
//! another with one (`taskset -c`; `--threads 1`; `RAYON_NUM_THREADS=1`): two machines emulated on one.
//!
//! The drift case changes the link halfway through a batch's output: the RTT is the batch's own
//! until the client has received half the characters the batch's prompts produced before (greedy
//! output is the same in every mode, so the change lands at the same place of the text in every
//! mode, inside a request), then `drift_to_ms`.
//!
//! The server binaries are hard-linked (or copied) into the results folder first: other builds into
//! the same target folder during a long run must not change what is measured halfway.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::client::{stream_chat, ChatRequest};
use crate::machine::cpu_seconds;
use crate::pinning::{cpus_of, Pinning};
use crate::plan::{turns, Batch, Kind, Mode, Plan, GATEWAY_START_S, VERIFIER_START_S};
use crate::prom::{Scrape, VerifierCounters};
use crate::stack::{free_port, Ready, Server};
use crate::summary::{BatchResult, DriftSwitch, Record};
use spade_delay_proxy::{spawn_proxy, LinkConfig, ProxyHandle};

/// Where the servers and models are, and the link's extras.
#[derive(Debug, Clone)]
pub struct Setup {
    pub bin_dir: PathBuf,
    pub draft_model: String,
    pub target_model: String,
    /// Compute threads of the verifier (default: 1 when pinned, else all cores).
    pub verifier_threads: Option<usize>,
    pub pinning: Option<Pinning>,
    pub out_dir: PathBuf,
    pub jitter: Duration,
    pub loss: f64,
    pub seed: u64,
}

/// The API key the benchmark's verifier is started with (loopback only).
const VERIFIER_KEY: &str = "spade-bench";
/// One retry per request: a single failure on a busy machine should not cost a 25-minute run.
const ATTEMPTS: usize = 2;

/// A batch under way: its result so far, and where its drift case stands.
struct Running {
    /// Its requests so far, and what the servers spent on them (`wall_s`: its own requests' seconds;
    /// other batches' requests may run between them).
    result: BatchResult,
    /// Drift: characters received so far, and how many switch the link.
    received: usize,
    threshold: Option<usize>,
}

pub struct Runner<'a> {
    plan: &'a Plan,
    setup: &'a Setup,
    /// Where the run's own copies of the server binaries are.
    bin_dir: PathBuf,
    client: reqwest::Client,
    verifier: Server,
    proxy: ProxyHandle,
    pub results: Vec<BatchResult>,
    /// Where the servers ran and with how many threads, as `/proc` shows it (for the report).
    pub placement: Vec<String>,
    /// Characters of each greedy output seen so far, by (prompt id, max tokens): where drift switches.
    reference_chars: HashMap<(String, u32), usize>,
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
        let mut args: Vec<String> = [
            "--model",
            &setup.target_model,
            "--port",
            &port.to_string(),
            "--api-key",
            VERIFIER_KEY,
            "--cache-budget-mb",
            "512",
        ]
        .map(String::from)
        .to_vec();
        let threads = setup.verifier_threads.or(setup.pinning.as_ref().map(|_| 1));
        let threads_env = threads.map(|t| t.to_string());
        let mut env = Vec::new();
        if let Some(t) = &threads_env {
            args.extend(["--threads".into(), t.clone()]);
            env.push(("RAYON_NUM_THREADS", t.as_str()));
        }
        let bin_dir = freeze_binaries(&setup.bin_dir, &setup.out_dir)?;
        let (program, args) = pinned(
            setup.pinning.as_ref().map(|p| p.verifier_cpu),
            setup,
            bin_dir.join("spade-verifier"),
            args,
        );
        let mut verifier = Server::spawn(
            "spade-verifier",
            &program,
            &args,
            &env,
            port,
            setup.out_dir.join("verifier.log"),
        )?;
        let took = verifier.wait_ready(&client, Ready::Healthy).await?;
        let cpus = cpus_of(verifier.pid()).unwrap_or_else(|| "?".into());
        println!(
            "verifier ready in {:.1} s (pid {}, CPUs {cpus})",
            took.as_secs_f64(),
            verifier.pid()
        );
        let placement = vec![format!(
            "verifier: CPUs {cpus} (`Cpus_allowed_list`), {}",
            threads.map_or("all cores' threads (no --threads)".to_string(), |t| format!(
                "--threads {t}"
            ))
        )];
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
            placement,
            reference_chars: HashMap::new(),
            started,
            estimated_done: VERIFIER_START_S,
            estimated_total: plan.estimate_seconds(),
        })
    }

    /// Every repetition, link by link ([`Plan::links`]): the link's gateways start together, their
    /// timed batches run prompt by prompt in [`turns`], then each gateway's other batches in order.
    pub async fn run(&mut self) -> anyhow::Result<()> {
        for rep in 0..self.plan.reps {
            for link in self.plan.links(rep) {
                let mut gateways = Vec::with_capacity(link.len());
                for (mode, n, _) in &link {
                    let gateway = self.start_gateway(*mode, rep, *n).await?;
                    if self.placement.len() == 1 {
                        let cpus = cpus_of(gateway.pid()).unwrap_or_else(|| "?".into());
                        let threads = if self.setup.pinning.is_some() {
                            "RAYON_NUM_THREADS=1"
                        } else {
                            "default threads"
                        };
                        self.placement.push(format!(
                            "gateways: CPUs {cpus} (`Cpus_allowed_list` of the first), {threads}"
                        ));
                    }
                    self.estimated_done += GATEWAY_START_S;
                    gateways.push(gateway);
                }
                let timed = |b: &&Batch| matches!(b.kind, Kind::Timing | Kind::Drift);
                let mut turn: Vec<(usize, Running)> = link
                    .iter()
                    .enumerate()
                    .flat_map(|(g, (_, _, batches))| {
                        batches.iter().filter(timed).map(move |b| (g, b))
                    })
                    .map(|(g, b)| (g, self.begin(b)))
                    .collect();
                let longest =
                    turn.iter().map(|(_, r)| r.result.batch.prompts.len()).max().unwrap_or(0);
                for k in 0..longest {
                    for i in turns(rep, k, turn.len()) {
                        let (g, running) = &mut turn[i];
                        if k < running.result.batch.prompts.len() {
                            self.run_request(&gateways[*g], running, k).await?;
                        }
                    }
                }
                for (_, running) in turn {
                    self.finish(running);
                }
                for ((_, _, batches), gateway) in link.iter().zip(&gateways) {
                    for batch in batches.iter().filter(|b| !timed(b)) {
                        let mut running = self.begin(batch);
                        for k in 0..batch.prompts.len() {
                            self.run_request(gateway, &mut running, k).await?;
                        }
                        self.finish(running);
                    }
                }
                gateways.iter_mut().for_each(Server::stop);
            }
        }
        Ok(())
    }

    async fn start_gateway(&self, mode: Mode, rep: u32, n: usize) -> anyhow::Result<Server> {
        let port = free_port()?;
        // Draft-only: a verifier address where nothing listens, so every request is answered by the
        // draft model alone at once (no retries to wait out).
        let verifier_url = if mode.uses_verifier() {
            format!("http://{}", self.proxy.addr())
        } else {
            format!("http://127.0.0.1:{}", free_port()?)
        };
        let mut args = vec![
            "--draft-model".into(),
            self.setup.draft_model.clone(),
            "--verifier-url".into(),
            verifier_url,
            "--port".into(),
            port.to_string(),
        ];
        args.extend(mode.gateway_args(self.plan.auto_max_draft_len));
        let log = self.setup.out_dir.join(format!("gateway-{}-rep{rep}-{n}.log", mode.slug()));
        let mut env = vec![("SPADE_VERIFIER_API_KEY", VERIFIER_KEY)];
        if self.setup.pinning.is_some() {
            env.push(("RAYON_NUM_THREADS", "1"));
        }
        let (program, args) = pinned(
            self.setup.pinning.as_ref().map(|p| p.gateway_cpu),
            self.setup,
            self.bin_dir.join("spade-gateway"),
            args,
        );
        let mut gateway = Server::spawn("spade-gateway", &program, &args, &env, port, log)?;
        let ready = if mode.uses_verifier() { Ready::Healthy } else { Ready::DraftLoaded };
        gateway.wait_ready(&self.client, ready).await?;
        Ok(gateway)
    }

    /// A batch about to run its first request; drift: where its link will change (half the
    /// characters target-only's greedy outputs of its prompts had, or about 4 a token where there is
    /// none yet).
    fn begin(&self, batch: &Batch) -> Running {
        let plan = self.plan;
        let threshold = batch.drift_to_ms.map(|_| {
            let chars = |&i: &usize| {
                let max = plan.max_tokens_of(batch, i);
                self.reference_chars
                    .get(&(plan.prompts[i].id.clone(), max))
                    .copied()
                    .unwrap_or(4 * max as usize)
            };
            (batch.prompts.iter().map(chars).sum::<usize>() / 2).max(1)
        });
        let result = BatchResult {
            batch: batch.clone(),
            records: Vec::new(),
            verifier: VerifierCounters::default(),
            verifier_cpu_s: 0.0,
            gateway_cpu_s: 0.0,
            wall_s: 0.0,
            drift_switch: None,
        };
        Running { result, received: 0, threshold }
    }

    /// The batch's `k`-th request on `gateway`, at the batch's link (drift: the later RTT once the
    /// batch has switched). The servers' counters are read around the request, so batches of
    /// different gateways may take turns.
    async fn run_request(
        &mut self,
        gateway: &Server,
        run: &mut Running,
        k: usize,
    ) -> anyhow::Result<()> {
        let (setup, plan) = (self.setup, self.plan);
        let Running { result, received, threshold } = run;
        let batch = &result.batch;
        let link = |rtt_ms: u64| LinkConfig {
            rtt: Duration::from_millis(rtt_ms),
            jitter: setup.jitter,
            loss: setup.loss,
            seed: Some(setup.seed),
        };
        let switched_before = result.drift_switch.is_some();
        let rtt_ms =
            if switched_before { batch.drift_to_ms.unwrap_or(batch.rtt_ms) } else { batch.rtt_ms };
        self.proxy.set_link(link(rtt_ms))?;
        let i = batch.prompts[k];
        let prompt = &plan.prompts[i];
        // Seeds differ per prompt and repetition, so sampled repetitions are new samples.
        let seed = setup.seed + 1000 * u64::from(batch.rep) + i as u64;
        let max_tokens = plan.max_tokens_of(batch, i);
        let request = ChatRequest {
            messages: &prompt.messages,
            max_tokens,
            temperature: batch.temperature,
            seed,
        };
        let (verifier_before, vcpu_before, gcpu_before) = (
            self.counters().await?,
            cpu_seconds(self.verifier.pid())?,
            cpu_seconds(gateway.pid())?,
        );
        let started = Instant::now();
        let received_before = *received;
        let mut attempt = 0;
        let outcome = loop {
            attempt += 1;
            let proxy = &self.proxy;
            let switch = &mut result.drift_switch;
            let mut on_text = |text: &str, at_s: f64| {
                if let (Some(threshold), Some(to), None) = (*threshold, batch.drift_to_ms, &*switch)
                {
                    *received += text.len();
                    if *received >= threshold {
                        // The link is valid (the batch's own, another RTT): this cannot fail.
                        let _ = proxy.set_link(link(to));
                        *switch = Some(DriftSwitch { request: k, at_s, share_of_request: None });
                    }
                }
            };
            match stream_chat(&self.client, &gateway.url, &request, &mut on_text).await {
                Ok(o) => break o,
                Err(e) if attempt < ATTEMPTS => {
                    eprintln!("  {}: {e:#}; retrying", prompt.id);
                    // A retried request starts again at the link it started at.
                    if !switched_before && result.drift_switch.is_some() {
                        self.proxy.set_link(link(batch.rtt_ms))?;
                        result.drift_switch = None;
                    }
                    *received = received_before;
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "{}, rep {}, {:?} at RTT {} ms, prompt {}",
                        batch.mode, batch.rep, batch.kind, batch.rtt_ms, prompt.id
                    )))
                }
            }
        };
        result.wall_s += started.elapsed().as_secs_f64();
        if let Some(s) = result.drift_switch.as_mut().filter(|s| s.request == k) {
            s.share_of_request = Some(s.at_s / outcome.total_s.max(1e-9));
        }
        // Target-only's greedy outputs place the drift switch: the same characters for every mode.
        if batch.mode == Mode::TargetOnly && batch.temperature == 0.0 {
            self.reference_chars
                .entry((prompt.id.clone(), max_tokens))
                .or_insert(outcome.text.len());
        }
        result.verifier.add(&self.counters().await?.since(&verifier_before));
        result.verifier_cpu_s += cpu_seconds(self.verifier.pid())? - vcpu_before;
        result.gateway_cpu_s += cpu_seconds(gateway.pid())? - gcpu_before;
        result.records.push(Record {
            rep: batch.rep,
            mode: batch.mode,
            kind: batch.kind,
            rtt_ms: batch.rtt_ms,
            drift_to_ms: batch.drift_to_ms,
            temperature: batch.temperature,
            max_tokens,
            prompt_id: prompt.id.clone(),
            category: prompt.category,
            outcome,
        });
        Ok(())
    }

    /// A batch done: its result, and the progress line.
    fn finish(&mut self, run: Running) {
        self.estimated_done += self.plan.estimate_batch(&run.result.batch);
        self.progress(&run.result);
        self.results.push(run.result);
    }

    /// The verifier's counters now (read directly, not through the proxy: scrapes are not traffic).
    async fn counters(&self) -> anyhow::Result<VerifierCounters> {
        let text = self
            .client
            .get(format!("{}/metrics", self.verifier.url))
            .bearer_auth(VERIFIER_KEY)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        Ok(VerifierCounters::from_scrape(&Scrape::parse(&text)))
    }

    /// The verifier's time for a pass of one call's block by rows (`/v1/info`'s `pass_ms`: timed at
    /// start-up, updated by every pass that scored one call), or empty when it cannot be read.
    pub async fn verifier_pass_ms(&self) -> Vec<f64> {
        let info = async {
            let r = self
                .client
                .get(format!("{}/v1/info", self.verifier.url))
                .bearer_auth(VERIFIER_KEY)
                .send()
                .await?
                .error_for_status()?;
            anyhow::Ok(r.json::<spade_core::protocol::ModelInfo>().await?)
        };
        info.await.map(|i| i.pass_ms).unwrap_or_default()
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
            Kind::Drift => format!(
                "RTT {}->{} ms",
                r.batch.rtt_ms,
                r.batch.drift_to_ms.unwrap_or(r.batch.rtt_ms)
            ),
        };
        println!(
            "[{:>5.1} min, ~{:.1} min left] rep {} {:<27} {:<15} {:>3} req {:>5} tok {:>5} calls {:>6.2} tok/s",
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

/// `program args` as started: under `taskset -c CPU` when the run pins and `cpu` is given.
fn pinned(
    cpu: Option<usize>,
    setup: &Setup,
    program: PathBuf,
    args: Vec<String>,
) -> (PathBuf, Vec<String>) {
    match (&setup.pinning, cpu) {
        (Some(p), Some(cpu)) => p.wrap(cpu, &program, &args),
        _ => (program, args),
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
            std::fs::copy(&src, &dst).with_context(|| {
                format!("copying {} (build the workspace first)", src.display())
            })?;
        }
    }
    Ok(dir)
}
