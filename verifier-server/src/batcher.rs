//! Continuous batching: one scoring thread runs forward passes back to back, and the calls that
//! arrive while a pass runs join the next one.
//!
//! Each call brings its session (held: no other call of that session can run meanwhile) and the
//! sequence to score. Every pass takes the rows spade-core's [`plan_pass`] gives each waiting call,
//! oldest first, within the row and session limits; long prefills advance by chunks while others
//! wait. The scorer's batched pass is bit-identical to scoring each call alone, so a call's answer
//! does not depend on what it was batched with.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spade_core::batching::{plan_pass, PassLimits, Waiting};
use spade_engine::{BatchJob, EngineError, Logits, Scorer};
use tokio::sync::{oneshot, OwnedMutexGuard};

use crate::metrics::Metrics;
use crate::sessions::Session;

/// A finished call: its session back, the logits of its last `n_logits` positions, and how long it
/// waited for its first pass and then took to score.
pub struct Scored {
    pub session: OwnedMutexGuard<Session>,
    pub logits: Result<Logits, EngineError>,
    pub queued: Duration,
    pub forward: Duration,
}

struct Call {
    session: OwnedMutexGuard<Session>,
    tokens: Vec<u32>,
    n_logits: usize,
    arrived: Instant,
    first_pass: Option<Instant>,
    reply: oneshot::Sender<Scored>,
}

/// The handle calls are sent through; the scoring thread ends when the last handle is dropped.
pub struct Batcher {
    calls: mpsc::Sender<Call>,
}

impl Batcher {
    pub fn start(scorer: Arc<dyn Scorer>, limits: PassLimits, metrics: Arc<Metrics>) -> std::io::Result<Self> {
        let (calls, queue) = mpsc::channel();
        std::thread::Builder::new().name("spade-batcher".into()).spawn(move || run(scorer.as_ref(), &limits, &metrics, &queue))?;
        Ok(Self { calls })
    }

    /// Scores `tokens` in `session`, returning the logits of the last `n_logits` positions.
    pub async fn score(&self, session: OwnedMutexGuard<Session>, tokens: Vec<u32>, n_logits: usize) -> Result<Scored, EngineError> {
        let (reply, answer) = oneshot::channel();
        let call = Call { session, tokens, n_logits, arrived: Instant::now(), first_pass: None, reply };
        self.calls.send(call).map_err(|_| EngineError::Drafter("the scoring thread has stopped".into()))?;
        answer.await.map_err(|_| EngineError::Drafter("the scoring thread dropped the call".into()))
    }
}

fn run(scorer: &dyn Scorer, limits: &PassLimits, metrics: &Metrics, queue: &mpsc::Receiver<Call>) {
    let mut waiting: VecDeque<Call> = VecDeque::new();
    loop {
        if waiting.is_empty() {
            match queue.recv() {
                Ok(call) => waiting.push_back(call),
                Err(_) => return,
            }
        }
        waiting.extend(queue.try_iter());
        // A caller that went away no longer needs its rows (its session is released with it).
        waiting.retain(|call| !call.reply.is_closed());
        if waiting.is_empty() {
            continue;
        }
        let shapes: Vec<Waiting> =
            waiting.iter().map(|c| Waiting { pending: c.session.score.rows_to_score(&c.tokens, c.n_logits), tail: c.n_logits }).collect();
        let plan = plan_pass(&shapes, limits);
        let started = Instant::now();
        let mut joined: Vec<usize> = Vec::new();
        let mut jobs: Vec<BatchJob<'_>> = Vec::new();
        for (i, (call, &rows)) in waiting.iter_mut().zip(&plan).enumerate() {
            if rows > 0 {
                call.first_pass.get_or_insert(started);
                joined.push(i);
                jobs.push(BatchJob { session: call.session.score.as_mut(), tokens: &call.tokens, n_logits: call.n_logits, rows });
            }
        }
        let results = scorer.score_batch(&mut jobs);
        drop(jobs);
        metrics.record_pass(joined.len(), plan.iter().sum(), started.elapsed());
        // Finished calls leave the queue; the others keep their place for the next pass.
        let mut finished: Vec<(usize, Result<Logits, EngineError>)> = Vec::new();
        for (i, result) in joined.into_iter().zip(results) {
            match result {
                Ok(None) => {}
                Ok(Some(logits)) => finished.push((i, Ok(logits))),
                Err(e) => finished.push((i, Err(e))),
            }
        }
        let done = Instant::now();
        for (i, logits) in finished.into_iter().rev() {
            let call = waiting.remove(i).expect("a planned call is in the queue");
            let first = call.first_pass.unwrap_or(started);
            let scored = Scored { session: call.session, logits, queued: first - call.arrived, forward: done - first };
            // The caller may be gone; its session is then released here.
            let _ = call.reply.send(scored);
        }
    }
}
