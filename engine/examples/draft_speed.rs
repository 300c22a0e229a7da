//! The draft model's speed through mistral.rs, as the gateway drives it (issue "compute floor"):
//! a 512-token prompt's prefill, decode tokens/s within one long block, and what a d = 4 round costs
//! against four decode steps (the per-round overhead: starting a request, the prefix-cache hit, the
//! committed tokens' catch-up).
//!
//!   RAYON_NUM_THREADS=1 taskset -c 1 cargo run --example draft_speed -p spade-engine -- [MODEL.gguf]
//!
//! `CONTEXT=2700`: the decode step after a 2,700-token context instead of 64 (a long coding answer's).
//!
//! Compare with llama.cpp on the same file and thread count: `bash bench/compute-floor.sh`. Where the
//! CPU has AVX-VNNI or AVX512-VNNI (used by the candle patch's kernels), the decode step and a 128-token prompt are
//! also timed with it and with AVX2 alone, interleaved, and their drafts compared.

use std::path::PathBuf;
use std::time::Instant;

use spade_core::SamplingParams;
use spade_engine::drafter::DrafterOptions;
use spade_engine::{DraftParams, Drafter, EdgeModel, MistralDrafter, ModelSource};

const TEXT: &str = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens with a small model and verifies them with a large one. ";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"));
    let drafter =
        MistralDrafter::load(&ModelSource::Local(path.clone()), DrafterOptions::default()).await?;
    let params =
        DraftParams { sampling: SamplingParams::greedy(), penalties: None, grammar: None, seed: 1 };
    let text: Vec<u32> = drafter.encode_text(&TEXT.repeat(160), false).await?;

    // Prefill: a fresh 512-token prompt each time (a different first token defeats the prefix cache).
    let mut prefill = Vec::new();
    for rep in 0..3u32 {
        let mut prompt = text[..512].to_vec();
        prompt[0] = 1000 + rep;
        let started = Instant::now();
        drafter.prefill(&prompt, &params).await?;
        prefill.push(started.elapsed().as_secs_f64());
    }
    let prefill = median(prefill);

    // Decode: one 64-token block after a cached context (64 tokens, or `CONTEXT`), against a
    // 4-token block.
    let context_len: usize =
        std::env::var("CONTEXT").ok().and_then(|c| c.parse().ok()).unwrap_or(64);
    let context = text[..context_len.min(text.len() - 1)].to_vec();
    drafter.prefill(&context, &params).await?;
    let mut per_token = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        let (long, short) = (drafter.draft(&context, 64, &params).await?.len(), 4);
        let long_secs = started.elapsed().as_secs_f64();
        let started = Instant::now();
        drafter.draft(&context, short, &params).await?;
        let short_secs = started.elapsed().as_secs_f64();
        // The difference removes what every block pays once (starting the request, the cache hit).
        per_token.push((long_secs - short_secs) / (long - short) as f64);
    }
    let step = median(per_token);

    // Rounds as the loop runs them: draft 4, commit them plus one more token, draft again.
    let mut committed = context.clone();
    let mut rounds = Vec::new();
    for _ in 0..12 {
        let started = Instant::now();
        let block = drafter.draft(&committed, 4, &params).await?;
        rounds.push(started.elapsed().as_secs_f64());
        committed.extend(block.iter().map(|d| d.token));
        committed.push(text[committed.len() % text.len()]);
    }
    let round = median(rounds);
    println!(
        "{}: prompt 512 tokens {:.1} tok/s ({:.0} ms)",
        path.display(),
        512.0 / prefill,
        prefill * 1e3
    );
    println!(
        "decode {:.1} tok/s ({:.1} ms per token, inside a 64-token block)",
        1.0 / step,
        step * 1e3
    );
    println!(
        "d=4 round after 5 committed tokens: {:.1} ms = {:.2} decode steps per drafted token",
        round * 1e3,
        round / step / 4.0
    );
    #[cfg(target_feature = "avx2")]
    compare_avx_vnni(&drafter, &text, &params).await?;
    Ok(())
}

/// Decode step and a 128-token prompt with VNNI over AVX2 alone, interleaved (medians of 5).
#[cfg(target_feature = "avx2")]
async fn compare_avx_vnni(
    drafter: &MistralDrafter,
    text: &[u32],
    params: &DraftParams,
) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::avx::{allow_vnni, AVX2, AVX512_VNNI};
    if allow_vnni(AVX512_VNNI) == AVX2 {
        return Ok(());
    }
    let context = text[..64].to_vec();
    let (mut step, mut prompt) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut drafts: [Vec<Vec<u32>>; 2] = Default::default();
    for rep in 0..5u32 {
        for vnni in [false, true] {
            allow_vnni(if vnni { AVX512_VNNI } else { AVX2 });
            let v = vnni as usize;
            let started = Instant::now();
            let long = drafter.draft(&context, 32, params).await?;
            let long_secs = started.elapsed().as_secs_f64();
            let started = Instant::now();
            drafter.draft(&context, 4, params).await?;
            step[v].push((long_secs - started.elapsed().as_secs_f64()) / (long.len() - 4) as f64);
            drafts[v].push(long.iter().map(|d| d.token).collect());
            let mut fresh = text[..128].to_vec();
            fresh[0] = 2000 + 2 * rep + vnni as u32;
            let started = Instant::now();
            drafter.prefill(&fresh, params).await?;
            prompt[v].push(started.elapsed().as_secs_f64());
        }
    }
    allow_vnni(AVX512_VNNI);
    if drafts[0] != drafts[1] {
        return Err("the VNNI and AVX2 kernels drafted different tokens".into());
    }
    let [step, prompt] = [step, prompt].map(|[avx2, vnni]| (median(vnni), median(avx2)));
    println!(
        "VNNI / AVX2 alone, interleaved: decode step {:.1} / {:.1} ms = {:.3}x; 128-token prompt {:.0} / {:.0} ms = {:.3}x; drafts identical",
        step.0 * 1e3,
        step.1 * 1e3,
        step.0 / step.1,
        prompt.0 * 1e3,
        prompt.1 * 1e3,
        prompt.0 / prompt.1
    );
    Ok(())
}
