//! The loop the gateway runs is lossless under sampling, on a real draft and target: the first drafted
//! position's committed token is distributed exactly as the target's p (chi-square, fixed seeds),
//! without and with penalties and logit bias.
//!
//! Token 1 comes from the empty first block (the verifier alone); token 2 is the first position of a
//! drafted block: an accepted draft or a correction. Conditioned on token 1 being its most likely value,
//! token 2 must follow p(. | prompt, token 1). The draft samples hotter than the target, so q differs
//! from p and both acceptances and corrections occur. Under penalties, p at token 2 is the target's
//! logits penalised with token 1 in the completion, which is what target-only decoding would sample;
//! under a grammar, p masked with the grammar's state after token 1.

mod common;

use common::*;
use spade_core::grammar::GrammarConstraint;
use spade_core::openai::Role;
use spade_core::{distribution, AcceptRule, Penalties, SamplingParams, SparseDist};
use spade_engine::drafter::DrafterOptions;
use spade_engine::round::TargetRule;
use spade_engine::speculative::{
    self, Collect, DraftLenSetting, LocalVerifier, LoopParams, WhenUnreachable,
};
use spade_engine::{DraftParams, SharedGrammar};
use spade_engine::{Drafter, Scorer};
use spade_test_support::chi_square_critical as critical;

const SAMPLES: u64 = 700;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_tokens_follow_the_targets_distribution() {
    second_token_follows_p(None, None, AcceptRule::Ratio).await;
}

