use super::*;
use crate::client::RoundTiming;

/// A request of batch `(rep, mode, kind, rtt_ms)` giving `(tokens, verify calls, seconds)`.
fn record(
    (rep, mode, kind, rtt_ms): (u32, Mode, Kind, u64),
    id: &str,
    text: &str,
    (tokens, calls, secs): (u64, u64, f64),
) -> Record {
    let (accepted, rejected) = if mode.speculates() { (tokens - calls, calls) } else { (0, 0) };
    let long = matches!(kind, Kind::Timing | Kind::Drift);
    Record {
        rep,
        mode,
        kind,
        rtt_ms,
        drift_to_ms: (kind == Kind::Drift).then_some(150),
        temperature: 0.0,
        max_tokens: if long { 160 } else { 24 },
        prompt_id: id.into(),
        category: Category::Code,
        outcome: Outcome {
            text: text.into(),
            completion_tokens: tokens,
            accepted,
            rejected,
            verify_calls: calls,
            bytes_sent: 10 * calls,
            bytes_received: 2 * calls,
            degraded: mode == Mode::DraftOnly,
            ttft_s: secs / 4.0,
            total_s: secs,
            ahead_drafted: if mode.speculates() && mode != Mode::NoAhead(4) { calls } else { 0 },
            ahead_used: if mode.speculates() && mode != Mode::NoAhead(4) { calls / 2 } else { 0 },
            timing: RoundTiming {
                draft_s: 0.1 * calls as f64,
                overlap_s: 0.05 * calls as f64,
                link_s: 0.02 * calls as f64,
                verifier_s: 0.2 * calls as f64,
            },
            auto: (mode == Mode::Auto).then(|| serde_json::json!({"draft": 3})),
            ..Outcome::default()
        },
    }
}

fn batch(records: Vec<Record>, verifier_cpu_s: f64) -> BatchResult {
    let r = &records[0];
    let calls = records.iter().map(|r| r.outcome.verify_calls as f64).sum();
    let drift_switch = (r.kind == Kind::Drift).then_some(DriftSwitch {
        request: 0,
        at_s: 1.0,
        share_of_request: Some(0.5),
    });
    BatchResult {
        batch: Batch {
            rep: r.rep,
            mode: r.mode,
            kind: r.kind,
            rtt_ms: r.rtt_ms,
            drift_to_ms: r.drift_to_ms,
            temperature: 0.0,
            max_tokens: r.max_tokens,
            prompts: vec![],
        },
        verifier: VerifierCounters { calls, ..Default::default() },
        records,
        verifier_cpu_s,
        gateway_cpu_s: 0.0,
        wall_s: 0.0,
        drift_switch,
    }
}

const T: Mode = Mode::TargetOnly;
const S: Mode = Mode::Speculative(4);
const MODES: [Mode; 2] = [T, S];

fn run() -> Vec<BatchResult> {
    let (acc, tim) = (Kind::Accounting, Kind::Timing);
    vec![
        batch(
            vec![
                record((0, T, acc, 0), "a", "x", (20, 20, 2.0)),
                record((0, T, acc, 0), "b", "y", (20, 20, 2.0)),
            ],
            4.0,
        ),
        batch(
            vec![
                record((0, S, acc, 0), "a", "x", (20, 5, 4.0)),
                record((0, S, acc, 0), "b", "y", (20, 5, 4.0)),
            ],
            2.0,
        ),
        batch(vec![record((0, T, tim, 0), "long", "long text", (160, 160, 16.0))], 0.0),
        batch(vec![record((0, S, tim, 0), "long", "long text", (160, 40, 16.0))], 0.0),
        batch(vec![record((1, S, tim, 0), "long", "long text", (160, 40, 8.0))], 0.0),
        batch(vec![record((2, S, tim, 0), "long", "long text", (160, 40, 32.0))], 0.0),
        batch(vec![record((0, S, tim, 50), "long", "long text", (160, 40, 20.0))], 0.0),
        batch(vec![record((0, T, tim, 50), "long", "long text", (160, 160, 40.0))], 0.0),
    ]
}

