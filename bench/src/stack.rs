//! The real stack as child processes on loopback: one `spade-verifier` for the whole run, and one
//! `spade-gateway` per mode (its draft length is fixed at start).
//!
//! The children are the binaries next to `spade-bench` in the same target folder (the dev profile
//! optimises every dependency, so no release build is needed). Each logs to the results folder. A
//! child gets SIGTERM when `spade-bench` dies, however it dies (`PR_SET_PDEATHSIG`), so no model
//! server outlives an interrupted benchmark holding gigabytes of memory.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long a model may take to load before the benchmark gives up.
const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// The model pair a benchmark runs, as its command line takes it.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// The draft model's GGUF file (the gateways').
    #[arg(
        long,
        env = "SPADE_BENCH_DRAFT_MODEL",
        default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    )]
    pub draft_model: String,

    /// The target model's GGUF file (the verifier's).
    #[arg(
        long,
        env = "SPADE_BENCH_TARGET_MODEL",
        default_value = "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    )]
    pub target_model: String,
}

impl ModelArgs {
    /// Fails, saying how to fetch them, when either file is missing.
    pub fn ensure_present(&self) -> anyhow::Result<()> {
        for model in [&self.draft_model, &self.target_model] {
            anyhow::ensure!(
                Path::new(model).exists(),
                "{model} not found: run `bash scripts/fetch-models.sh pair`"
            );
        }
        Ok(())
    }

    /// The draft model's file name, as reports give it.
    pub fn draft_file(&self) -> &str {
        file_name(&self.draft_model)
    }

    /// The target model's file name, as reports give it.
    pub fn target_file(&self) -> &str {
        file_name(&self.target_model)
    }
}

fn file_name(path: &str) -> &str {
    Path::new(path).file_name().and_then(|f| f.to_str()).unwrap_or(path)
}

/// A server child process, stopped when dropped.
#[derive(Debug)]
pub struct Server {
    name: String,
    child: Child,
    pub url: String,
    log: PathBuf,
}

/// What makes a server ready: `/health` answers 200, or (a gateway whose verifier is deliberately
/// absent) its body names a loaded draft model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    Healthy,
    DraftLoaded,
}

impl Server {
    /// Starts `program args…` with its output in `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        port: u16,
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(envs.iter().copied())
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // SAFETY: prctl is async-signal-safe and touches only the child. The death signal follows
        // the thread that forked; the benchmark runs on a single-threaded runtime, so that is the
        // main thread, which lives as long as the process.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("starting {}", program.display()))?;
        Ok(Self { name: name.to_string(), child, url: format!("http://127.0.0.1:{port}"), log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `/health` until the server is ready; fails at once if it exits.
    pub async fn wait_ready(
        &mut self,
        client: &reqwest::Client,
        ready: Ready,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        while started.elapsed() < READY_TIMEOUT {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited with {status} while loading; last log lines:\n{}",
                    self.name,
                    self.log_tail(15)
                );
            }
            if let Ok(r) = client
                .get(format!("{}/health", self.url))
                .timeout(Duration::from_secs(5))
                .send()
                .await
            {
                let ok = r.status().is_success();
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                let draft_loaded = body.get("draft_model").is_some_and(|m| !m.is_null());
                if ok || (ready == Ready::DraftLoaded && draft_loaded) {
                    return Ok(started.elapsed());
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        bail!("{} not ready after {READY_TIMEOUT:?}; see {}", self.name, self.log.display())
    }

    /// SIGTERM, then SIGKILL if it has not exited within 10 s.
    pub fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        // SAFETY: signals our own child, which has not been reaped (try_wait above saw it running).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port nothing listens on right now (the OS picks it; another process could take it before the
/// child binds, which on a benchmark machine does not happen in practice).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
