//! Which rows of which waiting calls go into the verifier's next forward pass.
//!
//! A call finishes in the pass that scores its last rows, which must all come together: the rows
//! that need logits (its draft block and the position after it) cannot be split. Each pass holds
//! at most `max_rows` positions and `max_sessions` calls, filled in this order:
//!
//! 1. the oldest long call (a prefill: more rows left than `prefill_chunk`) has one chunk set
//!    aside, so it always advances;
//! 2. short calls (decode blocks), oldest first, get all their rows;
//! 3. the other long calls, oldest first, get a chunk each from what is left.
//!
//! So a long prompt delays the others' blocks by one chunk's compute per pass instead of by its
//! whole length, and no call waits forever. A call alone takes whole passes; with `max_sessions`
//! 1 calls are served one at a time, oldest first, each to its end.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::pass_times::{Gains, PacedTimes};

/// One waiting call, in arrival order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Positions still to score.
    pub pending: usize,
    /// The last of them, which need logits and so go in one pass (at least 1).
    pub logit_rows: usize,
}

/// The bounds of one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassLimits {
    pub max_rows: usize,
    pub max_sessions: usize,
    pub prefill_chunk: usize,
}

impl PassLimits {
    /// Whether every call whose logit rows are at most `max_logit_rows` can be served.
    pub fn check(&self, max_logit_rows: usize) -> Result<(), String> {
        if self.max_sessions == 0 || self.prefill_chunk == 0 {
            return Err("a pass needs room for at least one session and one row".into());
        }
        let need = 2 * self.prefill_chunk.max(max_logit_rows);
        if self.max_rows < need {
            return Err(format!("{} rows per pass leave no room for a prefill chunk beside a block of {max_logit_rows} positions (at least {need})", self.max_rows));
        }
        Ok(())
    }
}

/// Rows each waiting call scores in the next pass (0: it waits), in the order given. Every call
/// gets either all its pending rows or at most `pending - logit_rows`, and the oldest call always gets
/// some when the limits pass [`PassLimits::check`].
pub fn plan_pass(waiting: &[Waiting], limits: &PassLimits) -> Vec<usize> {
    let mut plan = vec![0; waiting.len()];
    if limits.max_sessions == 1 || waiting.len() == 1 {
        if let (Some(first), Some(rows)) = (waiting.first(), plan.first_mut()) {
            *rows = rows_within(first, limits.max_rows, limits.max_rows);
        }
        return plan;
    }
    let cap = |c: &Waiting| limits.prefill_chunk.max(c.logit_rows);
    let is_long = |c: &Waiting| c.pending > cap(c);
    let mut budget = limits.max_rows;
    let mut sessions = 0;
    let mut take = |rows: &mut usize, call: &Waiting, budget: &mut usize| {
        if sessions < limits.max_sessions {
            *rows = rows_within(call, cap(call), *budget);
            if *rows > 0 {
                *budget -= *rows;
                sessions += 1;
            }
        }
    };
    let oldest_long = waiting.iter().position(is_long);
    if let Some(i) = oldest_long {
        take(&mut plan[i], &waiting[i], &mut budget);
    }
    for (rows, call) in plan.iter_mut().zip(waiting) {
        if !is_long(call) && call.pending <= budget {
            take(rows, call, &mut budget);
        }
    }
    for (i, (rows, call)) in plan.iter_mut().zip(waiting).enumerate() {
        if is_long(call) && Some(i) != oldest_long {
            take(rows, call, &mut budget);
        }
    }
    plan
}

/// All of the call's pending rows if they fit in `cap` and `budget`, else as many as fit short of
/// its logit rows.
fn rows_within(call: &Waiting, cap: usize, budget: usize) -> usize {
    let logit_rows = call.logit_rows.clamp(1, call.pending.max(1));
    if call.pending <= cap.min(budget) {
        call.pending
    } else {
        (call.pending - logit_rows).min(cap).min(budget)
    }
}

/// What one forward row costs, learned from passes: a decayed average weighted by rows, so the
/// large passes a backlog drains in count most, and a slower or faster machine shows within a few
/// passes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowCost {
    seconds: f64,
    rows: f64,
}