#[test]
fn accounting_figures_against_target_only() {
    let s = summarise(&run(), &MODES, &[0, 50], None);
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    let spec = &s.greedy[1];
    assert_eq!(spec.calls_per_request, 5.0);
    assert!((spec.calls_saved.unwrap() - 0.75).abs() < 1e-12);
    assert_eq!(spec.tokens_per_call, Some(4.0));
    assert_eq!(spec.acceptance, Some(30.0 / 40.0));
    assert_eq!(spec.verifier_cpu_s_per_token, Some(2.0 / 40.0));
    assert_eq!(spec.bytes_per_token, Some(120.0 / 40.0));
    assert_eq!(spec.identical, Some(Identity { identical: 2, compared: 2, differing: vec![] }));
    assert_eq!(
        spec.timing.tokens_per_s.unwrap().median,
        40.0 / 8.0,
        "the accounting requests' own speed"
    );
    let id = &s.identity[0];
    assert_eq!((id.accounting.compared, id.timing.compared, id.drift.compared), (2, 4, 0));
    assert!(s.lossless);
    assert_eq!(s.long_outputs.len(), 1);
    assert_eq!(s.long_outputs[0].tokens, 160);
}

#[test]
fn speed_is_the_median_over_repetitions_of_the_long_prompts() {
    let s = summarise(&run(), &MODES, &[0, 50], None);
    let row = s.speed.iter().find(|r| r.mode == S && r.rtt_ms == 0).unwrap();
    // 160 tokens in 16, 8 and 32 s.
    let tps = row.timing.tokens_per_s.unwrap();
    assert_eq!((tps.median, tps.min, tps.max, tps.reps), (10.0, 5.0, 20.0, 3));
    assert_eq!(row.timing.ttft_s.unwrap().median, 4.0);
    assert_eq!(row.timing.decode_tokens_per_s.unwrap().median, 159.0 / 12.0);
    assert_eq!(row.vs_target_only, Some(1.0));
    assert_eq!(row.tokens_per_call, Some(4.0));
    assert_eq!((row.min_tokens, row.requests), (160, 3));
    let at50 = s.speed.iter().find(|r| r.mode == S && r.rtt_ms == 50).unwrap();
    assert_eq!(at50.vs_target_only, Some(2.0));
    let goal50 = s.vs_target_only.iter().find(|v| v.rtt_ms == 50).unwrap();
    assert_eq!(
        (goal50.best, goal50.best_ratio, goal50.goal, goal50.met),
        (S, 2.0, Some(1.5), Some(true))
    );
    let goal0 = s.vs_target_only.iter().find(|v| v.rtt_ms == 0).unwrap();
    assert_eq!((goal0.goal, goal0.met), (Some(1.0), Some(true)));
    assert_eq!((goal0.gap, goal50.gap), (None, None), "goals met leave no gap");
}

#[test]
fn a_missed_goal_says_how_fast_the_verifier_would_have_to_be() {
    // A 400 ms round, 250 of it verifier, at 1.6x where 2x is the goal: the round must take
    // 320 ms, so the verifier 170 ms with the other 150 ms unchanged.
    let p = PerRound {
        rounds: 30.0,
        wall_s: 0.4,
        draft_s: 0.02,
        link_s: 0.105,
        verifier_s: 0.25,
        other_s: 0.025,
        overlap_s: 0.2,
    };
    let gap = GoalGap::of(&p, 1.6, 2.0).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    assert!(close(gap.round_needed_s, 0.32) && close(gap.verifier_needed_s, 0.17), "{gap:?}");
    assert!(gap.verifier_can_close_it());
    // At 0.5x of a 2x goal the round must take 100 ms, less than the other terms' 150 ms.
    let beyond = GoalGap::of(&p, 0.5, 2.0).unwrap();
    assert!(beyond.verifier_needed_s < 0.0 && !beyond.verifier_can_close_it());
    assert_eq!(GoalGap::of(&p, 2.0, 2.0), None);
}

#[test]
fn the_round_breakdown_divides_the_gateways_timing_by_verify_calls() {
    let s = summarise(&run(), &MODES, &[0, 50], None);
    let row = s.speed.iter().find(|r| r.mode == S && r.rtt_ms == 0).unwrap();
    let p = row.per_round.unwrap();
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(p.rounds, 40.0));
    assert!(close(p.wall_s, 56.0 / 120.0));
    assert!(
        close(p.draft_s, 0.1)
            && close(p.link_s, 0.02)
            && close(p.verifier_s, 0.2)
            && close(p.overlap_s, 0.05)
    );
    assert!(close(p.other_s, 56.0 / 120.0 - 0.32));
    assert_eq!(p.dominant(), "verifier");
    assert_eq!((row.ahead_used_per_round, row.ahead_used_per_drafted), (Some(0.5), Some(0.5)));
    let target = s.speed.iter().find(|r| r.mode == T && r.rtt_ms == 0).unwrap();
    assert_eq!(target.ahead_used_per_round, None, "target-only drafts nothing");
}

