//! A server binary as a child process on loopback: a free port, its output in a log file, `/health`
//! polled until ready, killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a server may take to load its model and answer `/health` with 200.
pub const READY_TIMEOUT: Duration = Duration::from_secs(180);

pub struct Server {
    pub child: Child,
    pub url: String,
    pub port: u16,
    /// Where stdout and stderr go (tracing writes to stdout, panics to stderr).
    pub log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Server {
    /// Starts `program --port <port> args...` (port 0: a free one) with `env` set. `name` names the log file.
    pub fn spawn(
        program: &Path,
        name: &str,
        port: u16,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        assert!(
            program.is_file(),
            "{} is missing: run `cargo build --workspace` (or the README's test command)",
            program.display()
        );
        let port = if port == 0 { free_port() } else { port };
        let log = std::env::temp_dir().join(format!("spade-test-{name}-{port}.log"));
        let _ = std::fs::remove_file(&log);
        let child = Command::new(program)
            .args(["--port", &port.to_string()])
            .args(args)
            .envs(env.iter().copied())
            .stdout(log_sink(&log))
            .stderr(log_sink(&log))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        Self { child, url: format!("http://127.0.0.1:{port}"), port, log }
    }

    /// Waits until `/health` answers 200; panics with the log after [`READY_TIMEOUT`].
    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        while health_status(self.port).await != Some(200) {
            assert!(
                Instant::now() < deadline,
                "{} did not become ready; its log:\n{}",
                self.url,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn rss_mb(&self) -> f64 {
        crate::rss_mb(self.child.id())
    }

    pub fn threads(&self) -> usize {
        crate::threads(self.child.id())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn log_sink(path: &Path) -> Stdio {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
    Stdio::from(file)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The status of `GET /health` on a loopback port, or `None` where nothing answers. Plain HTTP/1.0
/// by hand, so the harness needs no HTTP client of its own.
pub async fn health_status(port: u16) -> Option<u16> {
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").await.ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(10), ask).await.ok().flatten()
}

/// The `(flag, value)` pairs whose flag `args` does not set itself (clap refuses a flag given twice).
pub fn unless_given<'a>(args: &[&str], defaults: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    defaults
        .iter()
        .filter(|(flag, _)| !args.contains(flag))
        .flat_map(|(flag, value)| [*flag, *value])
        .collect()
}
