//! Prometheus metrics of the gateway: requests, time to first token, tokens/s, acceptance, verify
//! latency and the verify calls speculation saved.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use spade_core::draft_control::DraftChoice;
use spade_core::metrics::{render_labeled, render_scalar};
use spade_core::openai::{DraftLen, SpadeTiming};
use spade_core::{AcceptRule, Histogram};
use spade_engine::ContextRows;

const SECONDS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const TOKENS_PER_SECOND: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0];

/// What one finished generation reports.
#[derive(Debug, Clone)]
pub struct GenerationRecord {
    pub completion_tokens: u64,
    pub verify_calls: u64,
    pub drafted: u64,
    pub accepted: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens the verifier did not recompute (its first full-context answer); None when no
    /// call reached it.
    pub prompt_cached_tokens: Option<u64>,
    /// Prompt tokens the draft model's prefix cache held (None when it did not draft).
    pub draft_cached_tokens: Option<u64>,
    pub degraded: bool,
    /// Tokens in the request's prediction; of them proposed, and accepted.
    pub prediction_tokens: u64,
    pub predicted: u64,
    pub predicted_accepted: u64,
    /// Tokens proposed by prompt lookup, and accepted.
    pub looked_up: u64,
    pub looked_up_accepted: u64,
    pub ttft: Option<Duration>,
    pub duration: Duration,
    pub draft_len: DraftLen,
    /// The verifier's rule (None when it was unreachable from the start).
    pub rule: Option<AcceptRule>,
    pub ahead_drafted: u64,
    pub ahead_used: u64,
    pub timing: SpadeTiming,
    pub auto: Option<DraftChoice>,
}

pub struct Metrics {
    requests: AtomicU64,
    failures: AtomicU64,
    degraded: AtomicU64,
    completion_tokens: AtomicU64,
    verify_calls: AtomicU64,
    drafted: AtomicU64,
    accepted: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    prompt_cached: AtomicU64,
    prompt_computed: AtomicU64,
    /// Copied drafts by source, proposed and accepted: [prediction, lookup].
    copied: [AtomicU64; 2],
    copied_accepted: [AtomicU64; 2],
    /// Verify calls answered under each rule: `ratio`, `match`.
    calls_by_rule: [AtomicU64; 2],
    ahead_drafted: AtomicU64,
    ahead_used: AtomicU64,
    /// Seconds where the generations' time went (SpadeTiming, summed).
    timing: Mutex<SpadeTiming>,
    ttft: Mutex<Histogram>,
    tokens_per_second: Mutex<Histogram>,
    verify_latency: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            degraded: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            verify_calls: AtomicU64::new(0),
            drafted: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            prompt_cached: AtomicU64::new(0),
            prompt_computed: AtomicU64::new(0),
            copied: Default::default(),
            copied_accepted: Default::default(),
            calls_by_rule: Default::default(),
            ahead_drafted: AtomicU64::new(0),
            ahead_used: AtomicU64::new(0),
            timing: Mutex::default(),
            ttft: Mutex::new(Histogram::new(SECONDS)),
            tokens_per_second: Mutex::new(Histogram::new(TOKENS_PER_SECOND)),
            verify_latency: Mutex::new(Histogram::new(SECONDS)),
        }
    }
}

fn observe(h: &Mutex<Histogram>, v: f64) {
    h.lock().unwrap_or_else(|p| p.into_inner()).observe(v);
}

impl Metrics {
    pub fn record_request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_verify_latency(&self, latency: Duration) {
        observe(&self.verify_latency, latency.as_secs_f64());
    }

