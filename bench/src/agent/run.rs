//! Runs an [`AgentPlan`]: at each RTT, one fresh stack per mode (verifier, delay proxy, gateway), all
//! up together, and the conversation played turn by turn, the modes taking turns.
//!
//! - **A stack per mode and RTT.** The prefix cache is a verifier setting, so each mode has its own
//!   verifier; and every stack is new at every RTT, since a conversation the verifier (or the
//!   gateway's draft cache) has already seen would be all cache hits the second time.
//! - **Interleaved turns.** At turn k every mode runs its turn k before any runs turn k+1, the order
//!   rotating by one each turn, so the modes compared are timed minutes apart rather than a whole
//!   conversation apart (the host's speed drifts), and none always runs first. Idle stacks only wait.
//! - **Two machines on one**, as in `spade-bench`: every verifier on one CPU with one compute thread,
//!   every gateway on another with `RAYON_NUM_THREADS=1` ([`Pinning`]).
//! - **No retries.** A failed turn fails the run (what was measured is kept): a retried turn would
//!   meet caches its failed attempt had already warmed.
//!
//! Long prompts are slow on one core (a target-only turn prefills the whole conversation: a minute or
//! more), so the gateway's verify timeout is raised and the verifier takes every call
//! (`--max-backlog-secs 0`; one client never queues behind another anyway).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::conversation::Conversation;
use super::stream::{counter, delta, stream_turn, DRAFT_COMPUTED, PROMPT_CACHED, PROMPT_COMPUTED};
use super::{AgentMode, AgentPlan, TurnRecord};
use crate::machine::cpu_seconds;
use crate::pinning::{cpus_of, Pinning};
use crate::stack::{free_port, Ready, Server};
use spade_delay_proxy::{spawn_proxy, LinkConfig, ProxyHandle};

/// The API key the benchmark's verifiers are started with (loopback only).
const VERIFIER_KEY: &str = "spade-agent-bench";
/// Longest a turn may take: a cold 2,400-token prefill on one core takes minutes.
const TURN_TIMEOUT: Duration = Duration::from_secs(1800);
/// The gateway's `--verify-timeout-secs`: a verify call carrying a whole prompt is as slow.
const VERIFY_TIMEOUT_S: &str = "1800";
/// Wait after a turn's stream ends before reading the verifier's CPU time and counters, so work it
/// does when the generation's session closes (such as keeping its rows for the next turn) counts
/// towards this turn rather than the next mode's.
const SETTLE: Duration = Duration::from_millis(300);

/// Where the servers and models are.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Folder with spade-verifier and spade-gateway.
    pub bin_dir: PathBuf,
    pub draft_model: String,
    pub target_model: String,
    pub pinning: Option<Pinning>,
    /// Results folder: the servers' logs go there.
    pub out_dir: PathBuf,
}

/// One mode's servers at one RTT; dropping it stops them and the proxy.
struct Stack {
    mode: AgentMode,
    verifier: Server,
    gateway: Server,
    _proxy: ProxyHandle,
}

pub struct AgentRun<'a> {
    setup: &'a Setup,
    conversation: &'a Conversation,
    plan: &'a AgentPlan,
    client: reqwest::Client,
    pub records: Vec<TurnRecord>,
    /// Where the servers ran, as `/proc` shows it (for the report).
    pub placement: Vec<String>,
    started: Instant,
}

impl<'a> AgentRun<'a> {
    pub fn new(
        setup: &'a Setup,
        conversation: &'a Conversation,
        plan: &'a AgentPlan,
    ) -> anyhow::Result<Self> {
        let client = reqwest::Client::builder().timeout(TURN_TIMEOUT).build()?;
        Ok(Self {
            setup,
            conversation,
            plan,
            client,
            records: Vec::new(),
            placement: Vec::new(),
            started: Instant::now(),
        })
    }

    /// Every RTT in turn: start the modes' stacks, play the conversation, stop them.
    pub async fn run(&mut self) -> anyhow::Result<()> {
        for &rtt_ms in &self.plan.rtts_ms {
            let mut stacks = Vec::with_capacity(self.plan.modes.len());
            for &mode in &self.plan.modes {
                stacks.push(self.start_stack(mode, rtt_ms).await?);
            }
            let mut answers: Vec<Vec<String>> = vec![Vec::new(); stacks.len()];
            for turn in 0..self.plan.turns {
                for i in rotated(turn, stacks.len()) {
                    let record = self.play_turn(&stacks[i], rtt_ms, &answers[i]).await?;
                    answers[i].push(record.text.clone());
                    self.progress(&record);
                    self.records.push(record);
                }
            }
        }
        Ok(())
    }

