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
            assert!(row[0] == all[i], "{name}: position {} differs between block and single scoring", 32 + i);
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
        let toks = drafter.encode_chat(&[(Role::User, "Write a haiku about the sea, then explain what a haiku is.".into())]).await.unwrap();
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
                assert_eq!(argmax(a), argmax(b), "{name}: argmax differs at position {i} (margin {})", top2_margin(b));
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
    let (tiny, draft, target) = (read_meta(&model_path(TINY)).unwrap(), read_meta(&model_path(DRAFT)).unwrap(), read_meta(&model_path(TARGET)).unwrap());
    check_same_vocabulary(&draft, &target).expect("the Qwen pair shares one tokenizer");
    let err = check_same_vocabulary(&tiny, &target).unwrap_err();
    assert!(matches!(err, EngineError::VocabMismatch(_)), "{err}");
    assert!(err.to_string().contains("fingerprint"), "the message should say why: {err}");
}
