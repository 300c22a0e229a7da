//! Reading the verifier's `/metrics` (Prometheus text exposition) into the counters the benchmark
//! needs. The verifier's counters are cumulative over its whole life, and one verifier serves every
//! mode of a run, so each mode's figures are the difference of two scrapes taken around its requests.

use std::collections::HashMap;

use serde::Serialize;

/// A sample's identity: metric name and labels (sorted by label name).
type Key = (String, Vec<(String, String)>);

/// One scrape: every sample line by its key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape(HashMap<Key, f64>);

impl Scrape {
    /// Parses the text format; comment lines and lines that do not parse are skipped (the format
    /// allows metric families this parser need not understand).
    pub fn parse(text: &str) -> Self {
        let mut samples = HashMap::new();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            if let Some((key, value)) = parse_line(line) {
                samples.insert(key, value);
            }
        }
        Self(samples)
    }

    /// A sample without labels; 0 when absent (a counter that was never touched may be missing).
    pub fn value(&self, name: &str) -> f64 {
        self.0.get(&(name.to_string(), Vec::new())).copied().unwrap_or(0.0)
    }

    /// The samples of `name` labelled `position="i"`, as a vector indexed by i (gaps are 0).
    pub fn by_position(&self, name: &str) -> Vec<f64> {
        let mut out = Vec::new();
        for ((n, labels), &v) in &self.0 {
            let position = labels
                .iter()
                .find(|(k, _)| k == "position")
                .and_then(|(_, p)| p.parse::<usize>().ok());
            if let (true, Some(i)) = (n == name, position) {
                if out.len() <= i {
                    out.resize(i + 1, 0.0);
                }
                out[i] = v;
            }
        }
        out
    }
}

/// `name{k="v",...} value [timestamp]` or `name value [timestamp]`.
fn parse_line(line: &str) -> Option<(Key, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].find('}')?;
            (&line[..open], parse_labels(&line[open + 1..close])?, &line[close + 1..])
        }
        None => {
            let (name, rest) = line.split_once(char::is_whitespace)?;
            (name, Vec::new(), rest)
        }
    };
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(((name.trim().to_string(), labels), value))
}

/// `k="v",k2="v2"` (no escaped quotes or commas inside values: the verifier writes none).
fn parse_labels(s: &str) -> Option<Vec<(String, String)>> {
    let mut labels = Vec::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=')?;
        labels.push((k.trim().to_string(), v.trim().trim_matches('"').to_string()));
    }
    labels.sort();
    Some(labels)
}

/// The verifier counters a benchmark mode is judged by.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VerifierCounters {
    pub calls: f64,
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
    /// Blocks in which position i (0-based) was drafted / was accepted. Acceptance stops at the
    /// first rejection, so `accepted[i] / drafted[i]` is the share of blocks whose first i+1 drafts
    /// all survived.
    pub drafted_per_pos: Vec<f64>,
    pub accepted_per_pos: Vec<f64>,
    pub forward_seconds: f64,
}

impl VerifierCounters {
    pub fn from_scrape(s: &Scrape) -> Self {
        Self {
            calls: s.value("spade_verify_calls_total"),
            draft_tokens: s.value("spade_spec_decode_num_draft_tokens_total"),
            accepted_tokens: s.value("spade_spec_decode_num_accepted_tokens_total"),
            drafted_per_pos: s.by_position("spade_spec_decode_num_draft_tokens_per_pos"),
            accepted_per_pos: s.by_position("spade_spec_decode_num_accepted_tokens_per_pos"),
            forward_seconds: s.value("spade_verify_forward_seconds_sum"),
        }
    }