impl RowCost {
    /// Weight kept by the past at each pass.
    const KEEP: f64 = 0.9;

    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if rows > 0 && seconds.is_finite() && seconds >= 0.0 {
            self.seconds = self.seconds * Self::KEEP + seconds;
            self.rows = self.rows * Self::KEEP + rows as f64;
        }
    }

    /// Seconds per row; none before the first pass.
    pub fn seconds_per_row(&self) -> Option<f64> {
        (self.rows > 0.0).then(|| self.seconds / self.rows)
    }
}

/// The verifier's time for a forward pass of `rows` rows for one call, by `rows`: timed at start-up for each
/// size up to a bound (the blocks gateways draft), then moved by every pass that scored one call alone. It is
/// published in `/v1/info` ([`crate::protocol::ModelInfo::pass_ms`]), where a gateway's draft-length model
/// takes it as its prior of the verifier's cost ([`crate::draft_control::Estimates::seed_verifier_passes`]):
/// a CPU verifier's block costs nearly a step per row, a GPU's about one step whatever its rows, and a
/// fresh gateway that assumes either spends its first rounds on the wrong length. A pass moves the
/// host's pace, which every size shares, and its own size's time by less ([`crate::pass_times`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PassTimes {
    times: PacedTimes,
    /// Sizes timed at start-up: `1..=sizes`; passes of others are not tracked.
    sizes: usize,
}

impl PassTimes {
    /// A pass moves the pace a tenth of the way (one slow pass on a shared host), its size's own time a
    /// fiftieth; every pass is believed in full.
    const GAINS: Gains = Gains { pace: 0.1, shape: 0.02, max_ratio: f64::INFINITY };

    /// From start-up timings, entry `i` of `i + 1` rows; sizes past them are never tracked.
    pub fn new(calibrated: &[Duration]) -> Self {
        let mut times = PacedTimes::new(Self::GAINS);
        for (i, time) in calibrated.iter().enumerate() {
            times.observe(i + 1, time.as_secs_f64());
        }
        Self { times, sizes: calibrated.len() }
    }

    /// A pass of `rows` rows that scored one call took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if (1..=self.sizes).contains(&rows) {
            self.times.observe(rows, seconds);
        }
    }

    /// Milliseconds, entry `i` for `i + 1` rows (0 for a size timed at zero, which is not tracked).
    pub fn milliseconds(&self) -> Vec<f64> {
        (1..=self.sizes).map(|rows| self.times.get(rows).map_or(0.0, |s| s * 1e3)).collect()
    }
}

impl Default for PassTimes {
    fn default() -> Self {
        Self::new(&[])
    }
}

/// Whether the verifier takes `call` now, with `backlog_rows` rows of earlier calls still to score;
/// otherwise the seconds to wait before asking again (at least 1: a `retry-after`).
///
/// Decode blocks (at most one prefill chunk beyond the rows that need logits) always join: they
/// belong to generations already running, which [`plan_pass`] serves first, so they cost the
/// others little. A longer call (a new prompt, a resent context) joins only while the backlog
/// drains within `max_backlog_secs` by the measured row cost, so every call taken finishes in
/// about that time plus its own rows, instead of all of them timing out behind a queue of
/// prompts. Before the first pass the cost is unknown and every call joins; `max_backlog_secs`
/// 0 turns the check off.
pub fn admit(
    call: Waiting,
    backlog_rows: usize,
    cost: &RowCost,
    limits: &PassLimits,
    max_backlog_secs: f64,
) -> Result<(), u64> {
    let prefill = call.pending.saturating_sub(call.logit_rows);
    let Some(per_row) = cost.seconds_per_row() else { return Ok(()) };
    if max_backlog_secs <= 0.0 || prefill <= limits.prefill_chunk {
        return Ok(());
    }
    let backlog_secs = backlog_rows as f64 * per_row;
    if backlog_secs <= max_backlog_secs {
        Ok(())
    } else {
        Err(((backlog_secs - max_backlog_secs).ceil() as u64).max(1))
    }
}

/// Most prompts [`PromptLine`] keeps a place for; later ones are turned away without one.
const LINE_PLACES: usize = 4096;
/// How long a prompt keeps its place without asking again: 1.5 times its `retry-after` (callers add
/// jitter to it, the gateway up to 20%) plus 5 s. A caller that has not come back by then has given up.
fn place_expires(now: Instant, retry_after: u64) -> Instant {
    now + Duration::from_secs_f64(1.5 * retry_after as f64 + 5.0)
}

