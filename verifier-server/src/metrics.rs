//! Prometheus metrics, named after vLLM's `spec_decode_*` family.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const FORWARD_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

#[derive(Default)]
pub struct Metrics {
    verify_calls: AtomicU64,
    verify_errors: AtomicU64,
    rejected_queue_full: AtomicU64,
    draft_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
    emitted_tokens: AtomicU64,
    evicted_sessions: AtomicU64,
    /// [drafted, accepted] per draft position.
    per_position: Mutex<Vec<[u64; 2]>>,
    /// Bucket counts (plus +Inf), sum, count.
    forward: Mutex<(Vec<u64>, f64, u64)>,
    queue_wait: Mutex<(f64, u64)>,
}

impl Metrics {
    pub fn record_verify(&self, drafted: usize, accepted: usize, emitted: usize, forward: Duration, queue: Duration) {
        self.verify_calls.fetch_add(1, Ordering::Relaxed);
        self.draft_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
        self.accepted_tokens.fetch_add(accepted as u64, Ordering::Relaxed);
        self.emitted_tokens.fetch_add(emitted as u64, Ordering::Relaxed);
        {
            let mut pos = self.per_position.lock().unwrap_or_else(|p| p.into_inner());
            if pos.len() < drafted {
                pos.resize(drafted, [0, 0]);
            }
            for (i, slot) in pos.iter_mut().take(drafted).enumerate() {
                slot[0] += 1;
                slot[1] += u64::from(i < accepted);
            }
        }
        let secs = forward.as_secs_f64();
        let mut f = self.forward.lock().unwrap_or_else(|p| p.into_inner());
        if f.0.is_empty() {
            f.0 = vec![0; FORWARD_BUCKETS.len() + 1];
        }
        let bucket = FORWARD_BUCKETS.iter().position(|&b| secs <= b).unwrap_or(FORWARD_BUCKETS.len());
        f.0[bucket] += 1;
        f.1 += secs;
        f.2 += 1;
        let mut q = self.queue_wait.lock().unwrap_or_else(|p| p.into_inner());
        q.0 += queue.as_secs_f64();
        q.1 += 1;
    }

    pub fn record_error(&self) {
        self.verify_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_queue_full(&self) {
        self.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_evictions(&self, n: usize) {
        self.evicted_sessions.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition; `sessions`, `cache_bytes` and `waiting` are gauges read now.
    pub fn render(&self, sessions: usize, cache_bytes: usize, waiting: usize, ready: bool) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter("spade_verify_calls_total", "Verify calls answered.", load(&self.verify_calls));
        counter("spade_verify_errors_total", "Verify calls that failed validation or scoring.", load(&self.verify_errors));
        counter("spade_verify_queue_full_total", "Verify calls refused with 429 because the queue was full.", load(&self.rejected_queue_full));
        counter("spade_spec_decode_num_draft_tokens_total", "Draft tokens judged.", load(&self.draft_tokens));
        counter("spade_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", load(&self.accepted_tokens));
        counter("spade_spec_decode_num_emitted_tokens_total", "Tokens committed (accepted plus correction or bonus).", load(&self.emitted_tokens));
        counter("spade_sessions_evicted_total", "Sessions evicted to stay within the cache budget.", load(&self.evicted_sessions));

        let pos = self.per_position.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let _ = writeln!(out, "# HELP spade_spec_decode_num_accepted_tokens_per_pos Draft tokens accepted, by position in the block.");
        let _ = writeln!(out, "# TYPE spade_spec_decode_num_accepted_tokens_per_pos counter");
        for (i, [_, a]) in pos.iter().enumerate() {
            let _ = writeln!(out, "spade_spec_decode_num_accepted_tokens_per_pos{{position=\"{i}\"}} {a}");
        }
        let _ = writeln!(out, "# HELP spade_spec_decode_num_draft_tokens_per_pos Draft tokens judged, by position in the block.");
        let _ = writeln!(out, "# TYPE spade_spec_decode_num_draft_tokens_per_pos counter");
        for (i, [d, _]) in pos.iter().enumerate() {
            let _ = writeln!(out, "spade_spec_decode_num_draft_tokens_per_pos{{position=\"{i}\"}} {d}");
        }

        let (buckets, sum, count) = self.forward.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let _ = writeln!(out, "# HELP spade_verify_forward_seconds Target forward pass time per verify call.");
        let _ = writeln!(out, "# TYPE spade_verify_forward_seconds histogram");
        let mut cumulative = 0;
        for (i, le) in FORWARD_BUCKETS.iter().map(|b| b.to_string()).chain(["+Inf".to_string()]).enumerate() {
            cumulative += buckets.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "spade_verify_forward_seconds_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "spade_verify_forward_seconds_sum {sum}\nspade_verify_forward_seconds_count {count}");
        let (qsum, qcount) = *self.queue_wait.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "# HELP spade_verify_queue_seconds Time verify calls waited for a worker.\n# TYPE spade_verify_queue_seconds summary");
        let _ = writeln!(out, "spade_verify_queue_seconds_sum {qsum}\nspade_verify_queue_seconds_count {qcount}");

        let mut gauge = |name: &str, help: &str, v: usize| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge("spade_sessions", "Sessions holding a KV cache.", sessions);
        gauge("spade_kv_cache_bytes", "Bytes held by session KV caches.", cache_bytes);
        gauge("spade_verify_queue_waiting", "Verify calls waiting for a worker.", waiting);
        gauge("spade_ready", "1 once the model is loaded.", usize::from(ready));
        out
    }
}
