//! Continuous batching: one scoring thread runs forward passes back to back, and the calls that
//! arrive while a pass runs join the next one.
//!
//! Each call brings its session (held: no other call of that session can run meanwhile) and the
//! sequence to score. Every pass takes the rows spade-core's [`plan_pass`] gives each waiting call,
//! oldest first, within the row and session limits; long prefills advance by chunks while others
//! wait. The scorer's batched pass is bit-identical to scoring each call alone, so a call's answer
//! does not depend on what it was batched with.
//!
//! The thread also keeps the backlog (rows still to score) and what a row costs, so a call that
//! brings a long prompt can be told to come back later ([`Batcher::admit`]) instead of waiting
//! behind minutes of other prompts until its caller gives up; prompts told so are then taken in the
//! order they were first turned away.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use spade_core::batching::{admit, plan_pass, PassLimits, PassTimes, PromptLine, RowCost, Waiting};
use spade_engine::{BatchJob, EngineError, Logits, ScoreSession, Scorer};
use tokio::sync::{oneshot, OwnedMutexGuard};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::sessions::Session;

/// A finished call: its session back, the logits of its last `logit_rows` positions, and how long it
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
    logit_rows: usize,
    /// Rows still to score: counted once, when the call was admitted, then less what each pass
    /// scored (the sum over calls is [`Load::rows`]).
    left: usize,
    arrived: Instant,
    first_pass: Option<Instant>,
    reply: oneshot::Sender<Scored>,
}

/// What the scoring thread and the handlers share: the rows every call sent and not yet answered
/// still needs, what a row costs, and what a pass of one call's block costs by its rows.
#[derive(Default)]
pub struct Load {
    rows: AtomicUsize,
    cost: Mutex<RowCost>,
    pass_times: Mutex<PassTimes>,
}

impl Load {
    /// Seconds the rows waiting now take to score at the measured cost (0 before the first pass).
    pub fn backlog_seconds(&self) -> f64 {
        self.rows.load(Ordering::SeqCst) as f64 * self.row_cost().seconds_per_row().unwrap_or(0.0)
    }

    /// A pass of one call's block by rows, in milliseconds (`/v1/info`'s `pass_ms`).
    pub fn pass_ms(&self) -> Vec<f64> {
        self.pass_times.lock().unwrap_or_else(|p| p.into_inner()).milliseconds()
    }

    fn row_cost(&self) -> RowCost {
        *self.cost.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows leave the backlog: scored, or their call ended.
    fn remove(&self, rows: usize) {
        self.rows.fetch_sub(rows, Ordering::SeqCst);
    }
}

/// A call [`Batcher::admit`] took: the rows it adds to the backlog.
pub struct Joining {
    rows: usize,
}

/// The handle calls are sent through; the scoring thread ends when the last handle is dropped.
pub struct Batcher {
    calls: mpsc::Sender<Call>,
    limits: PassLimits,
    max_backlog_secs: f64,
    /// Prompts turned away, first come, first served.
    line: Mutex<PromptLine>,
    pub load: Arc<Load>,
    /// Finished only if the thread panicked (it otherwise outlives every handle): `/health/live`.
    thread: std::thread::JoinHandle<()>,
}

impl Batcher {
    /// `pass_times`: the block sizes timed at start-up, which passes of one call go on updating.
    pub fn start(
        scorer: Arc<dyn Scorer>,
        limits: PassLimits,
        max_backlog_secs: f64,
        metrics: Arc<Metrics>,
        pass_times: PassTimes,
    ) -> std::io::Result<Self> {
        let (calls, queue) = mpsc::channel();
        let load = Arc::new(Load { pass_times: Mutex::new(pass_times), ..Load::default() });
        let shared = load.clone();
        let thread = std::thread::Builder::new()
            .name("spade-batcher".into())
            .spawn(move || run(scorer.as_ref(), &limits, &metrics, &shared, &queue))?;
        Ok(Self { calls, limits, max_backlog_secs, line: Mutex::default(), load, thread })
    }

    /// Whether the scoring thread still runs: it ends only by panicking while a handle exists.
    pub fn is_running(&self) -> bool {
        !self.thread.is_finished()
    }

