use super::*;
use crate::prompts::Message;

fn prompt(id: &str, category: Category, max_tokens: u32) -> Prompt {
    Prompt {
        id: id.into(),
        category,
        messages: vec![Message { role: "user".into(), content: id.into() }],
        max_tokens,
    }
}

fn sizes() -> Sizes {
    Sizes {
        draft_lens: vec![4, 1, 4],
        no_ahead_lens: vec![4],
        auto: true,
        draft_only: true,
        auto_max_draft_len: 8,
        accounting_prompts: 6,
        sampled_prompts: 2,
        long_prompts: 1,
        max_tokens: 24,
        long_max_tokens: 160,
        temperature: 0.8,
        reps: 3,
        rtts_ms: vec![50, 0],
        drift: Some(Drift { from_ms: 20, to_ms: 150 }),
    }
}

fn prompts() -> Vec<Prompt> {
    let mut p: Vec<Prompt> =
        (0..3).map(|i| prompt(&format!("code-{i}"), Category::Code, 64)).collect();
    p.push(prompt("long-0", Category::Code, 256));
    p.extend((0..2).map(|i| prompt(&format!("qa-{i}"), Category::Qa, 64)));
    p.push(prompt("chat-0", Category::Chat, 64));
    p.push(prompt("long-1", Category::Chat, 200));
    p
}

fn ids(plan: &Plan, list: &[usize]) -> Vec<String> {
    list.iter().map(|&i| plan.prompts[i].id.clone()).collect()
}

#[test]
fn categories_alternate_and_long_prompts_are_apart() {
    let plan = Plan::new(prompts(), &sizes()).unwrap();
    assert_eq!(
        ids(&plan, &plan.accounting),
        ["code-0", "chat-0", "qa-0", "code-1", "qa-1", "code-2"]
    );
    assert_eq!(ids(&plan, &plan.long), ["long-0"]);
    assert_eq!(ids(&plan, &plan.sampled), ["code-0", "chat-0"]);
}

#[test]
fn a_repetition_runs_every_mode_at_one_link_before_the_next_link() {
    let plan = Plan::new(prompts(), &sizes()).unwrap();
    let order =
        |rep| plan.schedule(rep).into_iter().map(|(mode, n, _)| (n, mode)).collect::<Vec<_>>();
    let spec = [
        Mode::TargetOnly,
        Mode::Speculative(1),
        Mode::Speculative(4),
        Mode::Auto,
        Mode::NoAhead(4),
    ];
    let mut even = vec![
        (0, Mode::TargetOnly),
        (0, Mode::DraftOnly),
        (0, Mode::Speculative(1)),
        (0, Mode::Speculative(4)),
        (0, Mode::Auto),
        (0, Mode::NoAhead(4)),
    ];
    even.extend((1..plan.gateways(0, Mode::Auto).len()).flat_map(|n| spec.map(|m| (n, m))));
    assert_eq!(order(0), even);
    // Odd repetitions reverse the modes after target-only, so the turns of a link differ between repetitions.
    let odd = order(1);
    assert_eq!(
        odd[..6],
        [
            (0, Mode::TargetOnly),
            (0, Mode::NoAhead(4)),
            (0, Mode::Auto),
            (0, Mode::Speculative(4)),
            (0, Mode::Speculative(1)),
            (0, Mode::DraftOnly)
        ]
    );
    assert_eq!(
        odd[6..11],
        [
            Mode::TargetOnly,
            Mode::NoAhead(4),
            Mode::Auto,
            Mode::Speculative(4),
            Mode::Speculative(1)
        ]
        .map(|m| (1, m))
    );
    // The same gateways as mode by mode, each once.
    let count: usize = plan.modes.iter().map(|&m| plan.gateways(0, m).len()).sum();
    assert_eq!(order(0).len(), count);
}

#[test]
fn a_link_holds_every_mode_at_it_and_its_prompts_take_turns() {
    let plan = Plan::new(prompts(), &sizes()).unwrap();
    for rep in 0..2 {
        let links = plan.links(rep);
        assert_eq!(links.concat(), plan.schedule(rep));
        assert_eq!(links.len(), plan.gateways(rep, Mode::Auto).len());
        for (n, link) in links.iter().enumerate() {
            assert!(link.iter().all(|(_, i, _)| *i == n));
        }
        // Draft-only has no link: it is only at the first.
        assert_eq!((links[0].len(), links[1].len()), (6, 5));
    }
    assert_eq!(turns(0, 0, 4), [0, 1, 2, 3]);
    assert_eq!(turns(0, 1, 4), [1, 2, 3, 0]);
    assert_eq!(turns(1, 3, 4), [0, 1, 2, 3]);
    // Over as many prompts as gateways, every gateway takes every place once.
    for place in 0..5 {
        let mut at: Vec<usize> = (0..5).map(|k| turns(2, k, 5)[place]).collect();
        at.sort_unstable();
        assert_eq!(at, [0, 1, 2, 3, 4]);
    }
}

#[test]
fn modes_and_rtts_are_sorted_and_deduplicated() {
    let plan = Plan::new(prompts(), &sizes()).unwrap();
    assert_eq!(
        plan.modes,
        vec![
            Mode::TargetOnly,
            Mode::DraftOnly,
            Mode::Speculative(1),
            Mode::Speculative(4),
            Mode::Auto,
            Mode::NoAhead(4)
        ]
    );
    assert_eq!(plan.rtts_ms, vec![0, 50]);
    let mut quick = sizes();
    (quick.auto, quick.draft_only, quick.no_ahead_lens) = (false, false, vec![]);
    assert_eq!(
        Plan::new(prompts(), &quick).unwrap().modes,
        vec![Mode::TargetOnly, Mode::Speculative(1), Mode::Speculative(4)]
    );
}

