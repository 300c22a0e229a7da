//! `auto` against fixed draft lengths in a simulated world with draft-ahead: tokens per second of
//! round time, the same random text and noise for every mode (seeded), so constants of
//! `spade_core::draft_control` can be tried in seconds instead of a 30-minute benchmark. Beside each rate:
//! the verifier's milliseconds per committed token (the cloud's cost).
//!
//!   cargo run --release --example draft_control_sim -p spade-core -- [RTT_MS ...]
//!
//! The world (defaults from the quick benchmark's per-round log on the two-core emulation, Qwen2.5-Coder
//! 0.5B drafting for 1.5B): the verifier takes `(170 + 40 * rows) ms`, 200 ms more past 6 rows (a second pass over the
//! weights), with log-normal noise (sigma 0.2),
//! a draft step 95 ms (+-15%), a block's start 10 ms. Greedy drafts: a token is one the draft is sure of
//! (confidence 0.9-1, accepted with probability 0.97) with probability 0.8, otherwise unsure
//! (confidence 0.2-0.8, accepted with that probability). With `--no-confidence` every confidence is 1.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use spade_core::draft_control::{BlockOdds, DraftController, Estimates, RoundObservation};

const TOKENS: usize = 20_000;
const MAX_DRAFT: usize = 8;
/// Rows the verifier scores in one pass over the weights (the patched candle kernel's tile).
const ROWS_PER_PASS: usize = 6;

struct World {
    rng: ChaCha8Rng,
    rtt_s: f64,
    confidence: bool,
}

impl World {
    /// One drafted token: how sure the draft was, and whether the target agrees.
    fn token(&mut self) -> (f32, bool) {
        let (c, p) = if self.rng.random_bool(0.8) {
            (self.rng.random_range(0.9..1.0), 0.97)
        } else {
            let c = self.rng.random_range(0.2..0.8);
            (c, c)
        };
        (if self.confidence { c as f32 } else { 1.0 }, self.rng.random_bool(p))
    }

    fn noise(&mut self, sigma: f64) -> f64 {
        // Box-Muller, for a log-normal factor.
        let (u, v): (f64, f64) = (self.rng.random_range(1e-12..1.0), self.rng.random());
        (sigma * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()).exp()
    }

    fn verify_s(&mut self, rows: usize) -> f64 {
        (0.170 + 0.040 * rows as f64 + if rows > ROWS_PER_PASS { 0.200 } else { 0.0 }) * self.noise(0.2)
    }

    fn step_s(&mut self) -> f64 {
        0.095 * self.rng.random_range(0.85..1.15)
    }
}

/// A drafted block: each token's confidence and verdict, the drafting time on the round's critical path, the step time.
#[derive(Default)]
struct Block {
    tokens: Vec<(f32, bool)>,
    drafting_s: f64,
    step_s: f64,
}

/// A block drafted up to `cap` tokens (fewer when `auto` stops it).
fn draft(world: &mut World, ctl: Option<&DraftController>, cap: usize) -> Block {
    let (mut tokens, mut odds, step_s) = (Vec::new(), BlockOdds::default(), world.step_s());
    while tokens.len() < cap {
        let token = world.token();
        tokens.push(token);
        if ctl.is_some_and(|c| !c.keep_drafting(&mut odds, token.0)) {
            break;
        }
    }
    Block { drafting_s: 0.010 + step_s * tokens.len() as f64, tokens, step_s }
}

/// Committed tokens per second of round time, tokens per round and verifier milliseconds per committed
/// token, with a fixed length, or `auto` when `fixed` is None.
fn run(fixed: Option<usize>, rtt_s: f64, confidence: bool, seed: u64) -> (f64, f64, f64) {
    let mut world = World { rng: ChaCha8Rng::seed_from_u64(seed), rtt_s, confidence };
    let mut ctl = DraftController::new(MAX_DRAFT, true, Estimates::default());
    let (mut committed, mut time, mut rounds, mut verifier_total_s) = (0usize, 0.0, 0usize, 0.0);
    // The block drafted ahead for this round, and the part of its drafting the last call did not hide.
    let mut ahead: Option<Block> = None;
    while committed < TOKENS {
        let d = fixed.unwrap_or_else(|| ctl.choose());
        let from_ahead = ahead.is_some();
        let Block { tokens: block, drafting_s, step_s: step } = match ahead.take() {
            Some(mut pre) => {
                pre.tokens.truncate(d);
                pre
            }
            None if d > 0 => draft(&mut world, fixed.is_none().then_some(&ctl), d),
            None => Block::default(),
        };
        let call_s = world.rtt_s + world.verify_s(block.len() + 1);
        let verifier_s = call_s - world.rtt_s;
        verifier_total_s += verifier_s;
        // During the call: the guess, then the next block.
        let next_d = fixed.unwrap_or_else(|| ctl.choose());
        let (_, guess_ok) = world.token();
        let next = if next_d > 0 { draft(&mut world, fixed.is_none().then_some(&ctl), next_d) } else { Block::default() };
        let ahead_s = 0.010 + world.step_s() + next.drafting_s;
        let accepted = block.iter().take_while(|t| t.1).count();
        let all = accepted == block.len();
        committed += accepted + 1;
        time += drafting_s + call_s;
        rounds += 1;
        if all && guess_ok {
            ahead = Some(Block { drafting_s: (ahead_s - call_s).max(0.0), ..next });
        }
        ctl.observe(&RoundObservation {
            drafted: block.len(),
            accepted,
            confidences: block.iter().map(|t| t.0).collect(),
            draft_step: Duration::from_secs_f64(if from_ahead { 0.0 } else { step }),
            draft_start: Duration::from_secs_f64(if from_ahead || block.is_empty() { 0.0 } else { 0.010 }),
            call_latency: Duration::from_secs_f64(call_s),
            verifier_time: Some(Duration::from_secs_f64(verifier_s)),
            ahead_guess: (all && (next_d > 0 || !block.is_empty())).then_some(guess_ok),
        });
    }
    (committed as f64 / time, committed as f64 / rounds as f64, 1e3 * verifier_total_s / committed as f64)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let confidence = !args.iter().any(|a| a == "--no-confidence");
    let rtts: Vec<f64> = args.iter().filter_map(|a| a.parse().ok()).collect();
    for rtt_ms in if rtts.is_empty() { vec![0.0, 50.0, 100.0, 200.0] } else { rtts } {
        let mut line = format!("RTT {rtt_ms:>3} ms:");
        let mut best = 0.0f64;
        for d in 1..=6 {
            let (rate, _, verifier_ms) = run(Some(d), rtt_ms / 1e3, confidence, 1);
            best = best.max(rate);
            line += &format!("  d={d} {rate:.2} ({verifier_ms:.0} ms)");
        }
        let (rate, per_round, verifier_ms) = run(None, rtt_ms / 1e3, confidence, 1);
        line += &format!(
            "  | auto {rate:.2} ({:+.1}% vs best fixed, {per_round:.2} tokens/round, {verifier_ms:.0} verifier ms/token)",
            100.0 * (rate / best - 1.0)
        );
        println!("{line}");
    }
}