    /// Whether a call of session `session_id` scoring `tokens` in `session` (the last `logit_rows` with
    /// logits) may join now: spade-core's [`admit`] against the current backlog plus the prompts turned
    /// away before it ([`PromptLine`]), else 429 `verifier_busy`.
    pub fn admit(
        &self,
        session_id: Option<&str>,
        session: &dyn ScoreSession,
        tokens: &[u32],
        logit_rows: usize,
    ) -> Result<Joining, ApiError> {
        let call = Waiting { pending: session.rows_to_score(tokens, logit_rows), logit_rows };
        // One reading of the backlog and the cost serves both the decision and its message.
        let (backlog, cost) = (self.load.rows.load(Ordering::SeqCst), self.load.row_cost());
        let mut line = self.line.lock().unwrap_or_else(|p| p.into_inner());
        let decide =
            |ahead: usize| admit(call, backlog + ahead, &cost, &self.limits, self.max_backlog_secs);
        match line.take_turn(session_id, call.pending, Instant::now(), decide) {
            Ok(()) => Ok(Joining { rows: call.pending }),
            Err(retry_after) => Err(ApiError::Busy {
                retry_after,
                backlog_secs: backlog as f64 * cost.seconds_per_row().unwrap_or(0.0),
            }),
        }
    }

    /// Prompts turned away that keep their place in the line.
    pub fn prompts_in_line(&self) -> usize {
        self.line.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Scores `tokens` in `session`, returning the logits of the last `logit_rows` positions.
    pub async fn score(
        &self,
        joining: Joining,
        session: OwnedMutexGuard<Session>,
        tokens: Vec<u32>,
        logit_rows: usize,
    ) -> Result<Scored, EngineError> {
        let (reply, answer) = oneshot::channel();
        let left = joining.rows;
        let call = Call {
            session,
            tokens,
            logit_rows,
            left,
            arrived: Instant::now(),
            first_pass: None,
            reply,
        };
        self.load.rows.fetch_add(left, Ordering::SeqCst);
        if self.calls.send(call).is_err() {
            self.load.remove(left);
            return Err(EngineError::Drafter("the scoring thread has stopped".into()));
        }
        answer.await.map_err(|_| EngineError::Drafter("the scoring thread dropped the call".into()))
    }
}

fn run(
    scorer: &dyn Scorer,
    limits: &PassLimits,
    metrics: &Metrics,
    load: &Load,
    queue: &mpsc::Receiver<Call>,
) {
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
        waiting.retain(|call| {
            let gone = call.reply.is_closed();
            if gone {
                load.remove(call.left);
            }
            !gone
        });
        if waiting.is_empty() {
            continue;
        }
        let shapes: Vec<Waiting> =
            waiting.iter().map(|c| Waiting { pending: c.left, logit_rows: c.logit_rows }).collect();
        let plan = plan_pass(&shapes, limits);
        let started = Instant::now();
        let mut joined: Vec<usize> = Vec::new();
        let mut jobs: Vec<BatchJob<'_>> = Vec::new();
        for (i, (call, &rows)) in waiting.iter_mut().zip(&plan).enumerate() {
            if rows > 0 {
                call.first_pass.get_or_insert(started);
                joined.push(i);
                jobs.push(BatchJob {
                    session: call.session.score.as_mut(),
                    tokens: &call.tokens,
                    logit_rows: call.logit_rows,
                    rows,
                });
            }
        }
        let results = scorer.score_batch(&mut jobs);
        drop(jobs);
        let (rows, elapsed) = (plan.iter().sum(), started.elapsed());
        metrics.record_pass(joined.len(), rows, elapsed);
        load.cost.lock().unwrap_or_else(|p| p.into_inner()).observe(rows, elapsed.as_secs_f64());
        if joined.len() == 1 {
            load.pass_times
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .observe(rows, elapsed.as_secs_f64());
        }
        for (call, &rows) in waiting.iter_mut().zip(&plan) {
            call.left -= rows;
        }
        load.remove(rows);
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
            // Nothing, unless scoring failed part way.
            load.remove(call.left);
            let first = call.first_pass.unwrap_or(started);
            let scored = Scored {
                session: call.session,
                logits,
                queued: first - call.arrived,
                forward: done - first,
            };
            // The caller may be gone; its session is then released here.
            let _ = call.reply.send(scored);
        }
    }
}
