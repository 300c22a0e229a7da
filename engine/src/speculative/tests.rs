//! The loop's own control flow, with a scripted drafter and verifier (model behaviour is covered by
//! the real-model tests in tests/).
use std::sync::{Arc, Mutex};

use spade_core::{SamplingParams, SparseDist};

use super::*;
use crate::{DraftParams, ModelMeta};

/// Proposes ascending ids from the context length on: drafts at position i are always `i`.
struct Counting(ModelMeta);

#[async_trait::async_trait]
impl Drafter for Counting {
    fn meta(&self) -> &ModelMeta {
        &self.0
    }
    async fn draft(
        &self,
        committed: &[u32],
        n: usize,
        _: &DraftParams,
    ) -> Result<Vec<DraftToken>, EngineError> {
        let start = committed.len() as u32;
        Ok((start..start + n as u32)
            .map(|t| DraftToken { token: t, q: SparseDist::new(vec![(t, 1.0)], None).unwrap() })
            .collect())
    }
}

/// Accepts `accept` drafts per block and commits position + `offset` as the next token (an offset
/// of 0 agrees with [`Counting`]); fails every call after the first `ok_calls`.
struct Scripted {
    accept: usize,
    offset: u32,
    ok_calls: usize,
    calls: usize,
    blocks: Vec<usize>,
}

fn scripted(accept: usize, ok_calls: usize) -> Scripted {
    Scripted { accept, offset: 1000, ok_calls, calls: 0, blocks: Vec::new() }
}

#[async_trait::async_trait]
impl BlockVerifier for Scripted {
    async fn verify(
        &mut self,
        context: &[u32],
        drafts: &[DraftToken],
    ) -> Result<Verified, VerifyFailure> {
        self.calls += 1;
        if self.calls > self.ok_calls {
            return Err(VerifyFailure::Unreachable("down".into()));
        }
        self.blocks.push(drafts.len());
        let accepted = self.accept.min(drafts.len());
        let mut committed: Vec<u32> = drafts[..accepted].iter().map(|d| d.token).collect();
        committed.push((context.len() + accepted) as u32 + self.offset);
        Ok(Verified { accepted, committed, logprobs: Vec::new(), verifier_time: None })
    }
}

fn meta() -> ModelMeta {
    ModelMeta {
        name: "counting".into(),
        architecture: "test".into(),
        vocab_size: 5000,
        stop_token_ids: vec![4999],
        tokenizer_fingerprint: String::new(),
        text_tokens: 5000,
        max_context: 4096,
        chat_template: None,
        fim: None,
    }
}

fn params(
    max_new_tokens: usize,
    draft_len: usize,
    when_unreachable: WhenUnreachable,
) -> LoopParams {
    let draft = DraftParams { sampling: SamplingParams::greedy(), ..DraftParams::default() };
    LoopParams {
        max_new_tokens,
        draft_len: DraftLenSetting::Fixed(draft_len),
        draft_ahead: false,
        draft,
        stop_token_ids: vec![4999],
        when_unreachable,
        start_degraded: false,
        proposer: None,
    }
}

#[tokio::test]
async fn the_first_block_is_empty_and_no_block_drafts_past_the_budget() {
    let drafter = Counting(meta());
    let mut verifier = scripted(10, usize::MAX);
    let mut out = Collect::default();
    let end = run(
        Some(&drafter),
        &mut verifier,
        &[1, 2, 3],
        &params(10, 4, WhenUnreachable::Fail),
        &mut out,
    )
    .await
    .unwrap();
    assert_eq!(end.finish, Finish::Length);
    assert_eq!(out.0.len(), 10);
    // 1 (empty block) + 5 (4 drafts + bonus) + 4 (3 drafts, the budget's last token as bonus).
    assert_eq!(verifier.blocks, vec![0, 4, 3]);
    assert_eq!(end.stats.committed, 10);
    assert_eq!((end.stats.drafted, end.stats.accepted, end.stats.target_calls), (7, 7, 3));
}

#[tokio::test]
async fn an_unreachable_verifier_fails_or_hands_over_to_the_draft() {
    let drafter = Counting(meta());
    let mut verifier = scripted(0, 2);
    let end = run(
        Some(&drafter),
        &mut verifier,
        &[1],
        &params(40, 2, WhenUnreachable::Fail),
        &mut Collect::default(),
    )
    .await;
    assert!(matches!(end, Err(LoopError::Verifier(VerifyFailure::Unreachable(_)))));

    let mut verifier = scripted(0, 2);
    let mut out = Collect::default();
    let end = run(
        Some(&drafter),
        &mut verifier,
        &[1],
        &params(40, 2, WhenUnreachable::DraftAlone),
        &mut out,
    )
    .await
    .unwrap();
    assert!(end.stats.degraded);
    assert_eq!((end.finish, out.0.len(), end.stats.target_calls), (Finish::Length, 40, 2));
    // After the two verified tokens, the draft's own tokens: position i drafts i.
    assert_eq!(out.0[2..6], [3, 4, 5, 6]);
}

#[tokio::test]
async fn a_stop_token_ends_the_generation() {
    let drafter = Counting(meta());
    let mut verifier = scripted(10, usize::MAX);
    let mut out = Collect::default();
    // Position 4999 drafts the stop token 4999.
    let prompt: Vec<u32> = (0..4990).collect();
    let end = run(
        Some(&drafter),
        &mut verifier,
        &prompt,
        &params(100, 4, WhenUnreachable::Fail),
        &mut out,
    )
    .await
    .unwrap();
    assert_eq!(end.finish, Finish::StopToken);
    assert_eq!(out.0.last(), Some(&4999));
}

