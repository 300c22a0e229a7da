//! Replays a `--draft-len auto` gateway's decisions from its log: the same observations, in the same
//! order, through a fresh [`DraftController`] per generation seeded from the gateway-wide estimates, as
//! the engine's loop does. Prints, per round, the length the gateway chose beside the replayed one and
//! the estimates it was chosen with (the per-size verifier times especially, which the log line does not
//! carry), so a choice can be explained after the fact and a rule change tried on real rounds.
//!
//!   cargo run --release --example draft_control_replay -p spade-core -- GATEWAY_LOG [MAX_TOKENS] [--max-draft=8] [--pass-ms=A,B,…]
//!
//! The log needs `SPADE_GATEWAY_LOG=info,spade_engine=debug` (the benchmark's gateways, with that variable
//! set, write it under `bench/results/…/gateway-speculative-auto-*.log`): the line with the verifier's
//! pass times the gateway seeded from (`pass_ms=[…]`), then one `round` line per verify call. A
//! generation starts at its prompt's call: `first_call=true`, or, in logs older than that field, a
//! call that drafted nothing and took the verifier over a second. `MAX_TOKENS` (default 128, the
//! benchmark's `--long-max-tokens` under `--quick`) caps lengths near a generation's end as the loop
//! does. What the replay cannot see: the draft's confidences (used only by the early stop, off by
//! default) and whether other generations were drafting (none in the benchmark). Logs from before the
//! seeding line was written need `--pass-ms=…`, the pass times the gateway is thought to have seeded from.

use std::time::Duration;

use spade_core::draft_control::{BlockEnd, BlockKind, DraftController, Estimates, RoundObservation};

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn number(line: &str, key: &str) -> Option<f64> {
    field(line, key)?.parse().ok()
}

/// The `pass_ms=[…]` list of the seeding line, in seconds.
fn pass_times(line: &str) -> Option<Vec<f64>> {
    let list = line.split_once("pass_ms=[")?.1.split_once(']')?.0;
    list.split(',').map(|ms| ms.trim().parse::<f64>().ok().map(|ms| ms / 1e3)).collect()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: draft_control_replay GATEWAY_LOG [MAX_TOKENS] [--max-draft=N]");
    let rest: Vec<String> = args.collect();
    let max_tokens: usize = rest.iter().find(|a| !a.starts_with("--")).map_or(128, |a| a.parse().expect("MAX_TOKENS, a number"));
    let max_draft: usize = rest.iter().find_map(|a| a.strip_prefix("--max-draft=")).map_or(8, |a| a.parse().expect("--max-draft=N"));
    let given: Option<Vec<f64>> = rest
        .iter()
        .find_map(|a| a.strip_prefix("--pass-ms="))
        .map(|list| list.split(',').map(|ms| ms.parse::<f64>().expect("--pass-ms=A,B,… in milliseconds") / 1e3).collect());
    let text = std::fs::read_to_string(&path).expect("a readable gateway log");

    let mut gateway = Estimates::default();
    if let Some(pass_s) = &given {
        gateway.seed_verifier_passes(pass_s);
    }
    let mut generation: Option<(DraftController, usize)> = None;
    let (mut rounds, mut agreed, mut prompt_pending) = (0, 0, false);
    for line in text.lines() {
        if let Some(pass_s) = line.contains("draft-length model seeded").then(|| pass_times(line)).flatten() {
            gateway.seed_verifier_passes(&pass_s);
            println!("seeded: pass_ms {:?}", pass_s.iter().map(|s| (s * 1e3).round()).collect::<Vec<_>>());
            continue;
        }
        if !line.contains(" round ") && !line.trim_end().ends_with(" round") {
            continue;
        }
        let (Some(chosen), Some(drafted), Some(accepted)) = (number(line, "chosen"), number(line, "drafted"), number(line, "accepted")) else {
            continue;
        };
        let (chosen, drafted, accepted) = (chosen as usize, drafted as usize, accepted as usize);
        let ms = |key| Duration::from_secs_f64(number(line, key).unwrap_or(0.0) / 1e3);
        let (call, verifier) = (ms("call_ms"), ms("verifier_ms"));
        let first_call = match field(line, "first_call") {
            Some(flag) => flag == "true",
            None => drafted == 0 && verifier > Duration::from_secs(1),
        };
        if first_call {
            // A new generation: its controller starts from what the gateway has learned so far.
            let mut controller = DraftController::new(max_draft, true, gateway.clone()).with_block_end(BlockEnd::Length);
            // During the prompt's call the loop already chose the block to draft ahead.
            if controller.choose(BlockKind::Ahead).min(max_tokens.saturating_sub(2)) == 0 {
                controller.probe();
            }
            controller.observe_link(call, verifier);
            gateway.observe_link(call, verifier);
            generation = Some((controller, 1));
            prompt_pending = field(line, "guess_matched") == Some("true");
            println!("generation");
            continue;
        }
        let Some((controller, committed)) = generation.as_mut() else { continue };
        let remaining = max_tokens.saturating_sub(*committed);
        let from_ahead = field(line, "from_ahead") == Some("true");
        let kind = if from_ahead { BlockKind::Ahead } else { BlockKind::Serial };
        let replayed = controller.choose(kind).min(remaining.saturating_sub(1));
        let choice = controller.choice();
        // The loop chooses again for the block it drafts ahead during the call, and probes on a 0.
        let after = remaining.saturating_sub(drafted + 1);
        if after > 1 && controller.choose(BlockKind::Ahead).min(after - 1) == 0 {
            controller.probe();
        }
        rounds += 1;
        agreed += usize::from(replayed == chosen);
        let estimates = controller.estimates();
        let v: Vec<String> = (1..=max_draft + 1).map(|rows| format!("{:.0}", estimates.verify_time(rows) * 1e3)).collect();
        println!(
            "chosen {chosen} replayed {replayed}{} | sent {drafted} accepted {accepted} verifier {} ms | model: V(1..) {} ms, rtt {:.0} ms, draft step {:.0} ms, beta {:.2}, acceptance {:.3} (chosen with {:.3})",
            if replayed == chosen { "" } else { " *" },
            verifier.as_millis(),
            v.join(" "),
            choice.rtt_s * 1e3,
            choice.t_draft_s * 1e3,
            choice.beta,
            choice.acceptance,
            choice.alpha.first().copied().unwrap_or(0.0),
        );
        let mut round = RoundObservation {
            drafted,
            accepted,
            confidences: Vec::new(),
            draft_step: ms("draft_step_ms"),
            draft_start: ms("draft_start_ms"),
            call_latency: call,
            verifier_time: Some(verifier),
            ahead_guess: field(line, "guess_matched").map(|g| g == "true"),
        };
        // The block drafted ahead during the prompt's call also waited for the draft's prompt.
        if from_ahead && std::mem::take(&mut prompt_pending) {
            round.draft_start = Duration::ZERO;
        }
        prompt_pending = false;
        controller.observe(&round);
        gateway.observe(&round);
        *committed += accepted.min(drafted) + 1;
    }
    println!("rounds {rounds}, replayed choice equal to the gateway's in {agreed}");
}