fn speed(mode: Mode, drift: bool, tps: f64) -> SpeedRow {
    let r = record(
        (0, mode, if drift { Kind::Drift } else { Kind::Timing }, 20),
        "long",
        "t",
        (100, 25, 100.0 / tps),
    );
    speed_row(mode, 20, drift.then_some(150), &[&r])
}

#[test]
fn auto_is_held_to_the_best_fixed_length() {
    let rows = [
        speed(T, false, 5.0),
        speed(Mode::Speculative(1), false, 10.0),
        speed(S, false, 8.0),
        speed(Mode::NoAhead(1), false, 20.0),
    ];
    let within = |auto: f64| {
        let mut r = rows.to_vec();
        r.push(speed(Mode::Auto, false, auto));
        auto_vs_fixed(&r).unwrap()
    };
    let a = within(9.6);
    assert_eq!(
        (a.best_fixed, a.best_fixed_tokens_per_s, a.fixed.len()),
        (1, 10.0, 2),
        "no-ahead lengths are not auto's rivals"
    );
    assert!(a.met && (a.auto_vs_best + 0.04).abs() < 1e-9);
    assert!(!within(9.4).met);
    assert_eq!(within(9.0).fixed, vec![(1, 10.0), (4, 8.0)]);
    assert!(auto_vs_fixed(&rows).is_none(), "no auto row, no comparison");
    assert_eq!(speed(Mode::Auto, false, 1.0).auto_last_draft, Some(3.0));
}

#[test]
fn auto_is_paired_with_the_best_fixed_length_within_each_repetition() {
    // Repetition 0 on a fast stretch of the host, repetition 1 on a slow one, 2 only for auto.
    let (a, d) = (Mode::Auto, Mode::Speculative(4));
    let records = [
        record((0, a, Kind::Timing, 0), "long-01", "x", (100, 30, 10.0)),
        record((0, d, Kind::Timing, 0), "long-01", "x", (100, 25, 8.0)),
        record((1, a, Kind::Timing, 0), "long-01", "x", (100, 30, 20.0)),
        record((1, d, Kind::Timing, 0), "long-01", "x", (100, 25, 25.0)),
        record((2, a, Kind::Timing, 0), "long-01", "x", (100, 30, 1.0)),
    ];
    let (auto, fixed): (Vec<&Record>, Vec<&Record>) = records.iter().partition(|r| r.mode == a);
    let p = paired_by_rep(&auto, &fixed).unwrap();
    assert_eq!(p.reps, 2, "a repetition without both modes is not a pair");
    assert!((p.min + 0.2).abs() < 1e-9 && (p.max - 0.25).abs() < 1e-9, "{p:?}");
    assert!(paired_by_rep(&auto, &[]).is_none());
}

#[test]
fn on_the_drift_case_auto_must_beat_every_fixed_length() {
    let drift = |auto: f64| {
        auto_vs_fixed(&[
            speed(Mode::Speculative(1), true, 10.0),
            speed(S, true, 8.0),
            speed(Mode::Auto, true, auto),
        ])
        .unwrap()
    };
    assert!(!drift(9.9).met, "within 5% is not enough under drift");
    assert!(drift(10.1).met);
    assert_eq!(drift(10.1).drift_to_ms, Some(150));
}

#[test]
fn a_differing_greedy_output_anywhere_breaks_losslessness() {
    let mut results = run();
    results[1].records[1].outcome.text = "z".into();
    let s = summarise(&results, &MODES, &[0], None);
    assert!(!s.lossless);
    assert_eq!(s.greedy[1].identical.as_ref().unwrap().differing, vec!["b".to_string()]);
    assert_eq!(s.greedy[1].identical.as_ref().unwrap().share(), 0.5);

    let mut results = run();
    results.push(batch(
        vec![record((0, S, Kind::Drift, 20), "long", "other text", (160, 40, 20.0))],
        0.0,
    ));
    let s = summarise(&results, &MODES, &[0, 50], Some(Drift { from_ms: 20, to_ms: 150 }));
    assert!(!s.lossless);
    assert_eq!(s.identity[0].drift.differing, vec!["long @ drift rep 0".to_string()]);
    assert_eq!(s.drift.len(), 1);
    assert_eq!((s.drift[0].switch_at_s, s.drift[0].switch_share), (Some(1.0), Some(0.5)));
}

