//! Shared helpers for the engine's real-model tests (model paths from spade-test-support).
#![allow(dead_code, unused_imports)]

use spade_engine::drafter::DrafterOptions;
use spade_engine::{CandleScorer, MistralDrafter, ModelSource};
pub use spade_test_support::models::{model_path, DRAFT, TARGET, TINY};

pub fn scorer(name: &str) -> CandleScorer {
    CandleScorer::load(&model_path(name)).expect("load scorer")
}

pub async fn drafter(name: &str, options: DrafterOptions) -> MistralDrafter {
    MistralDrafter::load(&ModelSource::Local(model_path(name)), options)
        .await
        .expect("load drafter")
}

/// KL(p || q) in nats between two logit rows at temperature 1.
pub fn kl_from_logits(p: &[f32], q: &[f32]) -> f64 {
    let lsm = |l: &[f32]| {
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        l.iter().map(|&x| x as f64 - z).collect::<Vec<f64>>()
    };
    let (lp, lq) = (lsm(p), lsm(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

pub fn argmax(l: &[f32]) -> usize {
    l.iter().enumerate().fold(0, |best, (i, &x)| if x > l[best] { i } else { best })
}

/// Difference between the largest and second largest logit.
pub fn top2_margin(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in l {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// Prompts for the losslessness tests: code, chat, explanation, question answering.
pub const PROMPTS: &[&str] = &[
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is to a beginner.",
    "Write a SQL query that counts the rows of a table named users.",
    "List three prime numbers greater than 50.",
    "Write a bash one-liner that counts the lines of all .rs files in a directory.",
    "Summarise in one sentence: The quick brown fox jumps over the lazy dog because it was in a hurry.",
    "Write a Rust function that reverses a string.",
    "What does HTTP status code 404 mean?",
    "Translate 'good morning' into Spanish and German.",
];
