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

/// One waiting call, in arrival order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Positions still to score.
    pub pending: usize,
    /// The last of them, which need logits and so go in one pass (at least 1).
    pub tail: usize,
}

/// The bounds of one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassLimits {
    pub max_rows: usize,
    pub max_sessions: usize,
    pub prefill_chunk: usize,
}

impl PassLimits {
    /// Whether every call whose tail is at most `max_tail` can be served.
    pub fn check(&self, max_tail: usize) -> Result<(), String> {
        if self.max_sessions == 0 || self.prefill_chunk == 0 {
            return Err("a pass needs room for at least one session and one row".into());
        }
        let need = 2 * self.prefill_chunk.max(max_tail);
        if self.max_rows < need {
            return Err(format!("{} rows per pass leave no room for a prefill chunk beside a block of {max_tail} positions (at least {need})", self.max_rows));
        }
        Ok(())
    }
}

/// Rows each waiting call scores in the next pass (0: it waits), in the order given. Every call
/// gets either all its pending rows or at most `pending - tail`, and the oldest call always gets
/// some when the limits pass [`PassLimits::check`].
pub fn plan_pass(waiting: &[Waiting], limits: &PassLimits) -> Vec<usize> {
    let mut plan = vec![0; waiting.len()];
    if limits.max_sessions == 1 || waiting.len() == 1 {
        if let (Some(first), Some(rows)) = (waiting.first(), plan.first_mut()) {
            *rows = rows_within(first, limits.max_rows, limits.max_rows);
        }
        return plan;
    }
    let cap = |c: &Waiting| limits.prefill_chunk.max(c.tail);
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
/// its tail.
fn rows_within(call: &Waiting, cap: usize, budget: usize) -> usize {
    let tail = call.tail.clamp(1, call.pending.max(1));
    if call.pending <= cap.min(budget) {
        call.pending
    } else {
        (call.pending - tail).min(cap).min(budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: PassLimits = PassLimits { max_rows: 64, max_sessions: 8, prefill_chunk: 16 };

    fn call(pending: usize, tail: usize) -> Waiting {
        Waiting { pending, tail }
    }

    /// Every plan keeps the invariants, for many queues.
    fn check_plan(waiting: &[Waiting], limits: &PassLimits) -> Vec<usize> {
        let plan = plan_pass(waiting, limits);
        assert!(plan.iter().sum::<usize>() <= limits.max_rows);
        assert!(plan.iter().filter(|&&r| r > 0).count() <= limits.max_sessions);
        for (r, w) in plan.iter().zip(waiting) {
            assert!(*r == w.pending || *r + w.tail <= w.pending, "{r} rows of {w:?}");
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
        // The last pass holds the whole tail: 67 rows would leave 3 of the 5 logit rows behind.
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
            let limits = PassLimits { max_rows: 17 + next(150), max_sessions: 1 + next(16), prefill_chunk: 1 + next(64) };
            if limits.check(17).is_err() {
                continue;
            }
            let waiting: Vec<Waiting> = (0..1 + next(20))
                .map(|_| {
                    let tail = 1 + next(17);
                    call(tail + next(300), tail)
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
}
