//! `auto` against fixed draft lengths, with draft-ahead, on fresh generations that replay real
//! acceptance: tokens per second of round time, so the controller can be tried in seconds instead of a
//! 15-minute benchmark. Beside each rate: the verifier's milliseconds per committed token (the cloud's cost).
//!
//!   cargo run --release --example draft_control_sim -p spade-core -- TRACE_FILE [RTT_MS ... | drift] [--warm] [--rounds] [--alignment] [--pass-ms=…] [--seed-ms=…] [--step-ms=…] [--phases] [--block-end=length|early|confidence]
//!
//! A trace line may go on, after a space, with the draft's confidence at each position, comma-separated
//! (`engine/examples/acceptance_trace.rs` writes such lines: `bench/reference/acceptance-confidence-traces.txt`,
//! the same four texts teacher-forced); `auto`'s blocks then end where `--block-end` says (the gateway's
//! default, `confidence`, unless given), and without confidences the rule reads acceptance by position alone.
//!
//! `TRACE_FILE` holds one generation per line: for each of its output positions `1` where the draft
//! model's greedy token equals the target's (given the target's text before it) and `0` where not.
//! `scripts/acceptance-trace.py` writes it from a gateway's per-round log at `--draft-len 1`, which
//! sees every position (a drafted token, then the guess after it). `bench/reference/acceptance-traces.txt`
//! holds the benchmark's four long prompts (160 tokens, Dec 3: `SPADE_GATEWAY_LOG=info,spade_engine=debug
//! bash scripts/bench.sh --quick --rtts-ms 0 --drift-ms none --prompts 0 --draft-lens 1 --auto false
//! --long-prompts 4 --long-max-tokens 160 --reps 1`, then the script on its d=1 gateway log). Under greedy decoding a trace fixes
//! every round's outcome at any draft length, so each mode replays the same text. Every generation starts
//! from a fresh gateway's estimates (seeded with the verifier's pass times), as the benchmark's long
//! prompts do (`--warm`: one gateway serves them all in turn, seeding each from what it learned); the
//! prompt's call is not timed. `drift` switches the RTT from 20 to 150 ms at the middle of each generation.
//! `--rounds` prints `auto`'s rounds. `--seed-ms=A,B,…` seeds the gateways with other pass times than the
//! world's (the verifier's start-up timings are off by 10-15% per size against its calls in a run).
//! `--phases` gives the host slow stretches, as the benchmark's logs show (five 5-row calls at 245-266 ms
//! between 3-row calls at 150-175, where 5 rows took 172 ms in most calls): from a call at normal speed
//! the next is 40% slower with probability 0.03, and a slow stretch ends after each call with probability
//! 0.25 (four calls on average, 11% of them), with per-call noise 0.08. `--alignment` prints, per trace and fixed length, the tokens a round
//! commits on that text against what independent acceptance at the text's own rate predicts: under greedy
//! decoding a fixed length meets the same rejections at the same places of its blocks in every run, so on
//! one text some lengths are luckier than the rate says, and no estimate of the rate can foresee which.
//!
//! The world (the quick benchmark's per-round log on the two-core emulation, Qwen2.5-Coder 0.5B
//! drafting for 1.5B, Dec 3): the verifier's pass of 1-9 rows takes [`PASS_MS`] with log-normal noise
//! (sigma 0.1), a draft step 32 ms (+-15%), a block's start 5 ms.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use spade_core::draft_control::{BlockEnd, BlockKind, BlockOdds, DraftController, Estimates, RoundObservation};

const MAX_DRAFT: usize = 8;
/// The verifier's pass by scored rows (1, 2, …), milliseconds: `/v1/info`'s `pass_ms` after the benchmark
/// (`--pass-ms=A,B,…` replaces it).
const PASS_MS: [f64; 9] = [57.0, 117.0, 144.0, 176.0, 206.0, 211.0, 235.0, 282.0, 319.0];
/// The draft model's step, seconds (`--step-ms=` replaces it).
const STEP_S: f64 = 0.032;
const START_S: f64 = 0.005;
/// Generations replayed per trace (each with its own noise).
const REPEATS: u64 = 8;

struct World<'a> {
    pass_ms: &'a [f64],
    step_s: f64,
    phases: bool,
    /// Whether the host is in a slow stretch (`--phases`).
    slow: bool,
    rng: ChaCha8Rng,
    accepted: Vec<bool>,
    /// The draft's confidence at each position (empty: the trace has none).
    confidences: Vec<f32>,
    rtt: Link,
}