#[test]
fn gateway_arguments_per_mode() {
    let args = |m: Mode| m.gateway_args(6).join(" ");
    assert_eq!(args(Mode::TargetOnly), "--draft-len 0");
    assert_eq!(args(Mode::Speculative(4)), "--draft-len 4 --draft-ahead true");
    assert_eq!(args(Mode::Speculative(12)), "--draft-len 12 --draft-ahead true --max-draft-len 12");
    assert_eq!(args(Mode::NoAhead(4)), "--draft-len 4 --draft-ahead false");
    assert_eq!(args(Mode::Auto), "--draft-len auto --draft-ahead true --max-draft-len 6");
    assert!(args(Mode::DraftOnly).contains("--offline-fallback draft"));
    assert!(
        Mode::Auto.speculates() && Mode::NoAhead(2).speculates() && !Mode::TargetOnly.speculates()
    );
    assert_eq!(Mode::NoAhead(4).slug(), "speculative-d4-no-ahead");
}

#[test]
fn every_link_gets_its_own_gateway() {
    let plan = Plan::new(prompts(), &sizes()).unwrap();
    let kinds = |rep, mode| {
        plan.gateways(rep, mode)
            .iter()
            .map(|g| g.iter().map(|b| (b.kind, b.rtt_ms)).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    let spec = Mode::Speculative(4);
    let (acc, smp, tim, dri) = (Kind::Accounting, Kind::Sampled, Kind::Timing, Kind::Drift);
    assert_eq!(
        kinds(0, spec),
        vec![vec![(tim, 0), (acc, 0), (smp, 0)], vec![(tim, 50)], vec![(dri, 20)]]
    );
    assert_eq!(
        kinds(1, Mode::Auto),
        vec![vec![(tim, 0), (smp, 0)], vec![(tim, 50)], vec![(dri, 20)]]
    );
    assert_eq!(
        kinds(1, Mode::DraftOnly),
        vec![vec![(tim, 0), (smp, 0)]],
        "no link for the draft alone"
    );
    let groups = plan.gateways(0, spec);
    let (timing, accounting, drift) = (&groups[0][0], &groups[0][1], &groups[2][0]);
    assert_eq!((timing.max_tokens, accounting.max_tokens), (160, 24));
    assert_eq!((drift.rtt_ms, drift.drift_to_ms, drift.max_tokens), (20, Some(150), 160));
    assert_eq!(plan.max_tokens_of(timing, timing.prompts[0]), 160);
    assert_eq!(timing.prompts, plan.long);
}

#[test]
fn without_rtt_zero_or_drift_or_accounting_no_empty_gateway_starts() {
    let mut s = sizes();
    (s.rtts_ms, s.drift, s.accounting_prompts, s.sampled_prompts) = (vec![100], None, 0, 0);
    let plan = Plan::new(prompts(), &s).unwrap();
    assert_eq!(plan.gateways(0, Mode::Auto).len(), 1);
    assert!(plan.gateways(0, Mode::DraftOnly).is_empty());
}

#[test]
fn bad_sizes_are_refused() {
    let with = |f: fn(&mut Sizes)| {
        let mut s = sizes();
        f(&mut s);
        Plan::new(prompts(), &s)
    };
    assert!(with(|s| s.draft_lens = vec![0]).is_err());
    assert!(with(|s| s.draft_lens = vec![33]).is_err());
    assert!(with(|s| s.no_ahead_lens = vec![0]).is_err());
    assert!(with(|s| s.auto_max_draft_len = 0).is_err());
    assert!(with(|s| s.long_prompts = 3).is_err());
    assert!(with(|s| s.long_prompts = 0).is_err());
    assert!(with(|s| s.accounting_prompts = 7).is_err());
    assert!(with(|s| s.reps = 0).is_err());
    assert!(with(|s| s.rtts_ms.clear()).is_err());
    assert!(with(|s| s.long_max_tokens = 0).is_err());
}

#[test]
fn estimates_grow_with_rtt_and_length_and_shrink_with_draft_ahead() {
    assert!(
        estimate_request(Mode::TargetOnly, 24, 0.1)
            > estimate_request(Mode::TargetOnly, 24, 0.0) + 2.0
    );
    assert!(
        estimate_request(Mode::Speculative(4), 160, 0.0)
            > estimate_request(Mode::Speculative(4), 24, 0.0)
    );
    assert!(
        estimate_request(Mode::NoAhead(4), 160, 0.05)
            > estimate_request(Mode::Speculative(4), 160, 0.05)
    );
    let plan = Plan::new(prompts(), &sizes()).unwrap();
    let drift = &plan.gateways(0, Mode::Auto)[2][0];
    let (at20, at150) =
        (estimate_request(Mode::Auto, 160, 0.02), estimate_request(Mode::Auto, 160, 0.15));
    assert!(plan.estimate_batch(drift) > at20 && plan.estimate_batch(drift) < at150);
    assert!(plan.estimate_seconds() > VERIFIER_START_S);
}
