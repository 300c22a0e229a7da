//! What SPADE's tests share (dev-only):
//!
//! - [`models`]: where the real test models are.
//! - [`process`]: a server binary as a child process on a free loopback port, logs captured, killed on drop.
//! - `fake` (feature `fake`): deterministic scorer and edge model, for router tests only (everything
//!   else uses real models).
//! - [`report`]: one observed case of the reliability report (scripts/reliability.sh renders it).
//! - [`rss_mb`], [`threads`]: a process's resident memory and thread count; [`chi_square_critical`]: the statistical tests' bound;
//!   [`metric_value`]: one sample of a `/metrics` answer.

#[cfg(feature = "fake")]
pub mod fake;
pub mod models;
pub mod process;

/// Resident memory of process `pid` in MiB (0 where /proc cannot say).
pub fn rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Threads of process `pid` now (0 where /proc cannot say).
pub fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count())
}

/// Chi-square critical value at significance 1e-4 for `df` degrees of freedom (Wilson–Hilferty
/// approximation): the bound the statistical losslessness tests compare with.
pub fn chi_square_critical(df: usize) -> f64 {
    let (df, z) = (df as f64, 3.719);
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

/// The value of the sample `name` (with its labels, as written: `a_total{rule="match"}`) in a
/// Prometheus text exposition, such as a `/metrics` answer.
pub fn metric_value(exposition: &str, name: &str) -> Option<f64> {
    exposition.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Appends one observed case to the reliability report, where `SPADE_RELIABILITY_REPORT` names its
/// case file (scripts/reliability.sh sets it and renders the report); prints it either way.
pub fn report(area: &str, case: &str, observed: &str, pass: bool) {
    eprintln!("[{}] {area}: {case}: {observed}", if pass { "PASS" } else { "FAIL" });
    if let Some(path) = std::env::var_os("SPADE_RELIABILITY_REPORT") {
        use std::io::Write;
        let line =
            serde_json::json!({"area": area, "case": case, "observed": observed, "pass": pass});
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
        writeln!(f, "{line}").unwrap();
    }
}
