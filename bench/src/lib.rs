//! spade-bench: tooling for measuring SPADE on one machine.
//!
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
//! `spade-bench` and `spade-agent-bench` put `spade-delay-proxy`'s emulated edge–cloud link between
//! gateway and verifier.

pub mod agent;
pub mod capacity;
pub mod client;
pub mod machine;
pub mod pinning;
pub mod plan;
pub mod prom;
pub mod prompts;
pub mod report;
pub mod runner;
pub mod stack;
pub mod stats;
pub mod summary;

pub use prompts::{load_prompts, Category, Message, Prompt, PromptsError, PROMPTS_PATH};