    pub fn record_generation(&self, r: &GenerationRecord) {
        let add = |a: &AtomicU64, v: u64| a.fetch_add(v, Ordering::Relaxed);
        add(&self.completion_tokens, r.completion_tokens);
        add(&self.verify_calls, r.verify_calls);
        add(&self.drafted, r.drafted);
        add(&self.accepted, r.accepted);
        add(&self.bytes_sent, r.bytes_sent);
        add(&self.bytes_received, r.bytes_received);
        add(&self.degraded, u64::from(r.degraded));
        if let Some(cached) = r.prompt_cached_tokens {
            add(&self.prompt_cached, cached);
            add(&self.prompt_computed, r.prompt_tokens.saturating_sub(cached));
        }
        if let Some(rule) = r.rule {
            add(&self.calls_by_rule[rule as usize], r.verify_calls);
        }
        add(&self.copied[0], r.predicted);
        add(&self.copied_accepted[0], r.predicted_accepted);
        add(&self.copied[1], r.looked_up);
        add(&self.copied_accepted[1], r.looked_up_accepted);
        add(&self.ahead_drafted, r.ahead_drafted);
        add(&self.ahead_used, r.ahead_used);
        {
            let mut t = self.timing.lock().unwrap_or_else(|p| p.into_inner());
            t.draft_s += r.timing.draft_s;
            t.overlap_s += r.timing.overlap_s;
            t.link_s += r.timing.link_s;
            t.verifier_s += r.timing.verifier_s;
        }
        if let Some(ttft) = r.ttft {
            observe(&self.ttft, ttft.as_secs_f64());
        }
        if r.completion_tokens > 0 && !r.duration.is_zero() {
            observe(&self.tokens_per_second, r.completion_tokens as f64 / r.duration.as_secs_f64());
        }
    }

