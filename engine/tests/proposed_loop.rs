//! Copied drafts (spade-core's `lookup`: a request's prediction, prompt lookup) keep the loop
//! lossless, on a real draft and target: greedy output identical to target-only with a prediction
//! that is partly wrong, and under sampling the tokens of a block that holds a copied token and the
//! draft model's draft after it follow the target's p (chi-square, fixed seeds). A point-mass q
//! accepts the proposed token with probability p(x) and resamples a rejection from p without x.

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

/// A block of a copied token and a draft after it, at T = 1: the first token follows the target's
/// p when the prediction proposes a token p does not favour, and where that token came, the second
/// (the draft model's draft after the copy) follows p after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_tokens_under_a_prediction_and_the_draft_after_it_follow_p() {
    const SAMPLES: u64 = 1500;
    let target = scorer(TINY);
    let model = drafter(TINY, DrafterOptions::default()).await;
    let prompt = model.encode_chat(&[(Role::User, "Name a colour.".to_string())]).await.unwrap();
    let draft: &dyn Drafter = &model;
    let sampling = SamplingParams { temperature: 1.0, top_k: 6, ..SamplingParams::default() };
    let mut session = target.new_session();
    let p1 = distribution(&session.score(&prompt, 1).unwrap().remove(0), &sampling).unwrap();
    // Predict the second most likely token: accepted often, rejected often.
    let mut entries = p1.entries().to_vec();
    entries.sort_by(|a, b| b.1.total_cmp(&a.1));
    let predicted = entries[1].0;
    let after = [&prompt[..], &[predicted]].concat();
    let p2 = distribution(&session.score(&after, 1).unwrap().remove(0), &sampling).unwrap();
    let (mut first, mut second) = (Counts::new(), Counts::new());
    let (mut copied, mut drafted) = (0, 0);
    for seed in 0..SAMPLES {
        // One predicted token, then the source has no more: at a fixed length of 2 the draft model
        // drafts the second position in the same block.
        let proposer = Proposer::new(vec![predicted], false, 8);
        let run = generate_proposing(
            Some(draft),
            session.as_mut(),
            &prompt,
            &params(3, 2, sampling, seed),
            Some(proposer),
        )
        .await
        .unwrap();
        (copied, drafted) = (copied + run.stats.predicted, drafted + run.stats.drafted);
        *first.entry(run.tokens[0]).or_default() += 1;
        if run.tokens[0] == predicted {
            *second.entry(run.tokens[1]).or_default() += 1;
        }
    }
    assert_eq!(copied as u64, SAMPLES, "every run sends the prediction's token");
    assert!(drafted as u64 >= SAMPLES, "every run drafts after it ({drafted} drafts)");
    for (name, counts, p) in [("first", &first, &p1), ("second", &second, &p2)] {
        let (stat, df) = chi_square(counts, p);
        println!(
            "{name} token: {} samples, chi-square {stat:.1} (df {df}, bound {:.1})",
            counts.values().sum::<u64>(),
            critical(df)
        );
        assert!(
            stat < critical(df),
            "{name}: chi-square {stat:.1} over the bound {:.1}",
            critical(df)
        );
    }
    println!(
        "predicted token {predicted} (p {:.3}): came {}",
        p1.prob(predicted),
        first[&predicted]
    );
}

type Counts = std::collections::BTreeMap<u32, u64>;

/// Pearson's statistic of `counts` against `p` and its degrees of freedom, the least expected
/// tokens merged until each bin is expected at least 5 times (the test's approximation needs that).
fn chi_square(counts: &Counts, p: &spade_core::SparseDist) -> (f64, usize) {
    let n = counts.values().sum::<u64>() as f64;
    for (&token, &count) in counts {
        assert!(p.prob(token) > 0.0, "token {token} has p = 0 but came {count} times");
    }
    let observed = |token| counts.get(&token).copied().unwrap_or(0) as f64;
    let mut bins: Vec<(f64, f64)> =
        p.entries().iter().map(|&(token, prob)| (prob as f64 * n, observed(token))).collect();
    bins.sort_by(|a, b| a.0.total_cmp(&b.0));
    while bins.len() > 2 && bins[0].0 < 5.0 {
        let (expected, observed) = bins.remove(0);
        bins[0] = (bins[0].0 + expected, bins[0].1 + observed);
        bins.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let stat = bins.iter().map(|(e, o)| (o - e).powi(2) / e).sum();
    (stat, bins.len() - 1)
}
