//! The mistral.rs drafter: its q is the distribution tokens are really drawn from, the 0.8.1
//! prefix-cache bug is worked around (all-accepted rounds draft like a cold engine), and its memory
//! stays bounded over a long run (tests/soak.rs, in a process of its own).

mod common;

use std::collections::HashMap;

use common::*;
use spade_core::{distribution, verify_block, SamplingParams};
use spade_engine::drafter::{DraftParams, DrafterOptions};
use spade_engine::speculative::{generate, GenerateParams};
use spade_engine::{Drafter, MistralDrafter, Scorer};

fn kl(p: &spade_core::SparseDist, q: &spade_core::SparseDist) -> f64 {
    p.entries().iter().map(|&(t, _)| {
        let (a, b) = (p.prob(t), q.prob(t).max(1e-12));
        a * (a / b).ln()
    }).sum()
}

/// Runs `rounds` speculative rounds with `warm` (normal prefix-cache use) and, on the same contexts,
/// a drafter reset before every call (`cold`). Returns (max KL over rounds that follow an
/// all-accepted round, number of such rounds).
async fn warm_vs_cold(warm: &MistralDrafter, cold: &MistralDrafter, rounds: usize) -> (f64, usize) {
    let target = scorer(TINY);
    let mut session = target.new_session();
    let sampling = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let params = DraftParams { sampling, seed: 3 };
    let mut seq = warm.encode_chat(&[("user".into(), PROMPTS[0].into())]).await.unwrap();
    warm.begin_generation(true).await;
    let (mut max_kl, mut after_full, mut prev_full) = (0.0f64, 0, false);
    for _ in 0..rounds {
        let d = 4;
        let a = warm.draft(&seq, d, &params).await.unwrap();
        cold.begin_generation(true).await;
        let b = cold.draft(&seq, d, &params).await.unwrap();
        cold.end_generation();
        // Compare q position by position while both drafted the same tokens.
        for (x, y) in a.iter().zip(&b) {
            let k = kl(&y.q, &x.q);
            if prev_full {
                max_kl = max_kl.max(k);
            }
            if x.token != y.token {
                break;
            }
        }
        after_full += usize::from(prev_full);
        let tokens: Vec<u32> = a.iter().map(|x| x.token).collect();
        let mut block = seq.clone();
        block.extend(&tokens);
        let logits = session.score(&block, a.len() + 1).unwrap();
        let p: Vec<_> = logits.iter().map(|l| distribution(l, &sampling).unwrap()).collect();
        let outcome = verify_block(&p, &a, 3, seq.len() as u64).unwrap();
        prev_full = outcome.accepted == a.len() && a.len() == d;
        seq.extend(outcome.committed(&tokens));
    }
    (max_kl, after_full)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_accepted_rounds_draft_like_a_cold_engine() {
    let warm = drafter(TINY, DrafterOptions::default()).await;
    let cold = drafter(TINY, DrafterOptions::default()).await;
    let (max_kl, after_full) = warm_vs_cold(&warm, &cold, 16).await;
    println!("with the workaround: max KL {max_kl:.2e} nats over {after_full} rounds after all-accepted rounds");
    assert!(after_full >= 4, "the test needs rounds that follow all-accepted rounds, got {after_full}");
    assert!(max_kl < 0.05, "warm drafts diverge from cold ones: KL {max_kl}");

    // Control: without the filler token the 0.8.1 bug shows, so this test can fail.
    let buggy = drafter(TINY, DrafterOptions { fill_kv: false, ..DrafterOptions::default() }).await;
    let (bug_kl, bug_after_full) = warm_vs_cold(&buggy, &cold, 16).await;
    println!("without the workaround: max KL {bug_kl:.2e} nats over {bug_after_full} rounds");
    assert!(bug_kl > 0.3, "the control did not reproduce the prefix-cache bug (KL {bug_kl})");
}

/// The first sampled token of speculative generation (draft q deliberately different from p:
/// top-k 3) follows the target's p exactly: chi-square against p at significance 1e-3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_sampled_token_follows_the_target_distribution() {
    let target = scorer(TINY);
    let own = drafter(TINY, DrafterOptions::default()).await;
    let prompt = own.encode_chat(&[("user".into(), "Name a colour.".into())]).await.unwrap();
    let sampling = SamplingParams { temperature: 0.8, ..SamplingParams::default() };
    let p = distribution(&target.new_session().score(&prompt, 1).unwrap()[0], &sampling).unwrap();
    const RUNS: u64 = 500;
    let mut session = target.new_session();
    let mut counts: HashMap<u32, u64> = HashMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..RUNS {
        let params = GenerateParams {
            max_new_tokens: 2,
            draft_len: 1,
            sampling,
            draft_sampling: SamplingParams { temperature: 0.8, top_k: 3, ..SamplingParams::default() },
            seed,
            stop_token_ids: target.meta().stop_token_ids.clone(),
        };
        let g = generate(Some(&own), session.as_mut(), &prompt, &params).await.unwrap();
        *counts.entry(g.tokens[0]).or_default() += 1;
        drafted += g.stats.drafted;
        accepted += g.stats.accepted;
    }
    // Pool tokens expected fewer than 5 times into one cell.
    let (mut stat, mut cells, mut other_p, mut other_c) = (0.0, 0, 0.0, 0u64);
    for &(t, _) in p.entries() {
        let (pt, c) = (p.prob(t), counts.get(&t).copied().unwrap_or(0));
        if pt * RUNS as f64 >= 5.0 {
            stat += (c as f64 - pt * RUNS as f64).powi(2) / (pt * RUNS as f64);
            cells += 1;
        } else {
            other_p += pt;
            other_c += c;
        }
    }
    if other_p * RUNS as f64 >= 1.0 {
        stat += (other_c as f64 - other_p * RUNS as f64).powi(2) / (other_p * RUNS as f64);
        cells += 1;
    }
    let emitted_outside: u64 = counts.iter().filter(|(t, _)| p.prob(**t) == 0.0).map(|(_, c)| c).sum();
    assert_eq!(emitted_outside, 0);
    let df = (cells - 1) as f64;
    let critical = df * (1.0 - 2.0 / (9.0 * df) + 3.09 * (2.0 / (9.0 * df)).sqrt()).powi(3);
    println!("first token: chi-square {stat:.1} (df {df}, critical {critical:.1}); {accepted}/{drafted} drafts accepted");
    assert!(cells >= 3, "the prompt should give a spread-out first token");
    assert!(accepted > 0 && accepted < drafted, "both branches of the rule must be exercised");
    assert!(stat < critical, "chi-square {stat} >= {critical}");
}