    /// What happened between two scrapes, `before` and `self`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            calls: self.calls - before.calls,
            draft_tokens: self.draft_tokens - before.draft_tokens,
            accepted_tokens: self.accepted_tokens - before.accepted_tokens,
            drafted_per_pos: zip_with(&self.drafted_per_pos, &before.drafted_per_pos, |a, b| a - b),
            accepted_per_pos: zip_with(&self.accepted_per_pos, &before.accepted_per_pos, |a, b| {
                a - b
            }),
            forward_seconds: self.forward_seconds - before.forward_seconds,
        }
    }

    /// Adds another interval's counts (a mode's requests run in several batches).
    pub fn add(&mut self, other: &Self) {
        *self = Self {
            calls: self.calls + other.calls,
            draft_tokens: self.draft_tokens + other.draft_tokens,
            accepted_tokens: self.accepted_tokens + other.accepted_tokens,
            drafted_per_pos: zip_with(&self.drafted_per_pos, &other.drafted_per_pos, |a, b| a + b),
            accepted_per_pos: zip_with(&self.accepted_per_pos, &other.accepted_per_pos, |a, b| {
                a + b
            }),
            forward_seconds: self.forward_seconds + other.forward_seconds,
        };
    }

    /// Survival rate by position (see `accepted_per_pos`), for the positions drafted at least once.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.drafted_per_pos
            .iter()
            .zip(&self.accepted_per_pos)
            .take_while(|(d, _)| **d > 0.0)
            .map(|(d, a)| a / d)
            .collect()
    }
}

/// Element-wise `f` over two vectors, the shorter padded with zeros.
fn zip_with(a: &[f64], b: &[f64], f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    (0..a.len().max(b.len()))
        .map(|i| f(a.get(i).copied().unwrap_or(0.0), b.get(i).copied().unwrap_or(0.0)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP spade_verify_calls_total Verify calls.
# TYPE spade_verify_calls_total counter
spade_verify_calls_total 16
spade_spec_decode_num_draft_tokens_total 63
spade_spec_decode_num_accepted_tokens_total 48
spade_spec_decode_num_accepted_tokens_per_pos{position="0"} 13
spade_spec_decode_num_accepted_tokens_per_pos{position="1"} 12
spade_spec_decode_num_draft_tokens_per_pos{position="1"} 16
spade_spec_decode_num_draft_tokens_per_pos{position="0"} 16
spade_verify_forward_seconds_bucket{le="+Inf"} 16
spade_verify_forward_seconds_sum 10.632965297000002
spade_ready 1"#;

    #[test]
    fn parses_plain_and_labelled_samples() {
        let s = Scrape::parse(TEXT);
        assert_eq!(s.value("spade_verify_calls_total"), 16.0);
        assert_eq!(s.value("spade_ready"), 1.0);
        assert_eq!(s.value("absent_metric"), 0.0);
        assert_eq!(
            s.by_position("spade_spec_decode_num_accepted_tokens_per_pos"),
            vec![13.0, 12.0]
        );
        assert_eq!(s.by_position("spade_spec_decode_num_draft_tokens_per_pos"), vec![16.0, 16.0]);
        let c = VerifierCounters::from_scrape(&s);
        assert!((c.forward_seconds - 10.633).abs() < 1e-3);
        assert_eq!(c.acceptance_by_position(), vec![13.0 / 16.0, 12.0 / 16.0]);
    }

    #[test]
    fn skips_malformed_lines_and_reads_timestamps() {
        let s = Scrape::parse(
            "good 2 1700000000\nbad{position=\"0\" 3\nnovalue\n  \nhalf{a=\"1\"} x\n",
        );
        assert_eq!(s.value("good"), 2.0);
        assert_eq!(s.0.len(), 1);
    }

    #[test]
    fn deltas_subtract_and_sum_positions_of_different_lengths() {
        let before = VerifierCounters {
            calls: 10.0,
            drafted_per_pos: vec![4.0],
            accepted_per_pos: vec![3.0],
            ..Default::default()
        };
        let after = VerifierCounters {
            calls: 15.0,
            drafted_per_pos: vec![9.0, 5.0],
            accepted_per_pos: vec![7.0, 2.0],
            ..Default::default()
        };
        let mut d = after.since(&before);
        assert_eq!(d.calls, 5.0);
        assert_eq!(d.drafted_per_pos, vec![5.0, 5.0]);
        assert_eq!(d.accepted_per_pos, vec![4.0, 2.0]);
        d.add(&d.clone());
        assert_eq!(d.calls, 10.0);
        assert_eq!(d.acceptance_by_position(), vec![0.8, 0.4]);
    }

    #[test]
    fn positions_never_drafted_are_left_out() {
        let c = VerifierCounters {
            drafted_per_pos: vec![4.0, 0.0, 0.0],
            accepted_per_pos: vec![2.0, 0.0, 0.0],
            ..Default::default()
        };
        assert_eq!(c.acceptance_by_position(), vec![0.5]);
    }
}
