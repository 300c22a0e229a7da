//! Helpers shared by the unit tests of the draft-control modules.

use super::estimates::{Estimates, Rate};

const MS: f64 = 1e-3;

/// A rate learned from so many outcomes that reading it optimistically changes it by less than 1e-5.
pub(super) fn known(value: f64) -> Rate {
    Rate { value, outcomes: u32::MAX }
}

/// Estimates with flat acceptance `alpha` (pooled, no position of its own) and the given costs in milliseconds.
pub(super) fn est(alpha: f64, t_draft_ms: f64, rtt_ms: f64, a_ms: f64, b_ms: f64) -> Estimates {
    let (t_draft_s, rtt_s, verify_a_s, verify_b_s) =
        (t_draft_ms * MS, rtt_ms * MS, a_ms * MS, b_ms * MS);
    Estimates {
        alpha: Vec::new(),
        pooled: known(alpha),
        t_draft_s,
        t_start_s: 0.0,
        rtt_s,
        verify_a_s,
        verify_b_s,
        ..Estimates::default()
    }
}

pub(super) fn close(x: f64, want: f64) -> bool {
    (x - want).abs() < 1e-6
}