    async fn start_stack(&mut self, mode: AgentMode, rtt_ms: u64) -> anyhow::Result<Stack> {
        let setup = self.setup;
        let pinned = setup.pinning.is_some();
        let threads_env = [("RAYON_NUM_THREADS", "1")];
        let port = free_port()?;
        let mut args: Vec<String> = [
            "--model",
            &setup.target_model,
            "--port",
            &port.to_string(),
            "--api-key",
            VERIFIER_KEY,
        ]
        .map(String::from)
        .to_vec();
        args.extend([
            "--prefix-cache".into(),
            mode.prefix_cache().to_string(),
            "--max-backlog-secs".into(),
            "0".into(),
        ]);
        if pinned {
            args.extend(["--threads".into(), "1".into()]);
        }
        let slug = format!("{mode}-rtt{rtt_ms}");
        let (program, args) = wrap(
            setup.pinning.as_ref().map(|p| p.verifier_cpu),
            setup,
            setup.bin_dir.join("spade-verifier"),
            args,
        );
        let env: &[(&str, &str)] = if pinned { &threads_env } else { &[] };
        let mut verifier = Server::spawn(
            "spade-verifier",
            &program,
            &args,
            env,
            port,
            setup.out_dir.join(format!("verifier-{slug}.log")),
        )?;
        let took = verifier.wait_ready(&self.client, Ready::Healthy).await?;

        let link =
            LinkConfig { seed: Some(1), ..LinkConfig::with_rtt(Duration::from_millis(rtt_ms)) };
        let proxy = spawn_proxy(format!("127.0.0.1:{port}"), link).await?;
        let port = free_port()?;
        let mut args: Vec<String> = vec![
            "--draft-model".into(),
            setup.draft_model.clone(),
            "--verifier-url".into(),
            format!("http://{}", proxy.addr()),
        ];
        args.extend([
            "--port".into(),
            port.to_string(),
            "--verify-timeout-secs".into(),
            VERIFY_TIMEOUT_S.into(),
        ]);
        args.extend(mode.gateway_args());
        let (program, args) = wrap(
            setup.pinning.as_ref().map(|p| p.gateway_cpu),
            setup,
            setup.bin_dir.join("spade-gateway"),
            args,
        );
        let mut env = vec![("SPADE_VERIFIER_API_KEY", VERIFIER_KEY)];
        env.extend(if pinned { &threads_env[..] } else { &[] });
        let mut gateway = Server::spawn(
            "spade-gateway",
            &program,
            &args,
            &env,
            port,
            setup.out_dir.join(format!("gateway-{slug}.log")),
        )?;
        gateway.wait_ready(&self.client, Ready::Healthy).await?;

        let cpus = |s: &Server| cpus_of(s.pid()).unwrap_or_else(|| "?".into());
        println!(
            "{mode} at RTT {rtt_ms} ms: verifier ready in {:.1} s (CPUs {}), gateway (CPUs {})",
            took.as_secs_f64(),
            cpus(&verifier),
            cpus(&gateway)
        );
        if self.placement.is_empty() {
            let threads =
                if pinned { "--threads 1 / RAYON_NUM_THREADS=1" } else { "default threads" };
            self.placement.push(format!(
                "verifiers: CPUs {} (`Cpus_allowed_list`), gateways: CPUs {}, {threads}",
                cpus(&verifier),
                cpus(&gateway)
            ));
        }
        Ok(Stack { mode, verifier, gateway, _proxy: proxy })
    }