#[derive(Clone, Copy)]
enum Link {
    Fixed(f64),
    /// 20 ms until half the text is committed, then 150 ms.
    Drift,
}

impl World<'_> {
    /// Whether the draft's token at `position` is the target's (past the trace: no).
    fn agrees(&self, position: usize) -> bool {
        self.accepted.get(position).copied().unwrap_or(false)
    }

    fn confidence(&self, position: usize) -> f32 {
        self.confidences.get(position).copied().unwrap_or(f32::NAN)
    }

    fn rtt_s(&self, committed: usize) -> f64 {
        match self.rtt {
            Link::Fixed(s) => s,
            Link::Drift if committed < self.accepted.len() / 2 => 0.020,
            Link::Drift => 0.150,
        }
    }

    fn noise(&mut self, sigma: f64) -> f64 {
        // Box-Muller, for a log-normal factor.
        let (u, v): (f64, f64) = (self.rng.random_range(1e-12..1.0), self.rng.random());
        (sigma * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()).exp()
    }

    fn verify_s(&mut self, rows: usize) -> f64 {
        let (last, known) = (self.pass_ms[self.pass_ms.len() - 1], self.pass_ms.len());
        let ms = self.pass_ms.get(rows - 1).copied().unwrap_or(last + 40.0 * (rows - known) as f64);
        if !self.phases {
            return ms / 1e3 * self.noise(0.1);
        }
        self.slow = self.rng.random::<f64>() < if self.slow { 0.75 } else { 0.03 };
        ms / 1e3 * self.noise(0.08) * if self.slow { 1.4 } else { 1.0 }
    }

    fn step_s(&mut self) -> f64 {
        self.step_s * self.rng.random_range(0.85..1.15)
    }
}

/// A block drafted from `start`: how many tokens, the drafting time and the step time.
#[derive(Clone, Copy, Default)]
struct Block {
    start: usize,
    len: usize,
    drafting_s: f64,
    step_s: f64,
}

fn draft(world: &mut World, start: usize, len: usize) -> Block {
    let step_s = world.step_s();
    Block { start, len, drafting_s: if len > 0 { START_S + step_s * len as f64 } else { 0.0 }, step_s }
}

/// How many of up to `cap` tokens from `start` a block drafts: all of them, or (`auto` with blocks that
/// end on confidence) until the controller's [`DraftController::keep_drafting`] says stop.
fn block_len(ctl: &DraftController, world: &World, start: usize, cap: usize, fixed: Option<usize>) -> usize {
    if fixed.is_some() {
        return cap;
    }
    let mut odds = BlockOdds::default();
    let mut len = 0;
    while len < cap {
        len += 1;
        if !ctl.keep_drafting(&mut odds, world.confidence(start + len - 1)) {
            break;
        }
    }
    len
}

