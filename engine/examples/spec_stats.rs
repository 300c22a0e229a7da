//! Speculative vs target-only decoding, in-process, on the Qwen2.5-Coder 0.5B (draft) / 1.5B (target)
//! pair: acceptance, tokens per target call, target calls saved, tokens/s, and greedy identity.
//!
//!   cargo run --example spec_stats -p spade-engine -- [DRAFT_LEN] [MAX_TOKENS] [N_PROMPTS] [TEMPERATURE]
//!
//! Models come from scripts/fetch-models.sh (SPADE_MODELS_DIR overrides models/).

use std::path::PathBuf;
use std::time::Instant;

use spade_core::SamplingParams;
use spade_engine::drafter::DrafterOptions;
use spade_engine::speculative::{generate, GenerateParams, Generation};
use spade_engine::{
    check_same_vocabulary, CandleScorer, Drafter, MistralDrafter, ModelSource, Role, Scorer,
};

const PROMPTS: &[&str] = &[
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a process and a thread.",
    "Write a JavaScript function that debounces another function.",
    "What is the time complexity of binary search, and why?",
    "Write a C function that swaps two integers through pointers.",
    "Summarise what a REST API is in two sentences.",
    "Write a Python class for a stack with push, pop and peek.",
    "How do I read a file line by line in Rust?",
];

fn arg<T: std::str::FromStr>(i: usize, default: T) -> T {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (draft_len, max_tokens, n_prompts, temperature) =
        (arg(1, 4usize), arg(2, 64usize), arg(3, 8usize), arg(4, 0.0f32));
    let dir = std::env::var_os("SPADE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"));
    let target = CandleScorer::load(&dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))?;
    let draft = MistralDrafter::load(
        &ModelSource::Local(dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")),
        DrafterOptions::default(),
    )
    .await?;
    check_same_vocabulary(draft.meta(), target.meta())?;
    let sampling = SamplingParams { temperature, ..SamplingParams::default() };
    println!("draft_len {draft_len}, max_tokens {max_tokens}, temperature {temperature}");
    println!("| prompt | tokens | target calls (spec / target-only) | accepted / drafted | tok/s spec | tok/s target-only | identical |");
    println!("|---|---|---|---|---|---|---|");
    let (mut spec_all, mut ref_all) = (Vec::new(), Vec::new());
    let (mut spec_secs, mut ref_secs) = (0.0, 0.0);
    for (i, prompt) in PROMPTS.iter().take(n_prompts).enumerate() {
        let ids = draft.encode_chat(&[(Role::User, prompt.to_string())]).await?;
        let params = |d| GenerateParams {
            max_new_tokens: max_tokens,
            draft_len: d,
            draft_ahead: false,
            sampling,
            draft_sampling: sampling,
            penalties: None,
            grammar: None,
            seed: 1,
            stop_token_ids: target.meta().stop_token_ids.clone(),
        };
        let t = Instant::now();
        let reference: Generation =
            generate(None, target.new_session().as_mut(), &ids, &params(0)).await?;
        let r_secs = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let spec: Generation =
            generate(Some(&draft), target.new_session().as_mut(), &ids, &params(draft_len)).await?;
        let s_secs = t.elapsed().as_secs_f64();
        println!(
            "| {i} | {} | {} / {} | {} / {} | {:.1} | {:.1} | {} |",
            spec.tokens.len(),
            spec.stats.target_calls,
            reference.stats.target_calls,
            spec.stats.accepted,
            spec.stats.drafted,
            spec.tokens.len() as f64 / s_secs,
            reference.tokens.len() as f64 / r_secs,
            if temperature == 0.0 {
                (spec.tokens == reference.tokens).to_string()
            } else {
                "n/a (sampled)".into()
            },
        );
        spec_secs += s_secs;
        ref_secs += r_secs;
        spec_all.push(spec);
        ref_all.push(reference);
    }
    let sum = |g: &[Generation], f: fn(&Generation) -> usize| g.iter().map(f).sum::<usize>();
    let (tokens, calls, ref_calls) = (
        sum(&spec_all, |g| g.tokens.len()),
        sum(&spec_all, |g| g.stats.target_calls),
        sum(&ref_all, |g| g.stats.target_calls),
    );
    let (acc, drafted) =
        (sum(&spec_all, |g| g.stats.accepted), sum(&spec_all, |g| g.stats.drafted));
    let identical = spec_all.iter().zip(&ref_all).filter(|(a, b)| a.tokens == b.tokens).count();
    let mut per_pos = Vec::new();
    for i in 0..draft_len {
        let (a, d): (usize, usize) = spec_all
            .iter()
            .map(|g| {
                (
                    g.stats.accepted_at.get(i).copied().unwrap_or(0),
                    g.stats.drafted_at.get(i).copied().unwrap_or(0),
                )
            })
            .fold((0, 0), |x, y| (x.0 + y.0, x.1 + y.1));
        per_pos.push(format!("{:.2}", a as f64 / d.max(1) as f64));
    }
    let draft_secs: f64 = spec_all.iter().map(|g| g.stats.draft_time.as_secs_f64()).sum();
    let target_secs: f64 = spec_all.iter().map(|g| g.stats.verify_time.as_secs_f64()).sum();
    println!();
    println!(
        "acceptance rate: {:.3} ({acc}/{drafted}); per position: [{}]",
        acc as f64 / drafted.max(1) as f64,
        per_pos.join(", ")
    );
    println!(
        "tokens per target call: {:.2} (target-only: {:.2})",
        tokens as f64 / calls as f64,
        sum(&ref_all, |g| g.tokens.len()) as f64 / ref_calls as f64
    );
    println!(
        "target calls: {calls} vs {ref_calls} target-only ({:.1}% fewer)",
        100.0 * (1.0 - calls as f64 / ref_calls as f64)
    );
    println!(
        "tokens/s: speculative {:.2}, target-only {:.2} (ratio {:.2})",
        tokens as f64 / spec_secs,
        sum(&ref_all, |g| g.tokens.len()) as f64 / ref_secs,
        (tokens as f64 / spec_secs) / (sum(&ref_all, |g| g.tokens.len()) as f64 / ref_secs)
    );
    println!("speculative time split: draft {draft_secs:.1}s, target {target_secs:.1}s");
    if temperature == 0.0 {
        println!("greedy identical to target-only: {identical}/{}", spec_all.len());
    }
    Ok(())
}
