//! The speculative loop's per-round record ([`RoundRecord`]): how each verify call's block was chosen
//! and drafted, what came of it, and what the draft-length controller was fed, so a generation's
//! choices can be explained from a log.
//!
//! The log form, written by spade-engine's loop and read back by [`RoundRecord::from_log_line`]: one
//! `tracing` event per verify call at DEBUG, target [`RoundRecord::LOG_TARGET`], whose one field
//! [`RoundRecord::LOG_FIELD`] holds the record as JSON ([`RoundRecord`]'s `Display`):
//!
//! ```text
//! tracing::debug!(target: RoundRecord::LOG_TARGET, round = %record);
//! ```
//!
//! A text log (`--log info,spade_engine=debug`) shows `… DEBUG spade_engine::rounds: round={"first_call":false,…}`;
//! a JSON log (`--log-json`) holds the same JSON as the string `fields.round`.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::estimates::RoundObservation;
use super::policy::DraftChoice;

/// One verify call of a generation, as the loop logs it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// The generation's first call, which processes the prompt: the controller learns only the link
    /// from it ([`super::Estimates::observe_link`], where the verifier reported its time), no round.
    pub first_call: bool,
    /// The block was drafted ahead, during the call before ([`super::BlockKind::Ahead`]).
    pub from_ahead: bool,
    /// Whether the generation drafts ahead during calls (the controller's `overlap`).
    pub draft_ahead: bool,
    /// The most a block may draft (the controller's `max_draft`).
    pub max_draft: usize,
    /// Tokens the generation could still commit when the round started.
    pub remaining: usize,
    /// The length chosen for this block (under a fixed length, its cap).
    pub chosen: usize,
    /// The most the block could draft: the length's cap, within the budget.
    pub cap: usize,
    /// Drafts sent.
    pub drafted: usize,
    /// Leading drafts the verifier accepted.
    pub accepted: usize,
    /// The draft's confidence in each draft sent; `null` where it had none (NaN).
    #[serde(with = "nan_as_null")]
    pub confidences: Vec<f32>,
    /// Whether the guess drafted ahead during the call equalled the verifier's token (None: none compared).
    pub guess_matched: Option<bool>,
    /// The draft's time before the block's first step, in microseconds, as the controller was fed it
    /// (0: not measured, or it included processing the prompt).
    pub draft_start_us: u64,
    /// The draft's time per token in the block, in microseconds (0: not measured).
    pub draft_step_us: u64,
    /// The verify call, end to end, in microseconds.
    pub call_us: u64,
    /// The verifier's own time for the call, in microseconds, where it reported one.
    pub verifier_us: Option<u64>,
    /// The controller's last choice and its inputs once the round was chosen and drafted ahead for
    /// (None under a fixed length).
    pub model: Option<DraftChoice>,
}

impl RoundRecord {
    /// The `tracing` target the loop logs records under: `spade_engine=debug` enables it.
    pub const LOG_TARGET: &'static str = "spade_engine::rounds";
    /// The event's one field, holding the record as JSON.
    pub const LOG_FIELD: &'static str = "round";

    /// A record of what `round` showed; the other fields are left to the caller.
    pub fn from_observation(round: &RoundObservation) -> Self {
        Self {
            drafted: round.drafted,
            accepted: round.accepted,
            confidences: round.confidences.clone(),
            guess_matched: round.ahead_guess,
            draft_start_us: micros(round.draft_start),
            draft_step_us: micros(round.draft_step),
            call_us: micros(round.call_latency),
            verifier_us: round.verifier_time.map(micros),
            ..Self::default()
        }
    }

    /// What the round showed, as the controller was fed it (to the microsecond).
    pub fn observation(&self) -> RoundObservation {
        RoundObservation {
            drafted: self.drafted,
            accepted: self.accepted,
            confidences: self.confidences.clone(),
            draft_step: Duration::from_micros(self.draft_step_us),
            draft_start: Duration::from_micros(self.draft_start_us),
            call_latency: Duration::from_micros(self.call_us),
            verifier_time: self.verifier_us.map(Duration::from_micros),
            ahead_guess: self.guess_matched,
        }
    }

    /// The record in a log line, text or JSON (see the module docs). None: the line holds no record;
    /// an error: it holds one this build cannot read (a log of another version of the loop).
    pub fn from_log_line(line: &str) -> Option<Result<Self, serde_json::Error>> {
        let line = line.trim();
        if line.starts_with('{') {
            let event: serde_json::Value = serde_json::from_str(line).ok()?;
            let field = event.get("fields").unwrap_or(&event).get(Self::LOG_FIELD)?.as_str()?;
            return Some(serde_json::from_str(field));
        }
        let line = without_ansi(line);
        let key = format!("{}=", Self::LOG_FIELD);
        let at = line.match_indices(&key).map(|(at, _)| at).find(|&at| {
            let before = line[..at].chars().next_back();
            before.is_none_or(|c| c.is_whitespace() || c == ':')
                && line[at + key.len()..].starts_with('{')
        })?;
        serde_json::Deserializer::from_str(&line[at + key.len()..]).into_iter().next()
    }
}

