//! Penalties and biases: edits to a model's logits that depend on the tokens so far.
//!
//! OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias`, and vLLM's `repetition_penalty`,
//! in vLLM's order: bias, then the repetition penalty, then frequency, then presence. They are applied
//! before [`crate::sampling::distribution`], to the target's logits by the verifier and to the
//! draft's by the edge, each from the same history: the prompt and the completion so far, including
//! the earlier drafts of the block being judged. Applying the transformation target-only decoding
//! would apply to p is what keeps speculative output exactly the target's; applying it to q as well
//! only keeps q close to p (acceptance).

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::sampling::SamplingError;

/// Most `logit_bias` entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Penalties {
    /// Subtracted once from the logit of every token the completion already holds. [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the completion holds it. [-2, 2].
    pub frequency_penalty: f32,
    /// vLLM's definition: the logit of every token in the prompt or the completion is divided by it
    /// when positive and multiplied by it otherwise. > 0; 1 = off.
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids (keys are ids, as in OpenAI's API). [-100, 100].
    #[schema(value_type = HashMap<String, f32>)]
    pub logit_bias: BTreeMap<u32, f32>,
    /// Where the completion starts in the token sequence: presence and frequency count only the tokens
    /// from here on; the repetition penalty counts the prompt too.
    pub prompt_len: u32,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: BTreeMap::new(),
            prompt_len: 0,
        }
    }
}

impl Penalties {
    /// True when applying them changes nothing: no need to send or apply them.
    pub fn is_noop(&self) -> bool {
        self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.values().all(|&b| b == 0.0)
    }

    pub fn validate(&self, vocab_size: u32) -> Result<(), SamplingError> {
        let bad = |name, value: f32, expected| SamplingError::InvalidParam {
            name,
            value: value as f64,
            expected,
        };
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(bad(name, value, "must be between -2 and 2"));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be greater than 0 (1 = off)",
            ));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(bad(
                "logit_bias",
                self.logit_bias.len() as f32,
                "at most 1024 tokens may be biased",
            ));
        }
        for (&token, &bias) in &self.logit_bias {
            if token >= vocab_size {
                return Err(SamplingError::BiasOutOfVocab { token, vocab_size });
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(bad("logit_bias", bias, "each bias must be between -100 and 100"));
            }
        }
        Ok(())
    }

    /// What the penalties need to know of `context` (prompt, then completion from `prompt_len`).
    pub fn history(&self, context: &[u32]) -> History {
        let split = (self.prompt_len as usize).min(context.len());
        let prompt = if self.repetition_penalty != 1.0 {
            context[..split].iter().copied().collect()
        } else {
            HashSet::new()
        };
        let mut history = History { penalties: self.clone(), prompt, counts: HashMap::new() };
        for &token in &context[split..] {
            history.push(token);
        }
        history
    }
}

/// Penalties with the token counts they act on; [`History::push`] each token as it is committed or drafted.
#[derive(Debug, Clone)]
pub struct History {
    penalties: Penalties,
    /// Distinct prompt tokens (kept only for a repetition penalty).
    prompt: HashSet<u32>,
    /// How often each token occurs in the completion.
    counts: HashMap<u32, u32>,
}

impl History {
    pub fn push(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
    }