/// Prompts turned away by [`admit`], in the order they were first turned away, so the room a draining
/// backlog makes goes to them first come, first served: a prompt is taken only while the backlog plus
/// the rows of the prompts waiting before it are within the bound. Without the line, whichever prompt
/// happened to ask first after the backlog drained got in, and one could be turned away for minutes
/// while later ones were taken. A place is kept by session id; a call without one waits behind every
/// prompt in the line and keeps no place.
#[derive(Debug, Default)]
pub struct PromptLine {
    places: VecDeque<Place>,
}

#[derive(Debug)]
struct Place {
    session: String,
    rows: usize,
    /// When the place is given up unless its caller asks again.
    expires: Instant,
}

impl PromptLine {
    /// `decide` (usually [`admit`]) for a call of `session` bringing `pending` rows, given the rows of
    /// the prompts waiting before it (to be added to the backlog); a call turned away keeps (or takes)
    /// its place, one taken leaves the line.
    pub fn take_turn(
        &mut self,
        session: Option<&str>,
        pending: usize,
        now: Instant,
        decide: impl FnOnce(usize) -> Result<(), u64>,
    ) -> Result<(), u64> {
        self.places.retain(|p| p.expires > now);
        let at = session.and_then(|s| self.places.iter().position(|p| p.session == s));
        let ahead: usize =
            self.places.iter().take(at.unwrap_or(self.places.len())).map(|p| p.rows).sum();
        let answer = decide(ahead);
        match (answer, at, session) {
            (Ok(()), Some(i), _) => {
                self.places.remove(i);
            }
            (Err(retry_after), Some(i), _) => {
                self.places[i].rows = pending;
                self.places[i].expires = place_expires(now, retry_after);
            }
            (Err(retry_after), None, Some(session)) if self.places.len() < LINE_PLACES => {
                self.places.push_back(Place {
                    session: session.to_owned(),
                    rows: pending,
                    expires: place_expires(now, retry_after),
                });
            }
            _ => {}
        }
        answer
    }

    /// Prompts waiting for their turn.
    pub fn len(&self) -> usize {
        self.places.len()
    }

