//! Prometheus metrics, named after vLLM's `spec_decode_*` family (rendered with spade-core's `metrics`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use spade_core::metrics::{render_labeled, render_scalar};
use spade_core::Histogram;

use crate::sessions::{Evicted, Usage};

const SECONDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

pub struct Metrics {
    verify_calls: AtomicU64,
    verify_errors: AtomicU64,
    rejected_queue_full: AtomicU64,
    rejected_busy: AtomicU64,
    draft_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
    emitted_tokens: AtomicU64,
    evicted_sessions: AtomicU64,
    evicted_cache_entries: AtomicU64,
    /// Prompt positions of full-context calls taken from a cache, and computed.
    prompt_cached: AtomicU64,
    prompt_computed: AtomicU64,
    /// [drafted, accepted] per draft position.
    per_position: Mutex<Vec<[u64; 2]>>,
    /// Per call: from its first forward pass to its last.
    forward: Mutex<Histogram>,
    queue_wait: Mutex<Histogram>,
    passes: AtomicU64,
    pass_sessions: AtomicU64,
    pass_rows: AtomicU64,
    pass_time: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            verify_calls: AtomicU64::new(0),
            verify_errors: AtomicU64::new(0),
            rejected_queue_full: AtomicU64::new(0),
            rejected_busy: AtomicU64::new(0),
            draft_tokens: AtomicU64::new(0),
            accepted_tokens: AtomicU64::new(0),
            emitted_tokens: AtomicU64::new(0),
            evicted_sessions: AtomicU64::new(0),
            evicted_cache_entries: AtomicU64::new(0),
            prompt_cached: AtomicU64::new(0),
            prompt_computed: AtomicU64::new(0),
            per_position: Mutex::new(Vec::new()),
            forward: Mutex::new(Histogram::new(SECONDS)),
            queue_wait: Mutex::new(Histogram::new(SECONDS)),
            passes: AtomicU64::new(0),
            pass_sessions: AtomicU64::new(0),
            pass_rows: AtomicU64::new(0),
            pass_time: Mutex::new(Histogram::new(SECONDS)),
        }
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metrics {
    pub fn record_verify(
        &self,
        drafted: usize,
        accepted: usize,
        emitted: usize,
        forward: Duration,
        queue: Duration,
    ) {
        self.verify_calls.fetch_add(1, Ordering::Relaxed);
        self.draft_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
        self.accepted_tokens.fetch_add(accepted as u64, Ordering::Relaxed);
        self.emitted_tokens.fetch_add(emitted as u64, Ordering::Relaxed);
        {
            let mut pos = locked(&self.per_position);
            if pos.len() < drafted {
                pos.resize(drafted, [0, 0]);
            }
            for (i, slot) in pos.iter_mut().take(drafted).enumerate() {
                slot[0] += 1;
                slot[1] += u64::from(i < accepted);
            }
        }
        locked(&self.forward).observe(forward.as_secs_f64());
        locked(&self.queue_wait).observe(queue.as_secs_f64());
    }

    /// One batched forward pass: how many sessions and positions it held, and its time.
    pub fn record_pass(&self, sessions: usize, rows: usize, time: Duration) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.pass_sessions.fetch_add(sessions as u64, Ordering::Relaxed);
        self.pass_rows.fetch_add(rows as u64, Ordering::Relaxed);
        locked(&self.pass_time).observe(time.as_secs_f64());
    }

    pub fn record_error(&self) {
        self.verify_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_queue_full(&self) {
        self.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_busy(&self) {
        self.rejected_busy.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_evictions(&self, evicted: Evicted) {
        self.evicted_sessions.fetch_add(evicted.sessions as u64, Ordering::Relaxed);
        self.evicted_cache_entries.fetch_add(evicted.cache_entries as u64, Ordering::Relaxed);
    }

    /// A call with the full context: positions whose KV rows were already held, and computed.
    pub fn record_prompt(&self, cached: usize, computed: usize) {
        self.prompt_cached.fetch_add(cached as u64, Ordering::Relaxed);
        self.prompt_computed.fetch_add(computed as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition; `store`, `held` and `backlog_secs` are gauges read now.
    pub fn render(
        &self,
        store: Usage,
        held: usize,
        backlog_secs: f64,
        prompts_in_line: usize,
        ready: bool,
    ) -> String {
        let mut out = String::new();
        let counters = [
            ("spade_verify_calls_total", "Verify calls answered.", &self.verify_calls),
            ("spade_verify_errors_total", "Verify calls that failed validation or scoring.", &self.verify_errors),
            ("spade_verify_queue_full_total", "Verify calls refused with 429 because the queue was full.", &self.rejected_queue_full),
            ("spade_verify_busy_total", "Calls with a prompt refused with 429 because the backlog was over --max-backlog-secs.", &self.rejected_busy),
            ("spade_spec_decode_num_draft_tokens_total", "Draft tokens judged.", &self.draft_tokens),
            ("spade_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", &self.accepted_tokens),
            ("spade_spec_decode_num_emitted_tokens_total", "Tokens committed (accepted plus correction or bonus).", &self.emitted_tokens),
            ("spade_sessions_evicted_total", "Idle live sessions evicted to stay within the cache budget.", &self.evicted_sessions),
            ("spade_prefix_cache_evictions_total", "Prefix cache entries evicted to stay within the cache budget.", &self.evicted_cache_entries),
            (
                "spade_prompt_tokens_cached_total",
                "Context positions of full-context calls whose KV rows were already held (not recomputed).",
                &self.prompt_cached,
            ),
            ("spade_prompt_tokens_computed_total", "Context positions of full-context calls computed by the target.", &self.prompt_computed),
            ("spade_verify_passes_total", "Forward passes run (each may hold several sessions' calls).", &self.passes),
            ("spade_verify_pass_sessions_total", "Sessions' calls scored, summed over passes (divide by passes for the mean batch).", &self.pass_sessions),
            ("spade_verify_pass_rows_total", "Positions scored, summed over passes.", &self.pass_rows),
        ];
        for (name, help, value) in counters {
            render_scalar(&mut out, "counter", name, help, value.load(Ordering::Relaxed));
        }

        let pos = locked(&self.per_position).clone();
        let by_position = |column: usize| {
            pos.iter().enumerate().map(move |(i, counts)| (i.to_string(), counts[column]))
        };
        let accepted_help = "Draft tokens accepted, by position in the block.";
        render_labeled(
            &mut out,
            "counter",
            "spade_spec_decode_num_accepted_tokens_per_pos",
            accepted_help,
            "position",
            by_position(1),
        );
        let drafted_help = "Draft tokens judged, by position in the block.";
        render_labeled(
            &mut out,
            "counter",
            "spade_spec_decode_num_draft_tokens_per_pos",
            drafted_help,
            "position",
            by_position(0),
        );

        locked(&self.forward).render(
            &mut out,
            "spade_verify_forward_seconds",
            "Target forward pass time per verify call.",
        );
        locked(&self.queue_wait).render(
            &mut out,
            "spade_verify_queue_seconds",
            "Time verify calls waited for their first forward pass.",
        );
        locked(&self.pass_time).render(
            &mut out,
            "spade_verify_pass_seconds",
            "Time per batched forward pass.",
        );

        let gauges = [
            ("spade_sessions", "Live sessions holding a KV cache.", store.sessions),
            ("spade_kv_cache_bytes", "Bytes held by live sessions' KV caches.", store.session_bytes),
            ("spade_prefix_cache_entries", "Finished sessions' KV rows kept for later sessions sharing their prefix.", store.cache_entries),
            ("spade_prefix_cache_bytes", "Bytes held by the prefix cache.", store.cache_bytes),
            ("spade_verify_calls_held", "Verify calls being scored or waiting for a pass (429 beyond --max-batch-sessions + --queue-size).", held),
            ("spade_verify_prompts_in_line", "Prompts turned away with 429 verifier_busy that keep their place until taken.", prompts_in_line),
            ("spade_ready", "1 once the model is loaded.", usize::from(ready)),
        ];
        for (name, help, value) in gauges {
            render_scalar(&mut out, "gauge", name, help, value);
        }
        let backlog_help = "Seconds of scoring waiting, at the measured cost per position (--max-backlog-secs bounds it for new prompts).";
        render_scalar(
            &mut out,
            "gauge",
            "spade_verify_backlog_seconds",
            backlog_help,
            format!("{backlog_secs:.3}"),
        );
        out
    }
}