/// Seconds of round time and verifier seconds for one generation, with a fixed length, or `auto` when
/// `fixed` is None; `log`: print each round (`drafted/accepted`, `A` when drafted ahead) and what `auto`
/// chose with (the pooled acceptance, plain and optimistic as chosen with at position 0).
fn generation(fixed: Option<usize>, (accepted, confidences): (&[bool], &[f32]), rtt: Link, seed: u64, gateway: &mut Estimates, setup: &Setup) -> (f64, f64) {
    let log = setup.log && fixed.is_none() && seed.is_multiple_of(1000);
    let mut world = World {
        pass_ms: &setup.pass_ms,
        step_s: setup.step_s,
        phases: setup.phases,
        slow: false,
        rng: ChaCha8Rng::seed_from_u64(seed),
        accepted: accepted.to_vec(),
        confidences: confidences.to_vec(),
        rtt,
    };
    let mut ctl = DraftController::new(MAX_DRAFT, true, gateway.clone()).with_block_end(setup.block_end);
    // The most the next block may draft.
    let choose = |ctl: &mut DraftController, kind| {
        fixed.unwrap_or_else(|| {
            ctl.choose(kind);
            ctl.block_cap()
        })
    };
    // Position 0 is the prompt call's token; the draft guessed it while that call ran (hidden under the
    // prompt's processing) and drafted on from there when the guess was right.
    let mut committed = 1;
    let first = choose(&mut ctl, BlockKind::Ahead);
    let first = block_len(&ctl, &world, 1, first, fixed);
    let mut ahead = world.agrees(0).then(|| Block { drafting_s: 0.0, ..draft(&mut world, 1, first) });
    let (mut time, mut verifier_total_s) = (0.0, 0.0);
    while committed < accepted.len() {
        let from_ahead = ahead.is_some();
        let d = choose(&mut ctl, if from_ahead { BlockKind::Ahead } else { BlockKind::Serial });
        let block = match ahead.take() {
            // Cut to `d`, or sent short (the gateway's draft stream ends at the length it was started with).
            Some(pre) => Block { len: pre.len.min(d), ..pre },
            None => {
                let len = block_len(&ctl, &world, committed, d, fixed);
                draft(&mut world, committed, len)
            }
        };
        debug_assert_eq!(block.start, committed);
        let rtt_s = world.rtt_s(committed);
        let verifier_s = world.verify_s(block.len + 1);
        let call_s = rtt_s + verifier_s;
        verifier_total_s += verifier_s;
        let taken = (0..block.len).take_while(|&i| world.agrees(block.start + i)).count();
        let all = taken == block.len;
        // During the call: the guess of the verifier's token after the block, then the next block from there.
        let next_d = choose(&mut ctl, BlockKind::Ahead);
        let guess_at = block.start + block.len;
        let guess_ok = world.agrees(guess_at);
        let probes = next_d > 0 || block.len > 0 || ctl.probe();
        let next_len = block_len(&ctl, &world, guess_at + 1, next_d, fixed);
        let next = draft(&mut world, guess_at + 1, next_len);
        let ahead_s = START_S + world.step_s() + next.drafting_s;
        if log {
            let c = ctl.choice();
            println!(
                "  {}/{}{} (acceptance {:.2}, chosen with {:.2})",
                block.len,
                taken,
                if from_ahead { "A" } else { "" },
                c.acceptance,
                c.alpha.first().unwrap_or(&0.0)
            );
        }
        time += block.drafting_s + call_s;
        committed += taken + 1;
        if all && guess_ok && probes {
            ahead = Some(Block { drafting_s: (ahead_s - call_s).max(0.0), ..next });
        }
        let round = RoundObservation {
            drafted: block.len,
            accepted: taken,
            confidences: (0..block.len).map(|i| world.confidence(block.start + i)).collect(),
            draft_step: Duration::from_secs_f64(if block.len > 1 { block.step_s } else { 0.0 }),
            draft_start: Duration::from_secs_f64(if from_ahead || block.len == 0 { 0.0 } else { START_S }),
            call_latency: Duration::from_secs_f64(call_s),
            verifier_time: Some(Duration::from_secs_f64(verifier_s)),
            ahead_guess: (all && probes).then_some(guess_ok),
        };
        ctl.observe(&round);
        gateway.observe(&round);
    }
    (time, verifier_total_s)
}

#[derive(Clone)]
struct Setup {
    pass_ms: Vec<f64>,
    /// What the gateways are seeded with.
    seed_ms: Vec<f64>,
    step_s: f64,
    phases: bool,
    /// One gateway serves every generation in turn (its estimates seeding each); otherwise each
    /// generation meets a fresh gateway.
    warm: bool,
    /// Print `auto`'s rounds in each trace's first repeat.
    log: bool,
    /// Where `auto`'s blocks end.
    block_end: BlockEnd,
}

/// Committed tokens per second over every trace and repeat, and verifier milliseconds per token.
fn run(fixed: Option<usize>, traces: &[(Vec<bool>, Vec<f32>)], rtt: Link, setup: &Setup) -> (f64, f64) {
    let (mut tokens, mut time, mut verifier_s) = (0usize, 0.0, 0.0);
    let fresh = || {
        let mut e = Estimates::default();
        e.seed_verifier_passes(&setup.seed_ms.iter().map(|ms| ms / 1e3).collect::<Vec<_>>());
        e
    };
    let mut gateway = fresh();
    for repeat in 0..REPEATS {
        for (i, trace) in traces.iter().enumerate() {
            if !setup.warm {
                gateway = fresh();
            }
            if setup.log && fixed.is_none() && repeat == 0 {
                println!("trace {i}:");
            }
            let (t, v) = generation(fixed, (&trace.0, &trace.1), rtt, 1000 * i as u64 + repeat, &mut gateway, setup);
            (tokens, time, verifier_s) = (tokens + trace.0.len() - 1, time + t, verifier_s + v);
        }
    }
    (tokens as f64 / time, 1e3 * verifier_s / tokens as f64)
}

