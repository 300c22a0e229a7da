//! Copied drafts (spade-core's `lookup`: a request's prediction, prompt lookup) keep the loop
//! lossless, on a real draft and target: greedy output identical to target-only with a prediction
//! that is partly wrong, and under sampling the first token follows the target's p when the
//! prediction proposes a token p does not favour (chi-square, fixed seeds). A point-mass q accepts
//! the proposed token with probability p(x) and resamples a rejection from p without x.

mod common;

use common::*;
use spade_core::lookup::Proposer;
use spade_core::openai::Role;
use spade_core::{distribution, SamplingParams};
use spade_engine::drafter::DrafterOptions;
use spade_engine::speculative::{generate, generate_proposing, GenerateParams};
use spade_engine::{Drafter, Scorer};
use spade_test_support::chi_square_critical as critical;

fn params(
    max_new_tokens: usize,
    draft_len: usize,
    sampling: SamplingParams,
    seed: u64,
) -> GenerateParams {
    GenerateParams {
        max_new_tokens,
        draft_len,
        draft_ahead: true,
        sampling,
        draft_sampling: sampling,
        penalties: None,
        grammar: None,
        seed,
        stop_token_ids: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_with_a_partly_wrong_prediction_is_target_only() {
    let target = scorer(TINY);
    let draft = drafter(TINY, DrafterOptions::default()).await;
    let prompt = draft
        .encode_chat(&[(Role::User, "List the days of the week, one per line.".to_string())])
        .await
        .unwrap();
    let greedy = SamplingParams::greedy();
    let reference =
        generate(None, target.new_session().as_mut(), &prompt, &params(48, 0, greedy, 1))
            .await
            .unwrap()
            .tokens;
    // The answer with a stretch left out, a token changed and a token added: the prediction must
    // re-align after each.
    let mut prediction = reference.clone();
    prediction.drain(30..34);
    prediction[20] = prediction[20].wrapping_add(1) % 1000;
    prediction.insert(10, 42);
    let proposer = Proposer::new(prediction, true, 16);
    let draft: &dyn Drafter = &draft;
    let run = generate_proposing(
        Some(draft),
        target.new_session().as_mut(),
        &prompt,
        &params(48, 3, greedy, 1),
        Some(proposer),
    )
    .await
    .unwrap();
    assert_eq!(run.tokens, reference);
    let s = &run.stats;
    println!(
        "prediction: {} of {} accepted; lookup {} of {}; model drafts {} of {}; {} verify calls for {} tokens",
        s.predicted_accepted, s.predicted, s.looked_up_accepted, s.looked_up, s.accepted, s.drafted,
        s.target_calls, s.committed
    );
    assert!(s.predicted_accepted >= 30, "the prediction should carry most of the answer");
    assert!(
        s.target_calls < s.committed / 3,
        "{} calls for {} tokens",
        s.target_calls,
        s.committed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_first_token_under_a_prediction_follows_p() {
    const SAMPLES: u64 = 1500;
    let target = scorer(TINY);
    let draft = drafter(TINY, DrafterOptions::default()).await;
    let prompt = draft.encode_chat(&[(Role::User, "Name a colour.".to_string())]).await.unwrap();
    let sampling = SamplingParams { temperature: 1.0, top_k: 6, ..SamplingParams::default() };
    let mut session = target.new_session();
    let p1 = distribution(&session.score(&prompt, 1).unwrap().remove(0), &sampling).unwrap();
    // Predict the second most likely token: accepted often, rejected often.
    let mut entries = p1.entries().to_vec();
    entries.sort_by(|a, b| b.1.total_cmp(&a.1));
    let predicted = entries[1].0;
    let mut counts = std::collections::BTreeMap::<u32, u64>::new();
    let mut proposed = 0;
    for seed in 0..SAMPLES {
        let proposer = Proposer::new(vec![predicted, predicted], false, 8);
        // No draft model; a fixed length of 1 (0 would send no copies either) sends the prediction.
        let run = generate_proposing(
            None,
            session.as_mut(),
            &prompt,
            &params(2, 1, sampling, seed),
            Some(proposer),
        )
        .await
        .unwrap();
        proposed += run.stats.predicted;
        *counts.entry(run.tokens[0]).or_default() += 1;
    }
    assert_eq!(proposed as u64, SAMPLES, "every run sends the prediction's first token");
    let mut stat = 0.0;
    for (&token, &count) in &counts {
        assert!(p1.prob(token) > 0.0, "token {token} has p = 0 but came {count} times");
    }
    for &(token, p) in p1.entries() {
        let expected = p as f64 * SAMPLES as f64;
        let observed = counts.get(&token).copied().unwrap_or(0) as f64;
        stat += (observed - expected).powi(2) / expected;
    }
    let df = p1.entries().len() - 1;
    println!(
        "predicted token {predicted} (p {:.3}): came {} of {SAMPLES}; chi-square {stat:.1} (df {df}, bound {:.1})",
        p1.prob(predicted),
        counts.get(&predicted).copied().unwrap_or(0),
        critical(df)
    );
    assert!(stat < critical(df), "chi-square {stat:.1} over the bound {:.1}", critical(df));
}
