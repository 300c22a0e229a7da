//! Decode speed of the candle scorer: prefill 32 tokens, then 32 greedy steps one position at a time,
//! then the cost of scoring a 5-position block (a d = 4 verify round).
//!
//!   cargo run --example scorer_speed -p spade-engine -- models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
//!
//! Build once more with `RUSTFLAGS="-C target-cpu=x86-64"` (and another CARGO_TARGET_DIR) to see
//! what the x86-64-v3 setting in .cargo/config.toml buys.

use std::path::PathBuf;
use std::time::Instant;

use spade_engine::{CandleScorer, Scorer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = PathBuf::from(std::env::args().nth(1).ok_or("usage: scorer_speed MODEL.gguf")?);
    let scorer = CandleScorer::load(&path)?;
    let mut session = scorer.new_session();
    let mut tokens: Vec<u32> = (0..32u32).map(|i| (i * 7919 + 13) % 30000).collect();
    session.score(&tokens, 1)?;
    let steps = 32;
    let started = Instant::now();
    for _ in 0..steps {
        let logits = session.score(&tokens, 1)?;
        let next = logits[0].iter().enumerate().fold(0, |b, (i, &x)| if x > logits[0][b] { i } else { b });
        tokens.push(next as u32);
    }
    let decode = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for _ in 0..8 {
        session.truncate(tokens.len() - 5);
        session.score(&tokens, 5)?;
    }
    let block = started.elapsed().as_secs_f64() / 8.0;
    println!(
        "{}: decode {:.1} tok/s ({:.1} ms/token); 5-position block {:.1} ms",
        path.display(),
        steps as f64 / decode,
        1000.0 * decode / steps as f64,
        1000.0 * block
    );
    Ok(())
}
