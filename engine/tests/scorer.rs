//! The candle scorer on real models: block scoring equals one-at-a-time scoring bit for bit, the cache
//! survives truncation, and the logits agree with mistral.rs's own forward pass.

mod common;

use common::*;
use spade_engine::drafter::DrafterOptions;
use spade_engine::{Role, Scorer};

fn tokens_for_test(vocab: u32) -> Vec<u32> {
    (0..40u32).map(|i| (i * 7919 + 13) % vocab.min(30_000)).collect()
}

#[test]
fn block_scoring_is_bitwise_equal_to_one_at_a_time() {
    for name in [TINY, DRAFT] {
        let scorer = scorer(name);
        let toks = tokens_for_test(scorer.meta().vocab_size);
        let mut block = scorer.new_session();
        let all = block.score(&toks, 8).unwrap();
        let mut single = scorer.new_session();
        single.score(&toks[..32], 1).unwrap();
        for i in 0..8 {
            let row = single.score(&toks[..33 + i], 1).unwrap();
            assert!(
                row[0] == all[i],
                "{name}: position {} differs between block and single scoring",
                32 + i
            );
        }
        // Rejection: truncate by scoring a diverging sequence; the result equals a cold session's.
        let mut diverged = toks[..36].to_vec();
        diverged.extend([5, 6, 7]);
        let warm = block.score(&diverged, 3).unwrap();
        let cold = scorer.new_session().score(&diverged, 3).unwrap();
        assert!(warm == cold, "{name}: reusing a truncated cache changed the logits");
        assert_eq!(block.cached_tokens(), &diverged[..]);
    }
}

/// Several sessions scored in one batched pass (prefills chunked across passes, decode blocks,
/// a rejected draft's rows recomputed) get bit-identical logits to each session scored alone.
#[test]
fn batched_passes_are_bitwise_equal_to_each_session_alone() {
    for name in [TINY, DRAFT] {
        let scorer = scorer(name);
        let vocab = scorer.meta().vocab_size.min(30_000);
        let seq = |salt: u32, len: u32| {
            (0..len).map(|i| (i * 7919 + salt * 104_729 + 13) % vocab).collect::<Vec<u32>>()
        };
        // (sequence, logit rows, rows this pass) per session, three passes.
        let long = seq(1, 45);
        let (a, b, c) = (seq(2, 9), seq(3, 6), seq(4, 12));
        let mut sessions: Vec<_> = (0..4).map(|_| scorer.new_session()).collect();
        let mut alone: Vec<_> = (0..4).map(|_| scorer.new_session()).collect();
        let passes: Vec<Vec<(Vec<u32>, usize, usize)>> = vec![
            vec![(long.clone(), 5, 17), (a.clone(), 4, 9), (b.clone(), 1, 6), (c.clone(), 3, 4)],
            vec![
                (long.clone(), 5, 20),
                (a.iter().copied().chain([7, 8]).collect(), 3, 3),
                (b[..4].iter().copied().chain([9]).collect(), 2, 2),
                (c.clone(), 3, 8),
            ],
            vec![(long.clone(), 5, 8), (a[..7].iter().copied().chain([1, 2, 3]).collect(), 4, 4)],
        ];
        for (pass, jobs) in passes.iter().enumerate() {
            let mut batch: Vec<spade_engine::BatchJob<'_>> = Vec::new();
            for ((tokens, n, rows), session) in jobs.iter().zip(sessions.iter_mut()) {
                batch.push(spade_engine::BatchJob {
                    session: session.as_mut(),
                    tokens,
                    logit_rows: *n,
                    rows: *rows,
                });
            }
            let results = scorer.score_batch(&mut batch);
            drop(batch);
            for (i, ((tokens, n, _), result)) in jobs.iter().zip(results).enumerate() {
                let result = result.unwrap_or_else(|e| panic!("{name} pass {pass} job {i}: {e}"));
                assert_eq!(
                    sessions[i].cached_tokens(),
                    &tokens[..sessions[i].cached_tokens().len()]
                );
                if let Some(logits) = result {
                    let want = alone[i].score(tokens, *n).unwrap();
                    assert!(
                        logits == want,
                        "{name} pass {pass}: session {i}'s logits differ from scoring it alone"
                    );
                }
            }
        }
        assert_eq!(sessions[0].cached_tokens().len(), 45, "{name}: the chunked prefill finished");
        // A pass that would split the rows needing logits is refused, the rest of the batch still runs.
        let mut s = scorer.new_session();
        let mut t = scorer.new_session();
        let results = scorer.score_batch(&mut [
            spade_engine::BatchJob { session: s.as_mut(), tokens: &a, logit_rows: 4, rows: 7 },
            spade_engine::BatchJob { session: t.as_mut(), tokens: &b, logit_rows: 1, rows: 6 },
        ]);
        assert!(results[0].is_err() && matches!(results[1], Ok(Some(_))), "{name}");
    }
}