/// Tokens per round of each fixed length on each trace, against `sum_{j<=d} p^j` at the trace's acceptance `p`.
fn alignment(traces: &[Vec<bool>]) {
    for (i, trace) in traces.iter().enumerate() {
        let body = &trace[1..];
        let p = body.iter().filter(|&&a| a).count() as f64 / body.len().max(1) as f64;
        let mut line = format!("trace {i} (acceptance {p:.3}): tokens per round, replayed / independent");
        for d in 1..=MAX_DRAFT {
            let (mut at, mut rounds) = (0, 0);
            while at < body.len() {
                at += body[at..].iter().take(d).take_while(|&&a| a).count() + 1;
                rounds += 1;
            }
            let independent: f64 = (0..=d as i32).map(|j| p.powi(j)).sum();
            let replayed = body.len() as f64 / f64::from(rounds);
            line += &format!("  d={d} {replayed:.2}/{independent:.2} ({:+.1}%)", 100.0 * (replayed / independent - 1.0));
        }
        println!("{line}");
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: draft_control_sim TRACE_FILE [RTT_MS ... | drift]");
    let text = std::fs::read_to_string(&path).expect("readable trace file");
    let traces: Vec<(Vec<bool>, Vec<f32>)> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut fields = l.split_whitespace();
            let accepted = fields.next().unwrap_or_default().bytes().map(|b| b == b'1').collect();
            let confidences = fields.next().map_or(Vec::new(), |c| c.split(',').map(|c| c.parse().expect("a confidence")).collect());
            (accepted, confidences)
        })
        .collect();
    let (flags, rest): (Vec<String>, Vec<String>) = args.partition(|a| a.starts_with("--"));
    let list = |name: &str| {
        flags
            .iter()
            .find_map(|f| f.strip_prefix(name))
            .map(|list| list.split(',').map(|ms| ms.parse::<f64>().expect("milliseconds, A,B,…")).collect::<Vec<_>>())
    };
    let pass_ms = list("--pass-ms=").unwrap_or(PASS_MS.to_vec());
    let seed_ms = list("--seed-ms=").unwrap_or(pass_ms.clone());
    assert!(!pass_ms.is_empty() && !seed_ms.is_empty());
    if flags.iter().any(|f| f == "--alignment") {
        return alignment(&traces.iter().map(|t| t.0.clone()).collect::<Vec<_>>());
    }
    let setup = Setup {
        pass_ms,
        seed_ms,
        step_s: list("--step-ms=").map_or(STEP_S, |ms| ms[0] / 1e3),
        phases: flags.iter().any(|f| f == "--phases"),
        warm: flags.iter().any(|f| f == "--warm"),
        log: flags.iter().any(|f| f == "--rounds"),
        block_end: match flags.iter().find_map(|f| f.strip_prefix("--block-end=")) {
            None | Some("confidence") => BlockEnd::Confidence,
            Some("early") => BlockEnd::Early,
            Some("length") => BlockEnd::Length,
            Some(other) => panic!("--block-end={other}: length, early or confidence"),
        },
    };
    let links: Vec<(String, Link)> =
        if rest.is_empty() {
            [0.0, 20.0, 50.0, 100.0, 200.0]
                .map(|ms| (format!("RTT {ms:>3} ms"), Link::Fixed(ms / 1e3)))
                .into_iter()
                .chain([("drift     ".to_string(), Link::Drift)])
                .collect()
        } else {
            rest.iter()
                .map(|a| {
                    if a == "drift" {
                        (a.clone(), Link::Drift)
                    } else {
                        (format!("RTT {a:>3} ms"), Link::Fixed(a.parse::<f64>().expect("an RTT in ms") / 1e3))
                    }
                })
                .collect()
        };
    for (name, link) in links {
        let mut line = format!("{name}:");
        let (mut best, mut best_of_1_4) = (0.0f64, 0.0f64);
        for d in 1..=7 {
            let (rate, verifier_ms) = run(Some(d), &traces, link, &Setup { log: false, ..setup.clone() });
            best = best.max(rate);
            if d == 1 || d == 4 {
                best_of_1_4 = best_of_1_4.max(rate);
            }
            line += &format!("  d={d} {rate:.2} ({verifier_ms:.0})");
        }
        let (rate, verifier_ms) = run(None, &traces, link, &setup);
        line += &format!(
            "  | auto {rate:.2} ({verifier_ms:.0}) {:+.1}% vs best, {:+.1}% vs d=1,4",
            100.0 * (rate / best - 1.0),
            100.0 * (rate / best_of_1_4 - 1.0)
        );
        println!("{line}");
    }
}
