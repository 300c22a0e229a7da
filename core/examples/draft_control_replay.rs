//! Replays a `--draft-len auto` gateway's decisions from its log: each generation's rounds, as the loop
//! logged them ([`RoundRecord`]), through a fresh [`DraftController`] seeded from the gateway-wide
//! estimates, fed the same observations in the same order as the loop fed its own. Prints, per round,
//! the length the gateway chose beside the replayed one and the estimates it was chosen with (the
//! per-size verifier times especially, which the record does not carry), so a choice can be explained
//! after the fact and a rule change tried on real rounds.
//!
//!   cargo run --release --example draft_control_replay -p spade-core -- GATEWAY_LOG [--pass-ms=A,B,…]
//!
//! The log needs `SPADE_GATEWAY_LOG=info,spade_engine=debug` (text or JSON lines): the line with the
//! verifier's pass times the gateway seeded from (`pass_ms=[…]`), then one record per verify call, read
//! with the loop's own type ([`RoundRecord::from_log_line`]): a change to the record breaks this
//! example's build, or stops it at the first record it cannot read, rather than replaying misread
//! rounds. A generation starts at its prompt's call (`first_call`); generations must not interleave
//! (one request at a time, as the benchmark sends them). What the replay cannot see: whether other
//! generations were drafting, which keeps the loop from drafting ahead (none in the benchmark), and
//! times finer than a microsecond. Logs from before the seeding line was written need `--pass-ms=…`, the
//! pass times the gateway is thought to have seeded from; logs from before the record, none of whose
//! rounds it finds, cannot be replayed.

use std::time::Duration;

use spade_core::draft_control::{BlockKind, DraftController, Estimates, RoundRecord};

/// The `pass_ms=[…]` list of the seeding line, in seconds.
fn pass_times(line: &str) -> Option<Vec<f64>> {
    let list = line.split_once("pass_ms=[")?.1.split_once(']')?.0;
    list.split(',').map(|ms| ms.trim().parse::<f64>().ok().map(|ms| ms / 1e3)).collect()
}

/// What the loop does after sending the block of `round`: it chooses the block to draft ahead during
/// the call, and, drafting ahead with nothing to draft, whether to probe.
fn choose_ahead(controller: &mut DraftController, round: &RoundRecord) {
    let after = round.remaining.saturating_sub(round.drafted + 1);
    if after > 1 && controller.choose(BlockKind::Ahead).min(after - 1) == 0 && round.draft_ahead {
        controller.probe();
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: draft_control_replay GATEWAY_LOG [--pass-ms=A,B,…]");
    let given: Option<Vec<f64>> =
        args.find_map(|a| a.strip_prefix("--pass-ms=").map(str::to_string)).map(|list| {
            list.split(',')
                .map(|ms| ms.parse::<f64>().expect("--pass-ms=A,B,… in milliseconds") / 1e3)
                .collect()
        });
    let text = std::fs::read_to_string(&path).expect("a readable gateway log");

    let mut gateway = Estimates::default();
    if let Some(pass_s) = &given {
        gateway.seed_verifier_passes(pass_s);
    }
    let mut generation: Option<DraftController> = None;
    let (mut rounds, mut agreed) = (0, 0);
    for line in text.lines() {
        if let Some(pass_s) =
            line.contains("draft-length model seeded").then(|| pass_times(line)).flatten()
        {
            gateway.seed_verifier_passes(&pass_s);
            println!(
                "seeded: pass_ms {:?}",
                pass_s.iter().map(|s| (s * 1e3).round()).collect::<Vec<_>>()
            );
            continue;
        }
        let Some(round) = RoundRecord::from_log_line(line) else { continue };
        let round =
            round.unwrap_or_else(|e| panic!("a round record this build cannot read ({e}): {line}"));
        let verifier = round.verifier_us.map(Duration::from_micros);
        if round.first_call {
            // A new generation: its controller starts from what the gateway has learned so far. The
            // prompt's call sends no drafts and teaches only the link.
            let mut controller =
                DraftController::new(round.max_draft, round.draft_ahead, gateway.clone());
            choose_ahead(&mut controller, &round);
            if let Some(verifier) = verifier {
                let call = Duration::from_micros(round.call_us);
                controller.observe_link(call, verifier);
                gateway.observe_link(call, verifier);
            }
            generation = Some(controller);
            println!("generation");
            continue;
        }
        let Some(controller) = generation.as_mut() else { continue };
        let kind = if round.from_ahead { BlockKind::Ahead } else { BlockKind::Serial };
        let replayed = controller.choose(kind).min(round.remaining.saturating_sub(1));
        let choice = controller.choice();
        choose_ahead(controller, &round);
        rounds += 1;
        agreed += usize::from(replayed == round.chosen);
        let estimates = controller.estimates();
        let v: Vec<String> = (1..=round.max_draft + 1)
            .map(|rows| format!("{:.0}", estimates.verify_time(rows) * 1e3))
            .collect();
        println!(
            "chosen {} replayed {replayed}{} | sent {} accepted {} verifier {} ms | model: V(1..) {} ms, rtt {:.0} ms, draft step {:.0} ms, beta {:.2}, acceptance {:.3} (chosen with {:.3})",
            round.chosen,
            if replayed == round.chosen { "" } else { " *" },
            round.drafted,
            round.accepted,
            verifier.unwrap_or_default().as_millis(),
            v.join(" "),
            choice.rtt_s * 1e3,
            choice.t_draft_s * 1e3,
            choice.beta,
            choice.acceptance,
            choice.alpha.first().copied().unwrap_or(0.0),
        );
        let observed = round.observation();
        controller.observe(&observed);
        gateway.observe(&observed);
    }
    println!("rounds {rounds}, replayed choice equal to the gateway's in {agreed}");
}