    /// One turn of `stack`'s conversation after its `answers` so far, with what the verifier spent.
    async fn play_turn(
        &self,
        stack: &Stack,
        rtt_ms: u64,
        answers: &[String],
    ) -> anyhow::Result<TurnRecord> {
        let turn = answers.len() + 1;
        let body = self
            .conversation
            .request_body(&self.conversation.messages_after(answers), self.plan.max_tokens);
        let (computed_before, cached_before) = self.prompt_counters(stack).await?;
        let draft_before = self.draft_counter(stack).await?;
        let cpu_before = cpu_seconds(stack.verifier.pid())?;
        let reply = stream_turn(&self.client, &stack.gateway.url, &body)
            .await
            .with_context(|| format!("{} at RTT {rtt_ms} ms, turn {turn}", stack.mode))?;
        tokio::time::sleep(SETTLE).await;
        let verifier_cpu_s = cpu_seconds(stack.verifier.pid())? - cpu_before;
        let (computed_after, cached_after) = self.prompt_counters(stack).await?;
        let draft_after = self.draft_counter(stack).await?;
        let u = reply.usage;
        Ok(TurnRecord {
            rtt_ms,
            mode: stack.mode,
            turn,
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            draft_computed: delta(draft_before, draft_after),
            completion_tokens: u.completion_tokens,
            verify_calls: u.verify_calls,
            degraded: u.degraded,
            ttft_s: reply.ttft_s,
            total_s: reply.total_s,
            verifier_cpu_s,
            verifier_prompt_computed: delta(computed_before, computed_after),
            verifier_prompt_cached: delta(cached_before, cached_after),
            text: reply.text,
        })
    }

    /// The verifier's prompt positions computed and cached so far (read directly, not through the
    /// proxy: scrapes are not traffic); `None` for a counter it does not export.
    async fn prompt_counters(&self, stack: &Stack) -> anyhow::Result<(Option<f64>, Option<f64>)> {
        let response = self
            .client
            .get(format!("{}/metrics", stack.verifier.url))
            .bearer_auth(VERIFIER_KEY)
            .send()
            .await?;
        let text = response.error_for_status()?.text().await?;
        Ok((counter(&text, &PROMPT_COMPUTED), counter(&text, &PROMPT_CACHED)))
    }

    /// The gateway's count of context positions its draft model computed so far.
    async fn draft_counter(&self, stack: &Stack) -> anyhow::Result<Option<f64>> {
        let text = self
            .client
            .get(format!("{}/metrics", stack.gateway.url))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        Ok(counter(&text, &DRAFT_COMPUTED))
    }

    fn progress(&self, r: &TurnRecord) {
        let cached = r.cached_tokens.map_or("?".into(), |c| c.to_string());
        println!(
            "[{:>5.1} min] RTT {:>3} ms turn {}/{} {:<18} prompt {:>5} cached {:>5} | TTFT {:>6.2} s total {:>6.2} s | verifier {:>6.2} CPU-s{}",
            self.started.elapsed().as_secs_f64() / 60.0,
            r.rtt_ms,
            r.turn,
            self.plan.turns,
            r.mode.to_string(),
            r.prompt_tokens,
            cached,
            r.ttft_s,
            r.total_s,
            r.verifier_cpu_s,
            if r.degraded { " DEGRADED (no verifier)" } else { "" }
        );
    }
}

/// The order in which `n` stacks run turn `turn`: rotated by one each turn.
pub fn rotated(turn: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| (i + turn) % n).collect()
}

/// `program args` as started: under `taskset -c CPU` when the run pins.
fn wrap(
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

/// Hard-links (or copies) spade-verifier and spade-gateway from `from` into `out/bin`: cargo replaces
/// a rebuilt binary with a new file, so the run keeps measuring the binaries it started with while
/// the shared target folder is rebuilt.
pub fn freeze_binaries(from: &Path, out: &Path) -> anyhow::Result<PathBuf> {
    let dir = out.join("bin");
    std::fs::create_dir_all(&dir)?;
    for name in ["spade-verifier", "spade-gateway"] {
        let (src, dst) = (from.join(name), dir.join(name));
        if std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst).with_context(|| {
                format!(
                    "copying {} (cargo build -p spade-gateway -p spade-verifier --bins)",
                    src.display()
                )
            })?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stack_runs_first_in_turn() {
        assert_eq!(rotated(0, 3), [0, 1, 2]);
        assert_eq!(rotated(1, 3), [1, 2, 0]);
        assert_eq!(rotated(5, 2), [1, 0]);
        let firsts: Vec<usize> = (0..4).map(|t| rotated(t, 2)[0]).collect();
        assert_eq!(firsts, [0, 1, 0, 1]);
    }
}