#[test]
fn the_report_shows_the_acceptance_tables() {
    use crate::plan::{Plan, Sizes};
    use crate::prompts::{Message, Prompt};
    let prompt = |id: &str, max_tokens| Prompt {
        id: id.into(),
        category: Category::Code,
        messages: vec![Message { role: "user".into(), content: id.into() }],
        max_tokens,
    };
    let sizes = Sizes {
        draft_lens: vec![4],
        no_ahead_lens: vec![],
        auto: true,
        draft_only: false,
        auto_max_draft_len: 8,
        accounting_prompts: 2,
        sampled_prompts: 0,
        long_prompts: 1,
        max_tokens: 24,
        long_max_tokens: 160,
        temperature: 0.8,
        reps: 1,
        rtts_ms: vec![0, 50],
        drift: Some(Drift { from_ms: 20, to_ms: 150 }),
    };
    let plan =
        Plan::new(vec![prompt("a", 64), prompt("b", 64), prompt("long", 256)], &sizes).unwrap();
    let mut results = run();
    for (kind, rtt, tps) in
        [(Kind::Timing, 0, 11.0), (Kind::Timing, 50, 7.0), (Kind::Drift, 20, 9.0)]
    {
        results.push(batch(
            vec![record((0, Mode::Auto, kind, rtt), "long", "long text", (160, 40, 160.0 / tps))],
            0.0,
        ));
    }
    results.push(batch(
        vec![record((0, S, Kind::Drift, 20), "long", "long text", (160, 40, 20.0))],
        0.0,
    ));
    let modes = [T, S, Mode::Auto];
    let s = summarise(&results, &modes, &plan.rtts_ms, plan.drift);
    assert!(s.lossless, "{:?}", s.identity);
    let machine = crate::machine::Machine::describe();
    let setup = ["pinned".to_string()];
    let ctx = crate::report::Context {
        stamp: "now",
        command: "spade-bench --quick",
        machine: &machine,
        git: "git x",
        draft_model: "d",
        target_model: "t",
        wall_s: 60.0,
        plan: &plan,
        setup: &setup,
        verifier_pass_ms: &[40.0, 72.0, 100.0],
        compute_floor: crate::report::compute_floor_summary(
            "## round 1/1, 1 thread(s)\n\nratio (ours / llama.cpp), 1 thread(s): 1.5B-decode 1.11x\n\n\
             ## summary: median ratio over 1 round(s) [min, max]\n1 thread(s) 1.5B-block5-time       0.88x [0.88, 0.88]\n",
        ),
    };
    let md = crate::report::render(&ctx, &s);
    for needle in [
        "`spade-bench --quick`",
        "## auto vs the best fixed draft length",
        "| RTT 0 ms | 11.00 | d=4 | 10.00 | +10.0% |",
        "| drift 20→150 ms | 9.00 | d=4 | 8.00 | +12.5% |",
        "## Speculative (draft-ahead) vs target-only",
        "| 50 ms | 4.00 | 1.75x | speculative d=4 | 2.00x | 2.00x | ≥ 1.5x | yes | verifier | — |",
        "summary: median ratio over 1 round(s) [min, max]:\n\n- `1 thread(s) 1.5B-block5-time       0.88x [0.88, 0.88]`\n",
        "| RTT 50 ms | 7.00 | d=4 | 8.00 | -12.5% | -12.5% [-12.5, -12.5] | d=4: 8.00 | **no** |",
        "## Drift: RTT 20→150 ms mid-run",
        "switch at 1.0 s (50%)",
        "| speculative auto | — | 2/2 | 1/1 | identical |",
        "| long | 160 | 160 | yes |",
        "- Setup: pinned",
        "1 40 ms (1.0x) · 2 72 ms (1.8x) · 3 100 ms (2.5x)",
    ] {
        assert!(md.contains(needle), "missing {needle:?} in\n{md}");
    }
}

#[test]
fn counter_mismatches_short_outputs_and_missing_drift_switches_are_reported() {
    let mut results = run();
    results[1].verifier.calls = 3.0;
    let s = summarise(&results, &MODES, &[0], None);
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);

    let mut results = run();
    results[2].records[0].outcome.completion_tokens = 90;
    let mut drift =
        batch(vec![record((0, S, Kind::Drift, 20), "long", "long text", (160, 40, 20.0))], 0.0);
    drift.drift_switch = None;
    results.push(drift);
    let s = summarise(&results, &MODES, &[0], Some(Drift { from_ms: 20, to_ms: 150 }));
    assert!(s.warnings.iter().any(|w| w.contains("produced 90 tokens")), "{:?}", s.warnings);
    assert!(s.warnings.iter().any(|w| w.contains("never changed")), "{:?}", s.warnings);
}
