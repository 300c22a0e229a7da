//! Time of `distribution` over one row of 151,936 logits (Qwen2.5's vocabulary), the verifier's
//! per-position cost besides the forward pass when sampling:
//!
//!   cargo run --release --example distribution_speed -p spade-core
//!
//! The logits are synthetic (a few high, a long tail), so a top-p nucleus is short, as it is for a
//! model's rows.

use std::time::Instant;

use spade_core::{distribution, SamplingParams};

fn main() {
    let mut state = 7u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let logits: Vec<f32> = (0..151_936)
        .map(|i| if i % 5000 == 0 { 20.0 + next() * 5.0 } else { next() * 12.0 - 6.0 })
        .collect();
    for (name, params) in [
        (
            "temperature 0.8, top_p 0.95",
            SamplingParams { temperature: 0.8, top_p: 0.95, top_k: 0, min_p: 0.0 },
        ),
        (
            "temperature 1, top_p 1",
            SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, min_p: 0.0 },
        ),
        (
            "temperature 0.8, top_k 40",
            SamplingParams { temperature: 0.8, top_p: 1.0, top_k: 40, min_p: 0.0 },
        ),
    ] {
        let mut times: Vec<f64> = Vec::new();
        let mut kept = 0;
        for _ in 0..31 {
            let started = Instant::now();
            kept = distribution(&logits, &params).expect("valid logits").len();
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        println!("{name}: median {:.2} ms per row, {kept} tokens kept", times[times.len() / 2]);
    }
}
