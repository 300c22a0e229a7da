//! What users run is lossless under sampling: the real gateway and verifier binaries over HTTP, the
//! first drafted position's committed token distributed exactly as the target's p (chi-square, fixed
//! seeds), and under `--rule match` a seeded answer independent of the draft length. The in-process
//! twin is engine/tests/sampled_loop.rs.
//!
//! Token 1 comes from the empty first block (the verifier alone); token 2 is the first position of a
//! drafted block (4 tokens are asked for, so the budget leaves room for drafts): an accepted draft or a correction. Conditioned on token 1 being its most likely value,
//! token 2 must follow p(. | prompt, token 1). The gateway drafts from at most 2 tokens
//! (`--draft-top-k 2`) while the target samples from 6, so q differs from p and both acceptances and
//! corrections occur. Tokens are identified by their text in the returned logprobs.

mod real;

use std::collections::BTreeMap;

use real::*;
use serde_json::json;
use spade_core::{distribution, SamplingParams};
use spade_engine::{CandleScorer, EdgeModel, MistralDrafter, ModelSource, Role, Scorer};
use spade_test_support::chi_square_critical;

const SAMPLES: u64 = 600;
const PROMPT: &str = "Name a colour.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_tokens_over_http_follow_the_targets_distribution() {
    let edge = MistralDrafter::load(&ModelSource::Local(tiny()), Default::default()).await.unwrap();
    let target = CandleScorer::load(&tiny()).unwrap();
    let prompt = edge.encode_chat(&[(Role::User, PROMPT.to_string())]).await.unwrap();
    let sampling = SamplingParams { temperature: 1.0, top_k: 6, ..SamplingParams::default() };
    let mut session = target.new_session();
    let t1 = distribution(&session.score(&prompt, 1).unwrap()[0], &sampling).unwrap().argmax();
    let context: Vec<u32> = prompt.iter().copied().chain([t1]).collect();
    let p2 = distribution(&session.score(&context, 1).unwrap()[0], &sampling).unwrap();
    let piece = |t: u32| EdgeModel::decode(&edge, &[t]).unwrap();
    let first_piece = piece(t1);
    let by_piece: BTreeMap<String, u32> =
        p2.entries().iter().map(|&(t, _)| (piece(t), t)).collect();
    assert_eq!(
        by_piece.len(),
        p2.entries().len(),
        "p's tokens must have distinct texts to be told apart: {by_piece:?}"
    );

    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "3", "--draft-top-k", "2"]).await;
    let (mut counts, mut kept, mut drafted, mut accepted) =
        (BTreeMap::<u32, u64>::new(), 0u64, 0, 0);
    for seed in 0..SAMPLES {
        let body = request(
            PROMPT,
            4,
            json!({"temperature": 1.0, "top_k": 6, "seed": seed, "logprobs": true}),
        );
        let v = complete(&gateway.url, &body).await;
        let spade = &v["usage"]["spade"];
        accepted += spade["draft_accepted"].as_u64().unwrap();
        drafted += spade["drafted"].as_u64().unwrap();
        let tokens: Vec<&str> = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["token"].as_str().unwrap())
            .collect();
        assert!(tokens.len() >= 2, "seed {seed}: {v}");
        if tokens[0] == first_piece {
            kept += 1;
            let token = by_piece.get(tokens[1]).unwrap_or_else(|| {
                panic!("seed {seed}: {:?} is outside the target's support {by_piece:?}", tokens[1])
            });
            *counts.entry(*token).or_default() += 1;
        }
    }
    let stat: f64 = p2
        .entries()
        .iter()
        .map(|&(token, p)| {
            let expected = p as f64 * kept as f64;
            (counts.get(&token).copied().unwrap_or(0) as f64 - expected).powi(2) / expected
        })
        .sum();
    let df = p2.entries().len() - 1;
    println!("{kept} of {SAMPLES} samples kept; {accepted} of {drafted} drafts accepted; chi-square {stat:.1} (df {df}, bound {:.1})", chi_square_critical(df));
    assert!(kept >= 150, "too few samples with the likely first token: {kept}");
    assert!(
        accepted > 0 && accepted < drafted,
        "both acceptances and rejections should occur: {accepted} of {drafted}"
    );
    assert!(stat < chi_square_critical(df), "token 2 is not distributed as the target's p: chi-square {stat:.1}; counts {counts:?}; p {:?}", p2.entries());
}

/// Under `--rule match` a seeded sampled answer does not depend on what was drafted: every
/// committed token is the target's own draw keyed by (seed, position). The real binaries give the
/// same answer at draft length 0 (target-only sampling through the verifier), 2, 4 and `auto`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_answer_under_the_match_rule_is_the_same_at_every_draft_length() {
    let verifier = start_verifier_on(0, &["--rule", "match"]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let (mut drafted, mut accepted, mut rejected) = (0, 0, 0);
    let mut by_seed = std::collections::BTreeSet::new();
    for seed in 0..4 {
        let mut answers = Vec::new();
        for draft_len in [json!(0), json!(2), json!(4), json!("auto")] {
            let extra =
                json!({"temperature": 0.8, "seed": seed, "spade": {"draft_len": draft_len}});
            let v = complete(&gateway.url, &request("Write a short poem about rivers.", 24, extra))
                .await;
            assert_eq!(v["usage"]["spade"]["rule"], "match", "{v}");
            let spade = &v["usage"]["spade"];
            let (d, a) =
                (spade["drafted"].as_u64().unwrap(), spade["draft_accepted"].as_u64().unwrap());
            (drafted, accepted, rejected) = (drafted + d, accepted + a, rejected + d - a);
            answers.push(content(&v).to_string());
        }
        assert!(answers.iter().all(|a| *a == answers[0]), "seed {seed}: {answers:?}");
        by_seed.insert(answers.swap_remove(0));
    }
    assert!(by_seed.len() > 1, "the seeds should sample different answers: {by_seed:?}");
    println!("{accepted} of {drafted} drafts accepted");
    assert!(
        accepted > 0 && rejected > 0,
        "drafts must be both kept and rejected: {accepted} of {drafted}"
    );
}
