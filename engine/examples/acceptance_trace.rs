//! Acceptance traces with the draft's confidence: the target's greedy output for each long benchmark
//! prompt, then one teacher-forced pass of the draft model over it.
//!
//!   cargo run --release --example acceptance_trace -p spade-engine -- [MAX_TOKENS] > trace.txt
//!
//! One line per long prompt of `bench/prompts.jsonl` (`max_tokens` >= 128): for each output position `1`
//! where the draft's greedy token equals the target's (given the target's text before it) and `0` where
//! not, a space, then the draft's confidence in its own token at each position
//! (`spade_core::sampling::confidence`: its softmax probability), comma-separated. Under greedy decoding
//! this is what every round of any draft length meets, so a trace shows what blocks of any length, or
//! ending on the draft's confidence, would meet. The draft's logits come from the scorer (candle) on the
//! draft's GGUF rather than from mistral.rs, so a confidence may differ from the gateway's in its last
//! digits.
//!
//! Models come from scripts/fetch-models.sh (SPADE_MODELS_DIR overrides models/).

use std::path::PathBuf;

use spade_core::dist::SparseDist;
use spade_core::sampling::confidence;
use spade_core::SamplingParams;
use spade_engine::drafter::DrafterOptions;
use spade_engine::speculative::{generate, GenerateParams};
use spade_engine::{CandleScorer, MistralDrafter, ModelSource, Role, Scorer};

fn argmax(row: &[f32]) -> u32 {
    (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap_or(0) as u32
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let max_tokens: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(160);
    let dir = std::env::var_os("SPADE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"));
    let draft_file = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let target = CandleScorer::load(&dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))?;
    let draft = CandleScorer::load(&draft_file)?;
    let chat =
        MistralDrafter::load(&ModelSource::Local(draft_file), DrafterOptions::default()).await?;
    let prompts = std::fs::read_to_string("bench/prompts.jsonl")?;
    for line in prompts.lines().filter(|l| !l.trim().is_empty()) {
        let prompt: serde_json::Value = serde_json::from_str(line)?;
        if prompt["max_tokens"].as_u64().unwrap_or(0) < 128 {
            continue;
        }
        let messages = prompt["messages"].as_array().ok_or("messages")?;
        let turns = messages
            .iter()
            .map(|m| {
                let role = if m["role"] == "system" { Role::System } else { Role::User };
                (role, m["content"].as_str().unwrap_or_default().to_string())
            })
            .collect::<Vec<_>>();
        let ids = chat.encode_chat(&turns).await?;
        let params = GenerateParams {
            max_new_tokens: max_tokens,
            draft_len: 0,
            draft_ahead: false,
            sampling: SamplingParams::greedy(),
            draft_sampling: SamplingParams::greedy(),
            penalties: None,
            grammar: None,
            seed: 1,
            stop_token_ids: target.meta().stop_token_ids.clone(),
        };
        let output = generate(None, target.new_session().as_mut(), &ids, &params).await?.tokens;
        let forced: Vec<u32> =
            ids.iter().chain(&output[..output.len().saturating_sub(1)]).copied().collect();
        let rows = draft.new_session().score(&forced, output.len())?;
        let (mut bits, mut confidences) = (String::new(), Vec::new());
        for (row, &token) in rows.iter().zip(&output) {
            let drafted = argmax(row);
            bits.push(if drafted == token { '1' } else { '0' });
            confidences
                .push(format!("{:.3}", confidence(row, &SparseDist::point(drafted), drafted)));
        }
        println!("{bits} {}", confidences.join(","));
        eprintln!(
            "{}: {} tokens, acceptance {:.3}",
            prompt["id"],
            output.len(),
            bits.matches('1').count() as f64 / bits.len().max(1) as f64
        );
    }
    Ok(())
}