/// Drafting ahead changes which blocks are drafted when, never what is committed: a block drafted
/// ahead is sent only when the verifier confirmed the prefix it was drafted on.
#[tokio::test]
async fn draft_ahead_sends_only_confirmed_blocks_and_commits_the_same_tokens() {
    let drafter = Counting(meta());
    // (accepted per block, bonus offset, every block drafted ahead should be used): with one
    // accepted of four, only the block after the empty first one (all of its zero drafts accepted).
    for (accept, offset, used) in [(10, 0, true), (10, 1000, false), (1, 0, false)] {
        let run_with = |ahead: bool| {
            let drafter = &drafter;
            async move {
                let mut verifier = Scripted { offset, ..scripted(accept, usize::MAX) };
                let mut out = Collect::default();
                let params =
                    LoopParams { draft_ahead: ahead, ..params(30, 4, WhenUnreachable::Fail) };
                let end =
                    run(Some(drafter), &mut verifier, &[1, 2, 3], &params, &mut out).await.unwrap();
                (out.0, verifier.blocks, end.stats)
            }
        };
        let (plain, plain_blocks, plain_stats) = run_with(false).await;
        let (ahead, ahead_blocks, stats) = run_with(true).await;
        assert_eq!(ahead, plain, "accept {accept}, offset {offset}");
        assert_eq!(ahead_blocks, plain_blocks, "accept {accept}, offset {offset}");
        assert_eq!((plain_stats.ahead_drafted, plain_stats.ahead_used), (0, 0));
        assert!(stats.ahead_drafted > 0);
        // Every block after the first was drafted ahead when the verifier agrees; none otherwise.
        let expected_used = match (used, offset) {
            (true, _) => stats.target_calls - 1,
            (false, 0) => 1,
            (false, _) => 0,
        };
        assert_eq!(stats.ahead_used, expected_used, "accept {accept}, offset {offset}: {stats:?}");
    }
}

/// [`Counting`] on a drafter that other generations keep busy.
struct Crowded(Counting);

#[async_trait::async_trait]
impl Drafter for Crowded {
    fn meta(&self) -> &ModelMeta {
        self.0.meta()
    }
    async fn draft(
        &self,
        committed: &[u32],
        n: usize,
        params: &DraftParams,
    ) -> Result<Vec<DraftToken>, EngineError> {
        self.0.draft(committed, n, params).await
    }
    fn others_drafting(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn no_drafting_ahead_while_other_generations_draft() {
    let params = LoopParams { draft_ahead: true, ..params(30, 4, WhenUnreachable::Fail) };
    let (mut alone, mut crowded) = (scripted(10, usize::MAX), scripted(10, usize::MAX));
    let (mut alone_out, mut crowded_out) = (Collect::default(), Collect::default());
    let alone_end = run(Some(&Counting(meta())), &mut alone, &[1, 2, 3], &params, &mut alone_out)
        .await
        .unwrap();
    let crowded_end =
        run(Some(&Crowded(Counting(meta()))), &mut crowded, &[1, 2, 3], &params, &mut crowded_out)
            .await
            .unwrap();
    assert!(alone_end.stats.ahead_drafted > 0);
    assert_eq!(crowded_end.stats.ahead_drafted, 0);
    assert_eq!((crowded_out.0, crowded.blocks), (alone_out.0, alone.blocks));
}

/// Keeps every round record the loop logs, written as tracing-subscriber's text formatter writes the
/// field (`round=` and its `Display`).
#[derive(Clone, Default)]
struct Rounds(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Rounds {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Field<'a>(&'a mut Vec<String>);
        impl tracing::field::Visit for Field<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == RoundRecord::LOG_FIELD {
                    self.0.push(format!(
                        "DEBUG {}: {}={value:?}",
                        RoundRecord::LOG_TARGET,
                        field.name()
                    ));
                }
            }
        }
        if event.metadata().target() == RoundRecord::LOG_TARGET {
            event.record(&mut Field(&mut self.0.lock().unwrap()));
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Tools read these records back from a log: one per verify call, with what the loop sent and learnt.
#[tokio::test]
async fn every_verify_call_logs_a_record_that_reads_back() {
    let rounds = Rounds::default();
    let _logging = tracing::subscriber::set_default(rounds.clone());
    let drafter = Counting(meta());
    let mut verifier = scripted(2, usize::MAX);
    let params = LoopParams { draft_ahead: true, ..params(20, 4, WhenUnreachable::Fail) };
    let end = run(Some(&drafter), &mut verifier, &[1, 2, 3], &params, &mut Collect::default())
        .await
        .unwrap();
    let lines = rounds.0.lock().unwrap().clone();
    let records: Vec<RoundRecord> = lines
        .iter()
        .map(|line| RoundRecord::from_log_line(line).expect(line).expect(line))
        .collect();
    assert_eq!(records.len(), end.stats.target_calls);
    assert_eq!(records.iter().map(|r| r.drafted).collect::<Vec<_>>(), verifier.blocks);
    assert!(records[0].first_call && records[1..].iter().all(|r| !r.first_call), "{records:?}");
    // Each round commits its accepted drafts and one token more, from the budget left before it.
    let mut remaining = 20;
    for r in &records {
        assert_eq!(
            (r.remaining, r.accepted, r.cap, r.max_draft, r.draft_ahead),
            (remaining, r.drafted.min(2), r.drafted, 4, true),
            "{r:?}"
        );
        assert_eq!(r.confidences.len(), r.drafted);
        remaining -= r.accepted + 1;
    }
    assert_eq!(remaining, 0);
}