    pub fn is_empty(&self) -> bool {
        self.places.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: PassLimits = PassLimits { max_rows: 64, max_sessions: 8, prefill_chunk: 16 };

    fn call(pending: usize, logit_rows: usize) -> Waiting {
        Waiting { pending, logit_rows }
    }

    /// Every plan keeps the invariants, for many queues.
    fn check_plan(waiting: &[Waiting], limits: &PassLimits) -> Vec<usize> {
        let plan = plan_pass(waiting, limits);
        assert!(plan.iter().sum::<usize>() <= limits.max_rows);
        assert!(plan.iter().filter(|&&r| r > 0).count() <= limits.max_sessions);
        for (r, w) in plan.iter().zip(waiting) {
            assert!(*r == w.pending || *r + w.logit_rows <= w.pending, "{r} rows of {w:?}");
        }
        assert!(waiting.is_empty() || plan[0] > 0, "the oldest call waits: {waiting:?}");
        plan
    }

    #[test]
    fn decode_blocks_all_fit_in_one_pass() {
        let waiting = vec![call(5, 5); 8];
        assert_eq!(check_plan(&waiting, &LIMITS), vec![5; 8]);
    }

    #[test]
    fn a_lone_prefill_takes_whole_passes() {
        assert_eq!(check_plan(&[call(500, 5)], &LIMITS), vec![64]);
        assert_eq!(check_plan(&[call(60, 5)], &LIMITS), vec![60]);
        // The last pass holds all the logit rows: 67 rows would leave 3 of the 5 logit rows behind.
        assert_eq!(check_plan(&[call(67, 5)], &LIMITS), vec![62]);
    }

    #[test]
    fn a_prefill_among_decode_blocks_advances_by_chunks() {
        let waiting = [call(500, 5), call(5, 5), call(3, 3), call(17, 17)];
        assert_eq!(check_plan(&waiting, &LIMITS), vec![16, 5, 3, 17]);
        // A block larger than the chunk still goes whole.
        assert_eq!(check_plan(&[call(17, 17), call(5, 5)], &LIMITS), vec![17, 5]);
    }

    #[test]
    fn older_prefills_do_not_starve_newer_decode_blocks() {
        let waiting = [vec![call(100, 5); 6], vec![call(5, 5); 4]].concat();
        assert_eq!(check_plan(&waiting, &LIMITS), vec![16, 16, 12, 0, 0, 0, 5, 5, 5, 5]);
        // Nor do decode blocks starve the oldest prefill.
        let waiting = [vec![call(100, 5)], vec![call(17, 17); 6]].concat();
        assert_eq!(check_plan(&waiting, &LIMITS), vec![16, 17, 17, 0, 0, 0, 0]);
    }

    #[test]
    fn one_session_per_pass_serves_calls_in_order_to_their_end() {
        let one = PassLimits { max_sessions: 1, ..LIMITS };
        assert_eq!(check_plan(&[call(100, 5), call(5, 5)], &one), vec![64, 0]);
        assert_eq!(check_plan(&[call(36, 5), call(5, 5)], &one), vec![36, 0]);
    }

    #[test]
    fn limits_hold_and_later_calls_wait_their_turn() {
        let waiting = vec![call(17, 17); 5];
        assert_eq!(check_plan(&waiting, &LIMITS), vec![17, 17, 17, 0, 0]);
        let waiting = vec![call(2, 2); 10];
        assert_eq!(check_plan(&waiting, &LIMITS), [vec![2; 8], vec![0; 2]].concat());
        // A smaller call behind one that does not fit goes now.
        let waiting = [call(17, 17), call(17, 17), call(17, 17), call(17, 17), call(5, 5)];
        assert_eq!(check_plan(&waiting, &LIMITS), vec![17, 17, 17, 0, 5]);
    }

    #[test]
    fn every_queue_gets_a_valid_plan() {
        let mut seed = 7u64;
        let mut next = |n: usize| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize % n
        };
        for _ in 0..2000 {
            let limits = PassLimits {
                max_rows: 17 + next(150),
                max_sessions: 1 + next(16),
                prefill_chunk: 1 + next(64),
            };
            if limits.check(17).is_err() {
                continue;
            }
            let waiting: Vec<Waiting> = (0..1 + next(20))
                .map(|_| {
                    let logit_rows = 1 + next(17);
                    call(logit_rows + next(300), logit_rows)
                })
                .collect();
            check_plan(&waiting, &limits);
        }
    }

