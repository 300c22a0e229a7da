//! Draft tokens handed over one by one as the draft model draws them.

use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::{DraftToken, EngineError};

/// A drafted token as the drafting engine hands it over.
#[derive(Debug)]
pub struct Drawn {
    pub token: DraftToken,
    /// How sure the draft was of it ([`spade_core::confidence`]).
    pub confidence: f32,
    /// When the draft model drew it: the draft's own pace, whenever the receiver gets around to reading it.
    pub at: Instant,
}

/// What a drafting engine sends: each token as drawn, then how the drafting ended.
#[derive(Debug)]
pub enum DraftMessage {
    Token(Drawn),
    End(Result<(), EngineError>),
}

/// Asked as each token of a block is drawn, with the draft's confidence in it: whether the block goes on.
/// It is asked by whatever draws the tokens, so a block that ends on it costs the draft model no step past
/// its end: a stream that is dropped instead is noticed only when the model samples its next token, after
/// running that step (~55 ms of a 0.5B draft on one core).
pub struct KeepDrafting(Box<dyn FnMut(f32) -> bool + Send>);

impl KeepDrafting {
    pub fn new(rule: impl FnMut(f32) -> bool + Send + 'static) -> Self {
        Self(Box::new(rule))
    }

    /// Whether to draw another token after one drawn with `confidence`.
    pub fn ask(&mut self, confidence: f32) -> bool {
        (self.0)(confidence)
    }
}

impl std::fmt::Debug for KeepDrafting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeepDrafting")
    }
}

/// A block being drafted. Dropping it tells the drafting engine to stop at its next step (its sender
/// sees the channel closed), so drafting nobody will use does not hold the draft model.
pub struct DraftStream<'a> {
    messages: UnboundedReceiver<DraftMessage>,
    /// Tokens still wanted; an end-of-sequence token ends the block early.
    left: usize,
    stop_token_ids: Vec<u32>,
    /// Whatever must live as long as the drafting does (a lock on the engine it runs on).
    _hold: Option<Box<dyn Send + Sync + 'a>>,
}

impl<'a> DraftStream<'a> {
    /// A stream fed through the returned sender, ending after `n` tokens, an end-of-sequence token or
    /// an [`DraftMessage::End`].
    pub fn channel(n: usize, stop_token_ids: Vec<u32>) -> (UnboundedSender<DraftMessage>, Self) {
        let (tx, messages) = unbounded_channel();
        (tx, Self { messages, left: n, stop_token_ids, _hold: None })
    }

    /// Keeps `hold` alive as long as the stream.
    pub fn holding(self, hold: Box<dyn Send + Sync + 'a>) -> Self {
        Self { _hold: Some(hold), ..self }
    }

    /// Tokens drafted all at once, each as sure as its q says, up to where `keep` ends the block.
    pub fn ready(tokens: Vec<DraftToken>, mut keep: Option<KeepDrafting>) -> Self {
        let (tx, stream) = Self::channel(tokens.len(), Vec::new());
        let at = Instant::now();
        for token in tokens {
            let confidence = token.q.prob(token.token) as f32;
            let _ = tx.send(DraftMessage::Token(Drawn { token, confidence, at }));
            if keep.as_mut().is_some_and(|keep| !keep.ask(confidence)) {
                break;
            }
        }
        let _ = tx.send(DraftMessage::End(Ok(())));
        stream
    }

    /// The next drafted token; None once the block is complete.
    pub async fn next(&mut self) -> Option<Result<Drawn, EngineError>> {
        if self.left == 0 {
            return None;
        }
        match self.messages.recv().await {
            Some(DraftMessage::Token(drawn)) => {
                self.left -= 1;
                if self.stop_token_ids.contains(&drawn.token.token) {
                    self.left = 0;
                }
                Some(Ok(drawn))
            }
            Some(DraftMessage::End(Ok(()))) => {
                self.left = 0;
                None
            }
            Some(DraftMessage::End(Err(e))) => {
                self.left = 0;
                Some(Err(e))
            }
            None => {
                self.left = 0;
                Some(Err(EngineError::Drafter(
                    "the draft engine stopped without finishing the block".into(),
                )))
            }
        }
    }

    /// The whole block.
    pub async fn collect(mut self) -> Result<Vec<DraftToken>, EngineError> {
        let mut tokens = Vec::new();
        while let Some(drawn) = self.next().await {
            tokens.push(drawn?.token);
        }
        Ok(tokens)
    }
}

#[cfg(test)]
mod tests {
    use spade_core::SparseDist;

    use super::*;

    #[tokio::test]
    async fn a_ready_block_ends_where_its_rule_says() {
        let tokens: Vec<DraftToken> =
            (0..5).map(|t| DraftToken { token: t, q: SparseDist::point(t) }).collect();
        let mut asked = 0;
        let keep = KeepDrafting::new(move |confidence| {
            assert_eq!(confidence, 1.0);
            asked += 1;
            asked < 2
        });
        let drawn = DraftStream::ready(tokens.clone(), Some(keep)).collect().await.unwrap();
        assert_eq!(drawn.iter().map(|d| d.token).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(DraftStream::ready(tokens, None).collect().await.unwrap().len(), 5);
    }
}