/// The match rule, its draft proposing its most likely token as the gateway's does under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_tokens_follow_the_targets_distribution_under_the_match_rule() {
    second_token_follows_p(None, None, AcceptRule::Match).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_tokens_follow_the_penalised_targets_distribution() {
    let penalties = Penalties {
        presence_penalty: 0.7,
        frequency_penalty: 0.5,
        repetition_penalty: 1.3,
        ..Penalties::default()
    };
    second_token_follows_p(Some(penalties), None, AcceptRule::Ratio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_tokens_follow_the_grammar_masked_targets_distribution() {
    // Lower-case words only: the model's capitalised answers are masked away, many tokens remain.
    let grammar = GrammarConstraint::lark("start: WORD (\" \" WORD)*\nWORD: /[a-z]+/\n".into(), 0);
    second_token_follows_p(None, Some(grammar.grammar), AcceptRule::Ratio).await;
}

/// `penalties` (without `prompt_len` or bias: both are set here) apply to the target and the draft;
/// `grammar` (a grammar document) masks both from the first output token on; `accept`: the rule.
async fn second_token_follows_p(
    penalties: Option<Penalties>,
    grammar: Option<serde_json::Value>,
    accept: AcceptRule,
) {
    let target = scorer(TINY);
    let grammar = grammar.map(|g| target.vocabulary().unwrap().compile(&g).unwrap());
    let draft = drafter(TINY, DrafterOptions::default()).await;
    let prompt = draft.encode_chat(&[(Role::User, "Name a colour.".to_string())]).await.unwrap();
    let sampling = SamplingParams { temperature: 1.0, top_k: 6, ..SamplingParams::default() };
    let draft_sampling = match accept {
        AcceptRule::Ratio => {
            SamplingParams { temperature: 1.8, top_k: 12, ..SamplingParams::default() }
        }
        AcceptRule::Match => SamplingParams::greedy(),
    };

    let mut session = target.new_session();
    let first_logits = session.score(&prompt, 1).unwrap().remove(0);
    // Bias the raw favourite at token 2 down and a runner-up at token 1 up: both change the answer.
    let penalties = penalties.map(|p| {
        let second_raw = argmax(
            &session
                .score(&[prompt.clone(), vec![argmax(&first_logits) as u32]].concat(), 1)
                .unwrap()[0],
        ) as u32;
        let runner_up = distribution(&first_logits, &SamplingParams { top_k: 2, ..sampling })
            .unwrap()
            .entries()
            .iter()
            .map(|e| e.0)
            .max()
            .unwrap();
        Penalties {
            prompt_len: prompt.len() as u32,
            logit_bias: [(second_raw, -1.5), (runner_up, 1.0)].into(),
            ..p
        }
    });
    let p_at = |context: &[u32], logits: &[f32]| -> SparseDist {
        let mut logits = logits.to_vec();
        if let Some(p) = &penalties {
            p.history(context).apply(&mut logits);
        }
        if let Some(g) = &grammar {
            let mut state = g.start_at(prompt.len());
            state.sync(context).unwrap();
            state.mask(&mut logits).unwrap();
        }
        distribution(&logits, &sampling).unwrap()
    };
    let t1 = p_at(&prompt, &first_logits).argmax();
    let mut context = prompt.clone();
    context.push(t1);
    let second_logits = session.score(&context, 1).unwrap().remove(0);
    let p2 = p_at(&context, &second_logits);
    if penalties.is_some() || grammar.is_some() {
        // The test must be able to tell penalties or a grammar applied from ignored.
        let raw = distribution(&second_logits, &sampling).unwrap();
        let distance: f64 =
            (0..target.meta().vocab_size).map(|t| (p2.prob(t) - raw.prob(t)).abs()).sum::<f64>()
                / 2.0;
        assert!(
            distance > 0.1,
            "penalties or grammar barely change p at token 2 (total variation {distance:.3})"
        );
    }

    let (mut counts, mut kept, mut drafted, mut accepted) =
        (std::collections::BTreeMap::<u32, u64>::new(), 0u64, 0, 0);
    for seed in 0..SAMPLES {
        let params = LoopParams {
            max_new_tokens: 4,
            draft_len: DraftLenSetting::Fixed(3),
            draft_ahead: true,
            draft: DraftParams {
                sampling: draft_sampling,
                penalties: penalties.clone(),
                grammar: grammar.as_ref().map(|g| SharedGrammar::new(g.start_at(prompt.len()))),
                seed,
            },
            stop_token_ids: Vec::new(),
            when_unreachable: WhenUnreachable::Fail,
            start_degraded: false,
            proposer: None,
        };
        // One scorer session and the draft's prefix cache are reused across samples: both only ever
        // serve the prompt's KV rows, and each sample's randomness is keyed by its own seed.
        let rule = TargetRule { sampling, penalties: penalties.clone(), accept };
        let grammar = grammar.as_ref().map(|g| g.start_at(prompt.len()));
        let mut verifier =
            LocalVerifier { session: session.as_mut(), rule, grammar, seed, top_logprobs: None };
        let mut tokens = Collect::default();
        draft.begin_generation(false).await;
        let end = speculative::run(
            Some(&draft as &dyn Drafter),
            &mut verifier,
            &prompt,
            &params,
            &mut tokens,
        )
        .await
        .unwrap();
        draft.end_generation();
        drafted += end.stats.drafted;
        accepted += end.stats.accepted;
        if tokens.0[0] == t1 {
            kept += 1;
            *counts.entry(tokens.0[1]).or_default() += 1;
        }
    }
    let mut stat = 0.0;
    for (&token, &count) in &counts {
        assert!(
            p2.prob(token) > 0.0,
            "token {token} has target probability 0 but was committed {count} times"
        );
    }
    for &(token, p) in p2.entries() {
        let expected = p as f64 * kept as f64;
        let observed = counts.get(&token).copied().unwrap_or(0) as f64;
        stat += (observed - expected).powi(2) / expected;
    }
    let df = p2.entries().len() - 1;
    println!(
        "{accept} rule, penalties {penalties:?}, grammar {}: {kept} of {SAMPLES} samples kept; {accepted} of {drafted} drafts accepted; chi-square {stat:.1} (df {df}, bound {:.1})",
        grammar.is_some(),
        critical(df)
    );
    assert!(kept >= 150, "too few samples with the likely first token: {kept}");
    assert!(
        accepted > 0 && accepted < drafted,
        "both acceptances and rejections should occur: {accepted} of {drafted}"
    );
    assert!(stat < critical(df), "token 2 is not distributed as the target's p: chi-square {stat:.1}; counts {counts:?}; p {:?}", p2.entries());
}
