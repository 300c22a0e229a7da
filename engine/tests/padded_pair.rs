//! A draft paired with a target whose vocabulary has padding rows the draft lacks (as Qwen2.5-Coder
//! 0.5B with its 7B and 32B): accepted as llama.cpp accepts it, with the padding masked in every mode,
//! so the output is still exactly the target's. The padded target is SmolLM2 with `[PAD]` rows, each a
//! copy of the row of a likely token: a target that did not mask them would sample them.

mod common;

use common::*;
use spade_core::SamplingParams;
use spade_engine::drafter::DrafterOptions;
use spade_engine::speculative::{generate, GenerateParams};
use spade_engine::{
    check_same_vocabulary, read_meta, CandleScorer, Drafter, EngineError, Role, Scorer,
};
use spade_test_support::models::padded_copy;

const ROWS: usize = 64;

#[test]
fn pairs_padding_rows_apart_are_accepted_and_wider_gaps_refused() {
    let tiny = read_meta(&model_path(TINY)).unwrap();
    let padded = read_meta(&padded_copy(&model_path(TINY), ROWS, 0)).unwrap();
    assert_eq!(
        (padded.vocab_size, padded.text_tokens),
        (tiny.vocab_size + ROWS as u32, tiny.vocab_size)
    );
    assert_eq!(
        padded.tokenizer_fingerprint, tiny.tokenizer_fingerprint,
        "padding is not part of the fingerprint"
    );
    check_same_vocabulary(&tiny, &padded).expect("draft without the padding");
    check_same_vocabulary(&padded, &tiny).expect("draft with the padding");
    let wide = read_meta(&padded_copy(&model_path(TINY), 129, 0)).unwrap();
    let err = check_same_vocabulary(&tiny, &wide).unwrap_err();
    assert!(
        matches!(err, EngineError::VocabMismatch(_)) && err.to_string().contains("128"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padding_ids_are_never_sampled_and_greedy_output_is_the_unpadded_targets() {
    let draft = drafter(TINY, DrafterOptions::default()).await;
    let tiny = scorer(TINY);
    let text = tiny.meta().vocab_size;
    let prompt = draft.encode_chat(&[(Role::User, "Name a colour.".to_string())]).await.unwrap();
    let fill = argmax(&tiny.new_session().score(&prompt, 1).unwrap()[0]);
    let padded = CandleScorer::load(&padded_copy(&model_path(TINY), ROWS, fill)).unwrap();
    let raw = padded.new_session().score(&prompt, 1).unwrap().remove(0);
    assert_eq!(
        raw[text as usize + 5],
        raw[fill],
        "the padding rows score as the likeliest token does"
    );

    let params = |draft_len, sampling, seed| GenerateParams {
        max_new_tokens: 24,
        draft_len,
        draft_ahead: draft_len > 0,
        sampling,
        draft_sampling: sampling,
        penalties: None,
        grammar: None,
        seed,
        stop_token_ids: tiny.meta().stop_token_ids.clone(),
    };
    let run = |scorer: &CandleScorer, with_draft: bool, p: GenerateParams| {
        let session = scorer.new_session();
        let draft: Option<&dyn Drafter> = if with_draft { Some(&draft) } else { None };
        let prompt = &prompt;
        async move {
            let mut session = session;
            generate(draft, session.as_mut(), prompt, &p).await.unwrap().tokens
        }
    };
    let greedy = SamplingParams::greedy();
    let unpadded = run(&tiny, false, params(0, greedy, 0)).await;
    assert_eq!(run(&padded, false, params(0, greedy, 0)).await, unpadded, "target-only, padded");
    assert_eq!(
        run(&padded, true, params(4, greedy, 0)).await,
        unpadded,
        "speculative, padded target"
    );

    let sampled = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    for seed in 0..6 {
        for (d, with_draft) in [(0, false), (4, true)] {
            let tokens = run(&padded, with_draft, params(d, sampled, seed)).await;
            assert!(
                tokens.iter().all(|&t| t < text),
                "a padding id was committed (seed {seed}, draft length {d}): {tokens:?}"
            );
        }
    }
}
