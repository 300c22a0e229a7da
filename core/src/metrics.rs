//! Prometheus text exposition pieces shared by both servers (rendering only; the servers own the
//! counters and the locks).

use std::fmt::Write;

/// A cumulative histogram with fixed upper bounds (seconds, tokens/s, ...).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound, plus +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, value: f64) {
        let bucket = self.bounds.iter().position(|&b| value <= b).unwrap_or(self.bounds.len());
        self.counts[bucket] += 1;
        self.sum += value;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        let labels = self.bounds.iter().map(|b| b.to_string()).chain(["+Inf".to_string()]);
        for (le, n) in labels.zip(&self.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// Appends one counter or gauge with its help and type lines.
pub fn render_scalar(
    out: &mut String,
    kind: &str,
    name: &str,
    help: &str,
    value: impl std::fmt::Display,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
}

/// Appends one metric with a label, one sample per `(label value, value)`.
pub fn render_labeled(
    out: &mut String,
    kind: &str,
    name: &str,
    help: &str,
    label: &str,
    samples: impl IntoIterator<Item = (String, u64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (value_of_label, value) in samples {
        let _ = writeln!(out, "{name}{{{label}=\"{value_of_label}\"}} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "X.");
        assert!(out.contains("x_seconds_bucket{le=\"0.1\"} 1\n"));
        assert!(out.contains("x_seconds_bucket{le=\"1\"} 3\n"));
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(out.contains("x_seconds_count 4\n"));
    }
}
