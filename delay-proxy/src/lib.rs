//! spade-delay-proxy: an emulated edge–cloud link on loopback.
//!
//! - [`proxy`]: a TCP proxy that delays traffic like an edge–cloud link, so the gateway and the
//!   verifier can run on one machine yet see a realistic round-trip time. It runs in userspace
//!   because the kernel here has no `sch_netem` qdisc (`tc qdisc add dev lo root netem delay …` is
//!   not available).
//! - [`link`]: the model of the link (delay, jitter, order, loss as a retransmission wait).
//!
//! The `spade-delay-proxy` binary is a thin command line over [`run_proxy`]; tests and benchmarks
//! start the proxy in-process with [`spawn_proxy`] and may change its link while it runs.

pub mod link;
pub mod proxy;

pub use link::LinkConfig;
pub use proxy::{run_proxy, spawn_proxy, ProxyHandle};