#[test]
fn rejects_bad_requests_without_panicking() {
    let scorer = scorer(TINY);
    let mut s = scorer.new_session();
    let vocab = scorer.meta().vocab_size;
    assert!(s.score(&[1, vocab], 1).is_err());
    assert!(s.score(&[1, 2], 0).is_err());
    assert!(s.score(&[1, 2], 3).is_err());
    assert!(s.score(&[], 1).is_err());
}

/// mistral.rs (F32 activations) and our scorer on the same tokens. Bounds measured here: see the
/// assertions; a wrong rope layout or a missing bias gives mean KL > 1 nat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agrees_with_mistralrs_raw_logits() {
    for name in [TINY, DRAFT] {
        let scorer = scorer(name);
        let drafter = drafter(name, DrafterOptions::default()).await;
        let toks = drafter
            .encode_chat(&[(
                Role::User,
                "Write a haiku about the sea, then explain what a haiku is.".into(),
            )])
            .await
            .unwrap();
        let ours = scorer.new_session().score(&toks, toks.len()).unwrap();
        let theirs = drafter.raw_logits(&toks).await.unwrap();
        let theirs = &theirs[theirs.len() - ours.len()..];
        let mut kl_sum = 0.0;
        let mut max_kl: f64 = 0.0;
        let mut checked = 0;
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            let kl = kl_from_logits(b, a);
            kl_sum += kl;
            max_kl = max_kl.max(kl);
            if top2_margin(b) > 0.5 {
                checked += 1;
                assert_eq!(
                    argmax(a),
                    argmax(b),
                    "{name}: argmax differs at position {i} (margin {})",
                    top2_margin(b)
                );
            }
        }
        let mean_kl = kl_sum / ours.len() as f64;
        println!("{name}: {} positions, mean KL {mean_kl:.2e} nats, max {max_kl:.2e}, argmax checked at {checked}", ours.len());
        assert!(mean_kl < 1e-2, "{name}: mean KL {mean_kl}");
        assert!(max_kl < 0.1, "{name}: max KL {max_kl}");
        assert!(checked > ours.len() / 2);
    }
}

#[test]
fn a_pair_with_different_vocabularies_is_refused() {
    use spade_engine::{check_same_vocabulary, read_meta, EngineError};
    let (tiny, draft, target) = (
        read_meta(&model_path(TINY)).unwrap(),
        read_meta(&model_path(DRAFT)).unwrap(),
        read_meta(&model_path(TARGET)).unwrap(),
    );
    check_same_vocabulary(&draft, &target).expect("the Qwen pair shares one tokenizer");
    let err = check_same_vocabulary(&tiny, &target).unwrap_err();
    assert!(matches!(err, EngineError::VocabMismatch(_)), "{err}");
    assert!(err.to_string().contains("fingerprint"), "the message should say why: {err}");
}

/// The prefix cache's premise: a session started from another session's first k rows (a copy, as a
/// cache hit makes) and brought to the full context scores every row after k bit for bit as a cold
/// prefill does, whatever k and wherever the prefill chunks fall (the cold pass cuts at 256 rows).
#[test]
fn a_session_from_a_cached_prefix_scores_like_a_cold_prefill() {
    for (name, prefixes) in [(TINY, &[16usize, 144, 270][..]), (DRAFT, &[100, 270][..])] {
        let scorer = scorer(name);
        let vocab = scorer.meta().vocab_size.min(30_000);
        let context: Vec<u32> = (0..290u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let first = prefixes[0];
        let cold = scorer.new_session().score(&context, context.len() - first).unwrap();
        for &k in prefixes {
            // The donor holds the prefix and then another continuation: only its first k rows are shared.
            let mut donor_tokens = context[..k].to_vec();
            donor_tokens.extend((0..30u32).map(|i| (i * 104_729 + 7) % vocab));
            let mut donor = scorer.new_session();
            donor.score(&donor_tokens, 1).unwrap();
            let mut warm = donor.fork(k).expect("the candle scorer copies its cache");
            assert_eq!(warm.cached_tokens(), &context[..k]);
            assert_eq!(
                warm.rows_to_score(&context, context.len() - k),
                context.len() - k,
                "{name}: only the rest is computed"
            );
            let rows = warm.score(&context, context.len() - k).unwrap();
            for (i, row) in rows.iter().enumerate() {
                assert!(
                    *row == cold[k - first + i],
                    "{name}: row {} differs between a cold prefill and one from a {k}-token prefix",
                    k + i
                );
            }
            // The donor's own rows are untouched by the copy's growth.
            assert!(
                donor.score(&donor_tokens, 1).unwrap()
                    == scorer.new_session().score(&donor_tokens, 1).unwrap(),
                "{name}: the donor changed"
            );
        }
    }
}
