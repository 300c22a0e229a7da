//! spade-bench: tooling for measuring SPADE on one machine.
//!
//! - [`proxy`]: a TCP proxy that delays traffic like an edge–cloud link, so the gateway and the
//!   verifier can run on loopback yet see a realistic round-trip time. It runs in userspace because
//!   the kernel here has no `sch_netem` qdisc (`tc qdisc add dev lo root netem delay …` is not
//!   available); see [`link`] for the model of the link.
//! - [`prompts`]: the benchmark prompt set (`bench/prompts.jsonl`) and its loader.
//! - The `spade-bench` binary's pieces: [`plan`] (what a run does and how long it should take),
//!   [`stack`] (verifier and gateway child processes), [`pinning`] (a core each), [`runner`] (the
//!   run itself), [`client`] (one streamed, timed request), [`prom`] and [`machine`] (verifier
//!   counters and CPU time),
//!   [`summary`] and [`stats`] (the figures), [`report`] (the Markdown tables).
//!
//! - The `spade-agent-bench` binary's [`agent`]: a coding agent's multi-turn conversation, turn by
//!   turn, speculative with the verifier's prefix cache against target-only without it.
//!
//! - The `spade-capacity` binary's [`capacity`]: recorded edges replayed against one verifier,
//!   batched and one call at a time.
//!
//! The `spade-delay-proxy` binary is a thin command line over [`run_proxy`]; tests and benchmarks start
//! the proxy in-process with [`spawn_proxy`].

pub mod agent;
pub mod capacity;
pub mod client;
pub mod link;
pub mod machine;
pub mod pinning;
pub mod plan;
pub mod prom;
pub mod prompts;
pub mod proxy;
pub mod report;
pub mod runner;
pub mod stack;
pub mod stats;
pub mod summary;

pub use link::LinkConfig;
pub use prompts::{load_prompts, Category, Message, Prompt, PromptsError, PROMPTS_PATH};
pub use proxy::{run_proxy, spawn_proxy, ProxyHandle};
