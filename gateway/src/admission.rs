//! The gateway's bound on work. All generations share one draft engine, so past a few at once more
//! only divides its speed (32 concurrent streams finished at about one stream's rate in all): a
//! burst must become a fast, retryable refusal, not unbounded latency.
//!
//! `--max-running` generations run at once; up to `--max-queued` requests wait for a place, each
//! for at most `--queue-timeout-secs`. Past either bound the answer is 429 `rate_limit_exceeded` with
//! `retry-after` (and `retry-after-ms`, jittered, which the OpenAI SDKs read first, so refused clients
//! do not all come back at once): the SDKs retry it by themselves. Places go first come, first served
//! (tokio's semaphore is fair, and a request that has to wait never overtakes one already waiting).
//! A waiting request whose client hangs up is dropped by the server, and its place in line with it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spade_core::metrics::{render_labeled, render_scalar};
use spade_core::Histogram;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

/// Why a request was refused: a label of `spade_gateway_requests_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `--max-queued` requests were waiting already.
    QueueFull,
    /// It waited `--queue-timeout-secs` without a place.
    QueueTimeout,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::QueueTimeout => "queue_timeout",
        }
    }
}

pub struct Admission {
    places: Arc<Semaphore>,
    max_running: u32,
    max_queued: usize,
    queue_timeout: Duration,
    queued: Arc<AtomicUsize>,
    /// Seconds a place is held, smoothed: what a refused client is told to wait, scaled by the line.
    held_secs: Arc<Mutex<Option<f64>>>,
    refused: [AtomicU64; 2],
    waited: Mutex<Histogram>,
}

/// A request's places; dropping it (the generations ended, failed or were abandoned) frees them.
pub struct Ticket {
    _places: OwnedSemaphorePermit,
    since: Instant,
    held_secs: Arc<Mutex<Option<f64>>>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let secs = self.since.elapsed().as_secs_f64();
        let mut held = self.held_secs.lock().unwrap_or_else(|p| p.into_inner());
        *held = Some(held.map_or(secs, |mean| 0.8 * mean + 0.2 * secs));
    }
}

/// One place in the line, given back when the request stops waiting (admitted, refused or dropped).
struct InLine(Arc<AtomicUsize>);

impl Drop for InLine {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

const WAIT_BOUNDS: &[f64] = &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0];

impl Admission {
    pub fn new(max_running: u32, max_queued: usize, queue_timeout: Duration) -> Self {
        Self {
            places: Arc::new(Semaphore::new(max_running as usize)),
            max_running,
            max_queued,
            queue_timeout,
            queued: Arc::default(),
            held_secs: Arc::default(),
            refused: Default::default(),
            waited: Mutex::new(Histogram::new(WAIT_BOUNDS)),
        }
    }

    /// A place for a request of `choices` generations (at most all places), at once or after
    /// waiting in line; 429 past the line's bounds.
    pub async fn admit(&self, choices: u32) -> Result<Ticket, ApiError> {
        let wanted = choices.clamp(1, self.max_running);
        let arrived = Instant::now();
        let places = match self.places.clone().try_acquire_many_owned(wanted) {
            Ok(places) => places,
            Err(_) => {
                let _in_line = self.join_line().ok_or_else(|| self.refuse(Refusal::QueueFull))?;
                let waited = self.places.clone().acquire_many_owned(wanted);
                match tokio::time::timeout(self.queue_timeout, waited).await {
                    Ok(Ok(places)) => places,
                    Ok(Err(closed)) => return Err(ApiError::Internal(closed.to_string())),
                    Err(_) => return Err(self.refuse(Refusal::QueueTimeout)),
                }
            }
        };
        let waited = arrived.elapsed();
        self.waited.lock().unwrap_or_else(|p| p.into_inner()).observe(waited.as_secs_f64());
        Ok(Ticket { _places: places, since: Instant::now(), held_secs: self.held_secs.clone() })
    }