    /// `draft`: the draft model's context positions, cached and computed (None before it is loaded);
    /// `auto`: what a generation with `auto` draft length would start from now.
    pub fn render(&self, draft: Option<ContextRows>, auto: &DraftChoice) -> String {
        let ready = draft.is_some();
        let draft = draft.unwrap_or_default();
        let mut out = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut counter =
            |name: &str, help: &str, v: u64| render_scalar(&mut out, "counter", name, help, v);
        counter(
            "spade_gateway_requests_total",
            "Chat completion requests received.",
            load(&self.requests),
        );
        counter(
            "spade_gateway_request_failures_total",
            "Requests that ended in an error (before or during the stream).",
            load(&self.failures),
        );
        counter(
            "spade_gateway_degraded_total",
            "Generations finished by the draft model alone (verifier unreachable).",
            load(&self.degraded),
        );
        counter(
            "spade_gateway_completion_tokens_total",
            "Tokens generated.",
            load(&self.completion_tokens),
        );
        counter(
            "spade_gateway_verify_calls_total",
            "Verify calls made (target forward passes paid for).",
            load(&self.verify_calls),
        );
        // Target-only decoding pays one call per token: every token beyond one per call is a call saved.
        let saved = load(&self.completion_tokens).saturating_sub(load(&self.verify_calls));
        counter(
            "spade_gateway_verify_calls_saved_total",
            "Target forward passes saved versus target-only decoding.",
            saved,
        );
        counter(
            "spade_gateway_spec_decode_num_draft_tokens_total",
            "Draft tokens sent for verification.",
            load(&self.drafted),
        );
        counter(
            "spade_gateway_spec_decode_num_accepted_tokens_total",
            "Draft tokens the target accepted.",
            load(&self.accepted),
        );
        for (source, i) in [("prediction", 0), ("lookup", 1)] {
            counter(
                &format!("spade_gateway_copied_{source}_tokens_total"),
                "Draft tokens copied from the request's prediction (prediction) or the context (lookup).",
                load(&self.copied[i]),
            );
            counter(
                &format!("spade_gateway_copied_{source}_accepted_tokens_total"),
                "Copied draft tokens the target accepted.",
                load(&self.copied_accepted[i]),
            );
        }
        counter(
            "spade_gateway_bytes_sent_total",
            "Bytes of /verify requests.",
            load(&self.bytes_sent),
        );
        counter(
            "spade_gateway_bytes_received_total",
            "Bytes of /verify answers.",
            load(&self.bytes_received),
        );
        counter(
            "spade_gateway_prompt_tokens_cached_total",
            "Prompt tokens the verifier did not recompute (its prefix cache held them).",
            load(&self.prompt_cached),
        );
        counter(
            "spade_gateway_prompt_tokens_computed_total",
            "Prompt tokens the verifier computed.",
            load(&self.prompt_computed),
        );
        counter(
            "spade_gateway_draft_context_tokens_cached_total",
            "Context positions the draft model's rounds took from its prefix cache.",
            draft.cached,
        );
        counter(
            "spade_gateway_draft_context_tokens_computed_total",
            "Context positions the draft model's rounds computed (its prefill of what is new).",
            draft.computed,
        );
        counter(
            "spade_gateway_draft_ahead_rounds_total",
            "Rounds that drafted ahead while a block was verified.",
            load(&self.ahead_drafted),
        );
        counter(
            "spade_gateway_draft_ahead_used_total",
            "Drafted-ahead blocks sent (the verifier confirmed their prefix).",
            load(&self.ahead_used),
        );
        let timing = self.timing.lock().unwrap_or_else(|p| p.into_inner()).clone();
        render_labeled(
            &mut out,
            "counter",
            "spade_gateway_verify_calls_by_rule_total",
            "Verify calls by the rule the verifier judged them with: ratio (min(1, p/q)) or match (the target's own samples).",
            "rule",
            [AcceptRule::Ratio, AcceptRule::Match]
                .map(|r| (r.to_string(), load(&self.calls_by_rule[r as usize]))),
        );
        let mut seconds =
            |name: &str, help: &str, v: f64| render_scalar(&mut out, "counter", name, help, v);
        seconds(
            "spade_gateway_draft_seconds_total",
            "Drafting that generations waited for.",
            timing.draft_s,
        );
        seconds(
            "spade_gateway_draft_overlap_seconds_total",
            "Drafting hidden under verify calls (draft-ahead).",
            timing.overlap_s,
        );
        seconds(
            "spade_gateway_link_seconds_total",
            "Verify calls minus the verifier's reported time: the link, both ways.",
            timing.link_s,
        );
        seconds(
            "spade_gateway_verifier_seconds_total",
            "The verifier's reported time (queue and forward passes).",
            timing.verifier_s,
        );
        let mut gauge =
            |name: &str, help: &str, v: f64| render_scalar(&mut out, "gauge", name, help, v);
        gauge(
            "spade_gateway_auto_draft_len",
            "Draft length `auto` would choose now for a block drafted after a call.",
            auto.draft as f64,
        );
        gauge(
            "spade_gateway_auto_draft_ahead_len",
            "Draft length `auto` would choose now for a block drafted ahead during a call (0: none).",
            auto.draft_ahead as f64,
        );
        gauge(
            "spade_gateway_auto_expected_tokens_per_second",
            "Its expected committed tokens per second.",
            auto.tokens_per_s,
        );
        gauge(
            "spade_gateway_auto_link_rtt_seconds",
            "Estimated link round trip (call latency minus verifier time).",
            auto.rtt_s,
        );
        gauge(
            "spade_gateway_auto_draft_step_seconds",
            "Estimated draft model time per token.",
            auto.t_draft_s,
        );
        gauge(
            "spade_gateway_auto_verify_base_seconds",
            "Estimated verifier time per call, fixed part (a in a + b * rows).",
            auto.verify_a_s,
        );
        gauge(
            "spade_gateway_auto_verify_row_seconds",
            "Estimated verifier time per scored row (b).",
            auto.verify_b_s,
        );
        gauge("spade_gateway_auto_acceptance", "Estimated acceptance of a draft given all before it were accepted, over every position.", auto.acceptance);
        gauge(
            "spade_gateway_auto_first_acceptance",
            "Acceptance of the first draft position as the length is chosen with (leaning on the pooled one, read optimistically).",
            auto.alpha.first().copied().unwrap_or(0.0),
        );
        gauge(
            "spade_gateway_auto_ahead_match",
            "Estimated probability that the drafted-ahead guess matches the verifier's token.",
            auto.beta,
        );
        let drafted = load(&self.drafted);
        let rate = if drafted == 0 { 0.0 } else { load(&self.accepted) as f64 / drafted as f64 };
        render_scalar(
            &mut out,
            "gauge",
            "spade_gateway_acceptance_rate",
            "Accepted over drafted tokens since start.",
            rate,
        );
        render_scalar(
            &mut out,
            "gauge",
            "spade_gateway_ready",
            "1 when the draft model is loaded.",
            u8::from(ready),
        );
        let lock = |h: &Mutex<Histogram>| h.lock().unwrap_or_else(|p| p.into_inner()).clone();
        lock(&self.ttft).render(
            &mut out,
            "spade_gateway_time_to_first_token_seconds",
            "Time from request to the first streamed text.",
        );
        lock(&self.tokens_per_second).render(
            &mut out,
            "spade_gateway_tokens_per_second",
            "Generated tokens per second of each request.",
        );
        lock(&self.verify_latency).render(
            &mut out,
            "spade_gateway_verify_latency_seconds",
            "Round trip of each successful verify call.",
        );
        out
    }
}