/// The record as one line of JSON: the log field's value.
impl fmt::Display for RoundRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| fmt::Error)?)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `line` without its terminal colour codes (`ESC [ … letter`), which a text log written to a
/// terminal-less file may still carry around field names.
fn without_ansi(line: &str) -> Cow<'_, str> {
    if !line.contains('\u{1b}') {
        return Cow::Borrowed(line);
    }
    let (mut out, mut chars) = (String::with_capacity(line.len()), line.chars());
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.clone().next() == Some('[') {
                chars.find(|c| c.is_ascii_alphabetic());
            }
            continue;
        }
        out.push(c);
    }
    Cow::Owned(out)
}

/// Confidences with NaN written as `null` (JSON has no NaN) and read back as NaN.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(values: &[f32], serializer: S) -> Result<S::Ok, S::Error> {
        values.iter().map(|v| (!v.is_nan()).then_some(*v)).collect::<Vec<_>>().serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f32>, D::Error> {
        Ok(Vec::<Option<f32>>::deserialize(deserializer)?
            .into_iter()
            .map(|v| v.unwrap_or(f32::NAN))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> RoundRecord {
        let round = RoundObservation {
            drafted: 3,
            accepted: 2,
            confidences: vec![0.97, f32::NAN, 0.25],
            draft_step: Duration::from_micros(31_250),
            draft_start: Duration::from_micros(4_500),
            call_latency: Duration::from_micros(212_004),
            verifier_time: Some(Duration::from_micros(150_500)),
            ahead_guess: None,
        };
        let model = DraftChoice {
            draft: 3,
            draft_ahead: 4,
            expected_tokens: 2.5,
            round_time_s: 0.25,
            tokens_per_s: 10.0,
            p_hit: 0.5,
            overlap: true,
            rtt_s: 0.05,
            t_draft_s: 0.03125,
            t_start_s: 0.0045,
            verify_a_s: 0.125,
            verify_b_s: 0.0375,
            beta: 0.75,
            acceptance: 0.875,
            alpha: vec![0.875, 0.8125],
        };
        RoundRecord {
            from_ahead: true,
            draft_ahead: true,
            max_draft: 8,
            remaining: 97,
            chosen: 3,
            cap: 8,
            model: Some(model),
            ..RoundRecord::from_observation(&round)
        }
    }

    /// Equal, with NaN equal to NaN (a confidence the draft had none for).
    fn same(a: &RoundRecord, b: &RoundRecord) -> bool {
        let nan_free = |r: &RoundRecord| RoundRecord {
            confidences: r.confidences.iter().map(|c| if c.is_nan() { -1.0 } else { *c }).collect(),
            ..r.clone()
        };
        nan_free(a) == nan_free(b)
    }

    #[test]
    fn a_record_round_trips_through_the_log_lines_the_replay_reads() {
        let r = record();
        let json = r.to_string();
        assert!(
            !json.contains(char::is_whitespace)
                && json.contains("\"confidences\":[0.97,null,0.25]"),
            "{json}"
        );
        // A text log line as tracing-subscriber's formatter writes the event, plain and with colour codes.
        let text = format!(
            "2026-12-03T10:00:00.000001Z DEBUG {}: {}={r}",
            RoundRecord::LOG_TARGET,
            RoundRecord::LOG_FIELD
        );
        let (dim, italic, reset) = ("\u{1b}[2m", "\u{1b}[3m", "\u{1b}[0m");
        let coloured = format!(
            "{dim}2026-12-03T10:00:00Z{reset} \u{1b}[34mDEBUG{reset} {dim}spade_engine::rounds{reset}{dim}:{reset} {italic}round{reset}{dim}={reset}{r}"
        );
        // Its JSON form (`--log-json`): the field's Display as a string.
        let event = serde_json::json!({"timestamp": "2026-12-03T10:00:00Z", "level": "DEBUG", "fields": {"round": json}, "target": RoundRecord::LOG_TARGET});
        for line in
            [text, coloured, format!("{}={r} other=1", RoundRecord::LOG_FIELD), event.to_string()]
        {
            let parsed = RoundRecord::from_log_line(&line)
                .unwrap_or_else(|| panic!("no record in {line}"))
                .unwrap();
            assert!(same(&parsed, &r), "{line}\n{parsed:?}");
        }
        // The controller is fed what the loop fed it.
        let observed = r.observation();
        assert!(same(
            &RoundRecord::from_observation(&observed),
            &RoundRecord {
                model: None,
                from_ahead: false,
                draft_ahead: false,
                max_draft: 0,
                remaining: 0,
                chosen: 0,
                cap: 0,
                ..r.clone()
            }
        ));
        assert_eq!(
            (observed.call_latency, observed.verifier_time),
            (Duration::from_micros(212_004), Some(Duration::from_micros(150_500)))
        );
    }

    #[test]
    fn other_lines_hold_no_record_and_a_changed_record_is_an_error() {
        for line in [
            "",
            "INFO spade_gateway: draft-length model seeded pass_ms=[95.0, 161.0]",
            "DEBUG spade_engine::speculative: round chosen=3 cap=8",
            "{\"fields\":{\"message\":\"x\"}}",
            "around={}",
        ] {
            assert!(RoundRecord::from_log_line(line).is_none(), "{line}");
        }
        assert!(RoundRecord::from_log_line("DEBUG spade_engine::rounds: round={\"chosen\":3}")
            .is_some_and(|r| r.is_err()));
    }
}