    /// Edits `logits` (index = token id) for the next position. Each token's logit depends only on
    /// its own count, so the result does not depend on iteration order. Ids outside `logits` are ignored.
    pub fn apply(&self, logits: &mut [f32]) {
        let p = &self.penalties;
        for (&token, &bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            for &token in
                self.prompt.iter().chain(self.counts.keys().filter(|t| !self.prompt.contains(t)))
            {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&token, &count) in &self.counts {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l -= p.frequency_penalty * count as f32;
                    *l -= p.presence_penalty;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn penalties(
        presence: f32,
        frequency: f32,
        repetition: f32,
        bias: &[(u32, f32)],
        prompt_len: u32,
    ) -> Penalties {
        Penalties {
            presence_penalty: presence,
            frequency_penalty: frequency,
            repetition_penalty: repetition,
            logit_bias: bias.iter().copied().collect(),
            prompt_len,
        }
    }

    #[test]
    fn openai_penalties_count_only_the_completion() {
        // Prompt [0, 1], completion [2, 2, 3].
        let h = penalties(0.5, 0.25, 1.0, &[], 2).history(&[0, 1, 2, 2, 3]);
        let mut logits = vec![1.0; 5];
        h.apply(&mut logits);
        assert_eq!(logits, vec![1.0, 1.0, 1.0 - 0.5 - 0.5, 1.0 - 0.25 - 0.5, 1.0]);
    }

    #[test]
    fn repetition_penalty_covers_prompt_and_completion_and_keeps_the_sign() {
        let mut h = penalties(0.0, 0.0, 2.0, &[], 2).history(&[0, 1, 2]);
        h.push(3);
        let mut logits = vec![4.0, -4.0, 4.0, -1.0, 4.0];
        h.apply(&mut logits);
        assert_eq!(logits, vec![2.0, -8.0, 2.0, -2.0, 4.0]);
    }

    #[test]
    fn bias_comes_first_then_repetition_then_frequency_and_presence() {
        // Token 1 is in the completion twice: ((1 + 3) / 2) - 2 * 0.5 - 0.25.
        let h = penalties(0.25, 0.5, 2.0, &[(1, 3.0), (2, -100.0)], 0).history(&[1, 1]);
        let mut logits = vec![0.0, 1.0, 5.0, f32::NEG_INFINITY];
        h.apply(&mut logits);
        assert_eq!(logits, vec![0.0, 0.75, -95.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn a_history_pushed_token_by_token_equals_one_built_from_the_whole_context() {
        let p = penalties(0.3, 0.7, 1.3, &[(5, 1.5)], 3);
        let context = [9, 4, 5, 5, 7, 4, 4, 1];
        let mut grown = p.history(&context[..3]);
        for &t in &context[3..] {
            grown.push(t);
        }
        let logits: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
        let (mut a, mut b) = (logits.clone(), logits);
        grown.apply(&mut a);
        p.history(&context).apply(&mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn noop_and_validation() {
        assert!(Penalties::default().is_noop());
        assert!(penalties(0.0, 0.0, 1.0, &[(3, 0.0)], 7).is_noop());
        assert!(!penalties(0.0, 0.0, 1.1, &[], 0).is_noop());
        assert!(penalties(2.0, -2.0, 0.5, &[(9, -100.0)], 0).validate(10).is_ok());
        let param = |p: Penalties| p.validate(10).unwrap_err().param(None);
        assert_eq!(param(penalties(2.5, 0.0, 1.0, &[], 0)).as_deref(), Some("presence_penalty"));
        assert_eq!(param(penalties(0.0, -3.0, 1.0, &[], 0)).as_deref(), Some("frequency_penalty"));
        assert_eq!(param(penalties(0.0, 0.0, 0.0, &[], 0)).as_deref(), Some("repetition_penalty"));
        assert_eq!(param(penalties(0.0, 0.0, 1.0, &[(10, 1.0)], 0)).as_deref(), Some("logit_bias"));
        assert_eq!(
            param(penalties(0.0, 0.0, 1.0, &[(1, 101.0)], 0)).as_deref(),
            Some("logit_bias")
        );
    }

    #[test]
    fn logit_bias_keys_are_ids_as_strings_on_the_wire() {
        let p: Penalties =
            serde_json::from_str(r#"{"logit_bias": {"50256": -100, "7": 2.5}, "prompt_len": 3}"#)
                .unwrap();
        assert_eq!(p.logit_bias, BTreeMap::from([(7, 2.5), (50256, -100.0)]));
        assert_eq!(p.repetition_penalty, 1.0);
        assert!(serde_json::from_str::<Penalties>(r#"{"logit_bias": {"x": 1}}"#).is_err());
    }
}
