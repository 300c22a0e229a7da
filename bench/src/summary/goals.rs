//! The goals a run is held to: `auto` against the best fixed draft length ([`AutoVsFixed`]), and
//! speculative decoding against target-only ([`VsTargetOnly`]), with what a missed goal would take
//! ([`GoalGap`]).

use serde::Serialize;

use super::speed::{by_rep, PerRound, SpeedRow};
use super::Record;
use crate::plan::Mode;
use crate::stats::{ratio, Spread};

/// `auto` against the fixed draft lengths (draft-ahead on, as `auto`) at one link.
#[derive(Debug, Clone, Serialize)]
pub struct AutoVsFixed {
    pub rtt_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift_to_ms: Option<u64>,
    pub auto_tokens_per_s: f64,
    /// Every fixed draft length's median tokens/s.
    pub fixed: Vec<(u32, f64)>,
    pub best_fixed: u32,
    pub best_fixed_tokens_per_s: f64,
    /// auto / best fixed − 1.
    pub auto_vs_best: f64,
    /// auto / best fixed − 1 within each repetition, spread over repetitions ([`paired_by_rep`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paired_vs_best: Option<Spread>,
    /// At a fixed RTT: within [`AUTO_TOLERANCE`] of the best fixed length; drift: faster than every one.
    pub met: bool,
}

/// How far below the best fixed draft length `auto` may be at a fixed RTT.
pub const AUTO_TOLERANCE: f64 = 0.05;

/// Speedup goals of speculative decoding (with draft-ahead) over target-only, by RTT.
pub const SPEEDUP_GOALS: [(u64, f64); 3] = [(0, 1.0), (50, 1.5), (100, 2.0)];

/// Speculative decoding (draft-ahead on) against target-only at one RTT.
#[derive(Debug, Clone, Serialize)]
pub struct VsTargetOnly {
    pub rtt_ms: u64,
    pub target_only_tokens_per_s: f64,
    pub auto_ratio: Option<f64>,
    /// The fastest draft-ahead mode (auto or a fixed length) and its ratio.
    pub best: Mode,
    pub best_ratio: f64,
    pub goal: Option<f64>,
    pub met: Option<bool>,
    /// The largest term of the fastest mode's round time.
    pub dominant: Option<String>,
    /// The fastest mode's decode tokens/s (after the first token) over target-only's.
    pub decode_ratio: Option<f64>,
    /// Where the goal is missed, what it would take ([`GoalGap`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap: Option<GoalGap>,
}

/// What a missed speed-up goal would take, at the fastest mode's round breakdown: its round time must
/// shrink by the ratio it reached over the goal, with the same tokens per round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GoalGap {
    /// The round time (s) at which the goal would be met.
    pub round_needed_s: f64,
    /// The verifier's time per round (s), as measured and as the goal needs with every other term as
    /// measured; `needed <= 0` means the other terms alone exceed the round the goal allows.
    pub verifier_s: f64,
    pub verifier_needed_s: f64,
}

impl GoalGap {
    pub(super) fn of(p: &PerRound, ratio: f64, goal: f64) -> Option<GoalGap> {
        (ratio < goal).then(|| {
            let round_needed_s = p.wall_s * ratio / goal;
            GoalGap {
                round_needed_s,
                verifier_s: p.verifier_s,
                verifier_needed_s: p.verifier_s - (p.wall_s - round_needed_s),
            }
        })
    }

    /// Whether a cheaper verifier alone could meet the goal (the other terms fit in the round).
    pub fn verifier_can_close_it(&self) -> bool {
        self.verifier_needed_s > 0.0
    }
}

/// `auto` against every fixed draft length (draft-ahead on) among one link's rows.
pub fn auto_vs_fixed(rows: &[SpeedRow]) -> Option<AutoVsFixed> {
    let auto = rows.iter().find(|r| r.mode == Mode::Auto)?;
    let fixed: Vec<(u32, f64)> =
        rows.iter().filter_map(|r| Some((r.mode.fixed_with_ahead()?, r.tokens_per_s()?))).collect();
    let &(best_fixed, best) = fixed.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let auto_tps = auto.tokens_per_s()?;
    let auto_vs_best = auto_tps / best - 1.0;
    let met = if auto.drift_to_ms.is_some() {
        fixed.iter().all(|&(_, f)| auto_tps > f)
    } else {
        auto_vs_best >= -AUTO_TOLERANCE
    };
    Some(AutoVsFixed {
        rtt_ms: auto.rtt_ms,
        drift_to_ms: auto.drift_to_ms,
        auto_tokens_per_s: auto_tps,
        fixed,
        best_fixed,
        best_fixed_tokens_per_s: best,
        auto_vs_best,
        paired_vs_best: None,
        met,
    })
}

/// `a` / `b` − 1 in tokens/s within each repetition both ran, spread over repetitions. A repetition runs
/// the modes of a link prompt by prompt in turns ([`crate::plan::Plan::links`]), so the pair leaves out how the
/// shared host's speed drifts between repetitions, which moves each mode's median by as much as the 5%
/// `auto` is held to.
pub(super) fn paired_by_rep(a: &[&Record], b: &[&Record]) -> Option<Spread> {
    let b = by_rep(b.iter().copied());
    let pairs: Vec<f64> = by_rep(a.iter().copied())
        .iter()
        .filter_map(|(rep, a)| Some(ratio(a.tokens_per_s()?, b.get(rep)?.tokens_per_s()?)? - 1.0))
        .collect();
    Spread::of(&pairs)
}

/// Speculative decoding with draft-ahead (auto or fixed) against target-only among one RTT's rows.
pub(super) fn vs_target_only(rows: &[SpeedRow]) -> Option<VsTargetOnly> {
    let target = rows.iter().find(|r| r.mode == Mode::TargetOnly)?;
    let target_tps = target.tokens_per_s()?;
    let ahead = |m: Mode| matches!(m, Mode::Auto | Mode::Speculative(_));
    let best = rows
        .iter()
        .filter(|r| ahead(r.mode))
        .filter_map(|r| Some((r, r.tokens_per_s()?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    let goal = SPEEDUP_GOALS.iter().find(|(rtt, _)| *rtt == target.rtt_ms).map(|g| g.1);
    let best_ratio = best.1 / target_tps;
    Some(VsTargetOnly {
        rtt_ms: target.rtt_ms,
        target_only_tokens_per_s: target_tps,
        auto_ratio: rows
            .iter()
            .find(|r| r.mode == Mode::Auto)
            .and_then(SpeedRow::tokens_per_s)
            .map(|a| a / target_tps),
        best: best.0.mode,
        best_ratio,
        goal,
        met: goal.map(|g| best_ratio >= g),
        dominant: best.0.per_round.map(|p| p.dominant().to_string()),
        decode_ratio: best
            .0
            .timing
            .decode_tokens_per_s
            .zip(target.timing.decode_tokens_per_s)
            .and_then(|(b, t)| ratio(b.median, t.median)),
        gap: goal.zip(best.0.per_round).and_then(|(g, p)| GoalGap::of(&p, best_ratio, g)),
    })
}