    #[test]
    fn limits_are_checked() {
        assert!(LIMITS.check(17).is_ok());
        assert!(PassLimits { max_rows: 33, ..LIMITS }.check(17).is_err());
        assert!(PassLimits { max_sessions: 0, ..LIMITS }.check(1).is_err());
    }
    #[test]
    fn pass_times_follow_solo_passes_of_the_timed_sizes_only() {
        let ms = Duration::from_millis;
        let mut times = PassTimes::new(&[ms(50), ms(90)]);
        assert_eq!(times.milliseconds(), vec![50.0, 90.0]);
        for bad in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            times.observe(1, bad);
        }
        times.observe(0, 1.0);
        times.observe(3, 1.0);
        assert_eq!(
            times.milliseconds(),
            vec![50.0, 90.0],
            "untimed sizes and nonsense are not learnt"
        );
        // A slower pass of 2 rows moves 1 row's time too, through the pace.
        times.observe(2, 0.1);
        assert!(
            (times.milliseconds()[0] - 50.0 * (1.0 + 0.1 * (100.0 / 90.0 - 1.0))).abs() < 1e-9,
            "{:?}",
            times.milliseconds()
        );
        assert!(PassTimes::default().milliseconds().is_empty());
        assert_eq!(PassTimes::new(&[ms(0), ms(90)]).milliseconds(), vec![0.0, 90.0]);
    }

    #[test]
    fn row_cost_weights_large_passes_and_forgets() {
        let mut cost = RowCost::default();
        assert_eq!(cost.seconds_per_row(), None);
        cost.observe(0, 1.0);
        assert_eq!(cost.seconds_per_row(), None, "an empty pass says nothing");
        cost.observe(1, 0.16);
        cost.observe(64, 4.16);
        let per_row = cost.seconds_per_row().unwrap();
        assert!((per_row - 4.16 / 64.0).abs() < 0.002, "{per_row}");
        // A machine twice as slow from now on shows within a few dozen passes.
        for _ in 0..40 {
            cost.observe(64, 8.32);
        }
        assert!((cost.seconds_per_row().unwrap() - 0.13).abs() < 0.002);
    }

    #[test]
    fn prompts_wait_while_the_backlog_is_long_and_decode_blocks_never_do() {
        let mut cost = RowCost::default();
        let prompt = call(400, 5);
        assert_eq!(admit(prompt, 10_000, &cost, &LIMITS, 20.0), Ok(()), "no cost measured yet");
        cost.observe(10, 1.0);
        // 150 rows at 0.1 s: 15 s of backlog, within 20 s.
        assert_eq!(admit(prompt, 150, &cost, &LIMITS, 20.0), Ok(()));
        // 1,000 rows: 100 s, 80 s over the bound.
        assert_eq!(admit(prompt, 1000, &cost, &LIMITS, 20.0), Err(80));
        assert_eq!(admit(prompt, 201, &cost, &LIMITS, 20.0), Err(1), "at least a second");
        // A decode block, or one with a chunk of catching up, goes in whatever the backlog.
        assert_eq!(admit(call(5, 5), 1000, &cost, &LIMITS, 20.0), Ok(()));
        assert_eq!(admit(call(21, 5), 1000, &cost, &LIMITS, 20.0), Ok(()));
        assert_eq!(admit(call(22, 5), 1000, &cost, &LIMITS, 20.0), Err(80));
        assert_eq!(admit(prompt, 1000, &cost, &LIMITS, 0.0), Ok(()), "0 turns the check off");
    }

    fn turn(
        line: &mut PromptLine,
        session: Option<&str>,
        call: Waiting,
        backlog: usize,
        cost: &RowCost,
        now: Instant,
    ) -> Result<(), u64> {
        line.take_turn(session, call.pending, now, |ahead| {
            admit(call, backlog + ahead, cost, &LIMITS, 20.0)
        })
    }

    #[test]
    fn prompts_turned_away_are_taken_first_come_first_served() {
        let (mut line, mut cost, t0) = (PromptLine::default(), RowCost::default(), Instant::now());
        cost.observe(10, 1.0);
        let prompt = call(100, 5);
        let at = |s: u64| t0 + Duration::from_secs(s);
        // 300 rows (30 s) waiting: a, then b, are turned away and take places in that order.
        assert_eq!(turn(&mut line, Some("a"), prompt, 300, &cost, at(0)), Err(10));
        assert_eq!(
            turn(&mut line, Some("b"), prompt, 300, &cost, at(0)),
            Err(20),
            "a's 100 rows are ahead of b"
        );
        assert_eq!(line.len(), 2);
        // The backlog drains to 150 rows (15 s): room for one prompt. b asks first and still waits for a.
        assert_eq!(turn(&mut line, Some("b"), prompt, 150, &cost, at(5)), Err(5));
        assert_eq!(turn(&mut line, Some("a"), prompt, 150, &cost, at(6)), Ok(()));
        assert_eq!(line.len(), 1);
        // a's rows are in the backlog now; once it drains, b is next, and a call without a session waits behind b.
        assert_eq!(turn(&mut line, None, prompt, 120, &cost, at(7)), Err(2));
        assert_eq!(turn(&mut line, Some("b"), prompt, 120, &cost, at(7)), Ok(()));
        assert!(line.is_empty());
        // Decode blocks never queue.
        assert_eq!(turn(&mut line, Some("c"), call(5, 5), 10_000, &cost, at(8)), Ok(()));
        assert!(line.is_empty());
    }

    #[test]
    fn a_prompt_that_stops_asking_gives_up_its_place() {
        let (mut line, mut cost, t0) = (PromptLine::default(), RowCost::default(), Instant::now());
        cost.observe(10, 1.0);
        let prompt = call(100, 5);
        assert_eq!(turn(&mut line, Some("gone"), prompt, 300, &cost, t0), Err(10));
        // Within 1.5 times its retry-after plus 5 s (20 s), "gone" still holds 100 rows ahead of "late".
        let soon = t0 + Duration::from_secs(19);
        assert_eq!(turn(&mut line, Some("late"), prompt, 150, &cost, soon), Err(5));
        let later = t0 + Duration::from_secs(21);
        assert_eq!(turn(&mut line, Some("late"), prompt, 150, &cost, later), Ok(()));
        assert!(line.is_empty());
    }
}
