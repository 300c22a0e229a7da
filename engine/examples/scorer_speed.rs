//! Decode speed of the candle scorer (medians, and the fastest repetition): prefill 32 tokens, then
//! 32 greedy steps one position at a time, then the cost of scoring a 5-position block (a d = 4
//! verify round), then batched passes: S sessions' blocks of B positions in one forward pass (the
//! verifier's continuous batching), per (S, B) in the list given after the model (default
//! 1x1,8x1,1x5,8x5).
//!
//!   cargo run --example scorer_speed -p spade-engine -- models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [4x5 …]
//!
//! `CONTEXT=2000 BLOCK=32`: the prompt is 2,000 tokens (its prefill timed) and the block 32 positions,
//! as a long coding conversation's verify rounds are; batched passes then run only where listed.
//!
//! Build once more with `RUSTFLAGS="-C target-cpu=x86-64"` (and another CARGO_TARGET_DIR) to see
//! what the x86-64-v3 setting in .cargo/config.toml buys.

use std::path::PathBuf;
use std::time::Instant;

use spade_engine::{BatchJob, CandleScorer, Scorer};

/// Sorts `v` and returns its median.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Where the CPU has AVX-VNNI or AVX512-VNNI (which the candle patch's quantized kernels use): the
/// 5-position block with it and with AVX2 alone, interleaved, and the logits compared bit for bit.
#[cfg(target_feature = "avx2")]
fn compare_avx_vnni(
    session: &mut dyn spade_engine::ScoreSession,
    tokens: &[u32],
    reps: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::avx::{allow_vnni, AVX2, AVX512_VNNI};
    if allow_vnni(AVX512_VNNI) == AVX2 {
        return Ok(());
    }
    let (mut times, mut logits): ([Vec<f64>; 2], [Vec<Vec<f32>>; 2]) = Default::default();
    for _ in 0..reps {
        for vnni in [false, true] {
            allow_vnni(if vnni { AVX512_VNNI } else { AVX2 });
            session.truncate(tokens.len() - 5);
            let started = Instant::now();
            logits[vnni as usize] = session.score(tokens, 5)?;
            times[vnni as usize].push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    allow_vnni(AVX512_VNNI);
    let same = logits[0]
        .iter()
        .flatten()
        .zip(logits[1].iter().flatten())
        .all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        return Err("the VNNI and AVX2 kernels gave different logits".into());
    }
    let [avx2, vnni] = times.map(|mut t| (median(&mut t), t[0]));
    println!(
        "5-position block, VNNI / AVX2 alone, interleaved: {:.1} / {:.1} ms = {:.3}x (fastest {:.1} / {:.1} = {:.3}x); logits bit-identical",
        vnni.0,
        avx2.0,
        vnni.0 / avx2.0,
        vnni.1,
        avx2.1,
        vnni.1 / avx2.1
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = PathBuf::from(std::env::args().nth(1).ok_or("usage: scorer_speed MODEL.gguf")?);
    let scorer = CandleScorer::load(&path)?;
    let mut session = scorer.new_session();
    let setting = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok());
    let (context, block_len) = (setting("CONTEXT"), setting("BLOCK").unwrap_or(5));
    let mut tokens: Vec<u32> =
        (0..context.unwrap_or(32) as u32).map(|i| (i * 7919 + 13) % 30000).collect();
    let started = Instant::now();
    session.score(&tokens, 1)?;
    println!("prefill of {} tokens: {:.2} s", tokens.len(), started.elapsed().as_secs_f64());
    let mut steps = Vec::new();
    for _ in 0..32 {
        let started = Instant::now();
        let logits = session.score(&tokens, 1)?;
        steps.push(started.elapsed().as_secs_f64() * 1e3);
        let next =
            logits[0].iter().enumerate().fold(0, |b, (i, &x)| if x > logits[0][b] { i } else { b });
        tokens.push(next as u32);
    }
    // BLOCKS=N times N blocks instead of 12 (a longer run to profile, e.g. under `perf record -D`).
    let blocks_to_time = setting("BLOCKS").unwrap_or(12);
    let mut blocks = Vec::new();
    for _ in 0..blocks_to_time {
        session.truncate(tokens.len() - block_len);
        let started = Instant::now();
        session.score(&tokens, block_len)?;
        blocks.push(started.elapsed().as_secs_f64() * 1e3);
    }
    // Medians, and the fastest repetition beside them: on a shared host the fastest is the closest
    // to the uncontended speed.
    let (step, step_min) = (median(&mut steps), steps[0]);
    let (block, block_min) = (median(&mut blocks), blocks[0]);
    println!(
        "{}: decode {:.1} tok/s ({step:.1} ms/token, fastest {step_min:.1}); {block_len}-position block {block:.1} ms (fastest {block_min:.1})",
        path.display(),
        1000.0 / step,
    );
    #[cfg(target_feature = "avx2")]
    compare_avx_vnni(session.as_mut(), &tokens, blocks_to_time)?;

    let shapes: Vec<String> = std::env::args().skip(2).collect();
    let shapes = if shapes.is_empty() && context.is_none() {
        ["1x1", "8x1", "1x5", "8x5"].map(String::from).to_vec()
    } else {
        shapes
    };
    for shape in shapes {
        let (s, b) = shape.split_once('x').ok_or("a batch shape is SESSIONSxBLOCK, e.g. 8x5")?;
        let (s, b): (usize, usize) = (s.parse()?, b.parse()?);
        let mut sessions: Vec<_> = (0..s).map(|_| scorer.new_session()).collect();
        let sequences: Vec<Vec<u32>> =
            (0..s as u32).map(|i| tokens.iter().map(|t| (t + i * 101) % 30000).collect()).collect();
        for (session, seq) in sessions.iter_mut().zip(&sequences) {
            session.score(seq, 1)?;
        }
        let reps = 3;
        let started = Instant::now();
        for _ in 0..reps {
            let mut jobs: Vec<BatchJob<'_>> = sessions
                .iter_mut()
                .zip(&sequences)
                .map(|(session, seq)| {
                    session.truncate(seq.len() - b);
                    BatchJob { session: session.as_mut(), tokens: seq, logit_rows: b, rows: b }
                })
                .collect();
            for result in scorer.score_batch(&mut jobs) {
                result?;
            }
        }
        let pass = started.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{s} sessions x {b} positions in one pass: {:.1} ms ({:.1} ms per position)",
            1000.0 * pass,
            1000.0 * pass / (s * b) as f64
        );
    }
    Ok(())
}