    fn join_line(&self) -> Option<InLine> {
        self.queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max_queued).then_some(n + 1)
            })
            .ok()
            .map(|_| InLine(self.queued.clone()))
    }

    fn refuse(&self, why: Refusal) -> ApiError {
        self.refused[why as usize].fetch_add(1, Ordering::Relaxed);
        ApiError::Overloaded { why, retry_after: self.retry_after() }
    }

    /// About when a place frees for a newcomer: the mean time a place is held, times the requests
    /// ahead of it per place; between 1 and 60 s (the OpenAI SDKs ignore longer asks).
    fn retry_after(&self) -> Duration {
        let held = self.held_secs.lock().unwrap_or_else(|p| p.into_inner()).unwrap_or(1.0);
        let ahead = self.queued.load(Ordering::SeqCst) as f64 + 1.0;
        Duration::from_secs_f64((held * ahead / f64::from(self.max_running)).clamp(1.0, 60.0))
    }

    /// Requests waiting for a place now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Places held by running generations now.
    pub fn running(&self) -> usize {
        self.max_running as usize - self.places.available_permits()
    }

    pub fn render(&self, out: &mut String) {
        render_scalar(
            out,
            "gauge",
            "spade_gateway_generations_running",
            "Places held by running generations (at most --max-running).",
            self.running(),
        );
        render_scalar(
            out,
            "gauge",
            "spade_gateway_requests_queued",
            "Requests waiting for a place (at most --max-queued).",
            self.queued(),
        );
        render_labeled(
            out,
            "counter",
            "spade_gateway_requests_refused_total",
            "Requests refused with 429: the line was full, or the wait reached --queue-timeout-secs.",
            "reason",
            [Refusal::QueueFull, Refusal::QueueTimeout]
                .map(|r| (r.label().to_string(), self.refused[r as usize].load(Ordering::Relaxed))),
        );
        self.waited.lock().unwrap_or_else(|p| p.into_inner()).render(
            out,
            "spade_gateway_queue_wait_seconds",
            "Seconds an admitted request waited for its place.",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(running: u32, queued: usize, timeout_ms: u64) -> Arc<Admission> {
        Arc::new(Admission::new(running, queued, Duration::from_millis(timeout_ms)))
    }

    fn refusal(result: Result<Ticket, ApiError>) -> Option<Refusal> {
        match result {
            Err(ApiError::Overloaded { why, .. }) => Some(why),
            _ => None,
        }
    }

    #[tokio::test]
    async fn past_the_places_and_the_line_requests_are_refused_at_once() {
        let a = admission(2, 1, 60_000);
        let _first = a.admit(1).await.unwrap();
        let _second = a.admit(1).await.unwrap();
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.admit(1).await.map(|_| ()) }
        });
        while a.queued() == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        assert_eq!(refusal(a.admit(1).await), Some(Refusal::QueueFull));
        assert!(started.elapsed() < Duration::from_millis(50));
        drop(_first);
        waiting.await.unwrap().unwrap();
        assert_eq!(a.queued(), 0);
    }

    #[tokio::test]
    async fn a_wait_past_the_limit_is_refused() {
        let a = admission(1, 4, 50);
        let _held = a.admit(1).await.unwrap();
        assert_eq!(refusal(a.admit(1).await), Some(Refusal::QueueTimeout));
        assert_eq!(a.queued(), 0);
    }

    #[tokio::test]
    async fn places_go_first_come_first_served() {
        let a = admission(1, 8, 60_000);
        let held = a.admit(1).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for i in 0..5 {
            let (line, order) = (a.clone(), order.clone());
            waiting.push(tokio::spawn(async move {
                let _ticket = line.admit(1).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::task::yield_now().await;
            }));
            while a.queued() < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        for w in waiting {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn a_dropped_waiter_leaves_the_line() {
        let a = admission(1, 1, 60_000);
        let _held = a.admit(1).await.unwrap();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.admit(1).await.map(|_| ()) }
        });
        while a.queued() == 0 {
            tokio::task::yield_now().await;
        }
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(a.queued(), 0);
        // Its place in line is free again: the next request waits instead of being refused.
        let next = tokio::time::timeout(Duration::from_millis(50), a.admit(1)).await;
        assert!(next.is_err(), "the next request should have waited");
    }

    #[tokio::test]
    async fn a_request_of_many_choices_takes_as_many_places() {
        let a = admission(4, 0, 1000);
        let three = a.admit(3).await.unwrap();
        assert_eq!(a.running(), 3);
        assert_eq!(refusal(a.admit(2).await), Some(Refusal::QueueFull));
        drop(three);
        let all = a.admit(16).await.unwrap();
        assert_eq!(a.running(), 4);
        drop(all);
    }
}
