//! The drafting side of a round: how long the next block should be ([`Pacing`]), and a block being
//! drafted token by token ([`Block`]), which may run while the previous block is verified.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spade_core::draft_control::{
    BlockEnd, BlockKind, BlockOdds, CopiedBlock, DraftChoice, DraftController, Estimates,
    RoundObservation,
};
use spade_core::openai::DraftLen;
use spade_core::DraftToken;

use crate::{DraftParams, DraftStream, Drafter, EngineError, KeepDrafting};

/// Draft tokens per round: a fixed number, or chosen online each round.
#[derive(Debug, Clone)]
pub enum DraftLenSetting {
    /// This many every round; 0 = target-only decoding through the verifier.
    Fixed(usize),
    /// Chosen by spade-core's [`DraftController`] up to `max`, starting from `seed`'s estimates
    /// (gateway-wide ones); every round's observations also go back into `seed`.
    /// `block_end`: where a block ends (at the chosen length, or where the draft turns unsure).
    Auto { max: usize, seed: Arc<Mutex<Estimates>>, block_end: BlockEnd },
}

impl DraftLenSetting {
    /// As the API names it: the number, or `auto`.
    pub fn label(&self) -> DraftLen {
        match self {
            Self::Fixed(n) => DraftLen::Fixed(*n as u32),
            Self::Auto { .. } => DraftLen::AUTO,
        }
    }

    pub fn max(&self) -> usize {
        match self {
            Self::Fixed(n) => *n,
            Self::Auto { max, .. } => *max,
        }
    }
}

/// One generation's draft-length policy.
pub(crate) enum Pacing {
    Fixed(usize),
    Auto { controller: Box<DraftController>, shared: Arc<Mutex<Estimates>> },
}

impl Pacing {
    pub fn new(length: &DraftLenSetting, overlap: bool) -> Self {
        match length {
            DraftLenSetting::Fixed(n) => Self::Fixed(*n),
            DraftLenSetting::Auto { max, seed, block_end } => {
                let estimates = seed.lock().map(|e| e.clone()).unwrap_or_default();
                let controller =
                    DraftController::new(*max, overlap, estimates).with_block_end(*block_end);
                Self::Auto { controller: Box::new(controller), shared: seed.clone() }
            }
        }
    }

    /// Chooses the next block, of `kind`: the most it may draft ([`DraftController::block_cap`] under `auto`).
    pub fn choose(&mut self, kind: BlockKind) -> usize {
        match self {
            Self::Fixed(n) => *n,
            Self::Auto { controller, .. } => {
                controller.choose(kind);
                controller.block_cap()
            }
        }
    }

    /// Where the block just chosen ends before its cap, asked as each of its tokens is drawn (after
    /// `guess`, the guess drafted ahead first, which is not the block's): the controller's rule as it
    /// stands now ([`DraftController::keep_drafting`]). None: at its cap.
    pub fn keep_drafting(&self, guess: bool) -> Option<KeepDrafting> {
        match self {
            Self::Auto { controller, .. } if controller.ends_blocks_early() => {
                let controller = controller.clone();
                let (mut odds, mut unasked) = (BlockOdds::default(), usize::from(guess));
                Some(KeepDrafting::new(move |confidence| match unasked.checked_sub(1) {
                    Some(left) => {
                        unasked = left;
                        true
                    }
                    None => controller.keep_drafting(&mut odds, confidence),
                }))
            }
            _ => None,
        }
    }

    /// How much of a copied block to send instead of the draft model's ([`DraftController::copied_block`]
    /// under `auto`). A fixed length has no cost model: the whole block is sent while its first token is
    /// expected to be accepted at least half the time; a length of 0 sends none.
    pub fn copied_block(&self, expected: &[f64], ahead_ready: bool) -> Option<CopiedBlock> {
        match self {
            Self::Fixed(0) => None,
            Self::Fixed(_) => expected
                .first()
                .filter(|&&e| e >= 1.5)
                .map(|&e| CopiedBlock { len: expected.len(), worth: e }),
            Self::Auto { controller, .. } => controller.copied_block(expected, ahead_ready),
        }
    }

    /// Whether a round that drafts nothing drafts a guess anyway, to measure the draft's acceptance.
    pub fn probe(&mut self) -> bool {
        match self {
            Self::Fixed(_) => false,
            Self::Auto { controller, .. } => controller.probe(),
        }
    }

    pub fn observe(&mut self, round: &RoundObservation) {
        if let Self::Auto { controller, shared } = self {
            controller.observe(round);
            if let Ok(mut shared) = shared.lock() {
                shared.observe(round);
            }
        }
    }

    /// The first call's link time (it processes the prompt, so it is no round to model otherwise).
    pub fn observe_link(&mut self, call_latency: Duration, verifier_time: Duration) {
        if let Self::Auto { controller, shared } = self {
            controller.observe_link(call_latency, verifier_time);
            if let Ok(mut shared) = shared.lock() {
                shared.observe_link(call_latency, verifier_time);
            }
        }
    }

    /// A copied block's call: the verifier's time for its `rows`, and the link.
    pub fn observe_block_call(
        &mut self,
        rows: usize,
        call_latency: Duration,
        verifier_time: Duration,
    ) {
        if let Self::Auto { controller, shared } = self {
            controller.observe_block_call(rows, call_latency, verifier_time);
            if let Ok(mut shared) = shared.lock() {
                shared.observe_block_call(rows, call_latency, verifier_time);
            }
        }
    }

    pub fn choice(&self) -> Option<DraftChoice> {
        match self {
            Self::Fixed(_) => None,
            Self::Auto { controller, .. } => Some(controller.choice()),
        }
    }
}

/// A block being drafted. With `guess`, its first token is the draft's guess for the token the
/// verifier commits after the block in flight (draft-ahead), and the rest is the block after it.
pub(crate) struct Block<'a> {
    /// None once the block is complete or its drafting was stopped.
    stream: Option<DraftStream<'a>>,
    tokens: Vec<DraftToken>,
    /// How sure the draft was of each of `tokens`.
    confidences: Vec<f32>,
    guess: bool,
    /// The guess was drawn by this stream and then removed (it is the verifier's token now).
    dropped_guess: bool,
    /// Most block tokens wanted (the guess not counted).
    cap: usize,
    started: Instant,
    /// From the start to when the first token was drawn.
    first: Option<Duration>,
    /// From the start to when the last token received was drawn.
    pub busy: Duration,
}

/// The draft model's pace in one block: its time per token, and what came before its first step
/// (starting the request, catching up on committed tokens). Zero where the block cannot tell.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct DraftTiming {
    pub start: Duration,
    pub step: Duration,
}

impl<'a> Block<'a> {
    /// Starts drafting up to `cap` tokens after `context` (plus a guess first when `guess`), ending
    /// sooner where the pacing's rule says ([`Pacing::keep_drafting`]).
    pub async fn start(
        drafter: &'a dyn Drafter,
        context: &[u32],
        cap: usize,
        guess: bool,
        params: &DraftParams,
        pacing: &Pacing,
    ) -> Result<Self, EngineError> {
        let started = Instant::now();
        let stream = drafter
            .draft_stream(context, cap + usize::from(guess), params, pacing.keep_drafting(guess))
            .await?;
        Ok(Self {
            stream: Some(stream),
            tokens: Vec::new(),
            confidences: Vec::new(),
            guess,
            dropped_guess: false,
            cap,
            started,
            first: None,
            busy: Duration::ZERO,
        })
    }

    /// Draws one more token; false once the block is complete (its cap reached, an end-of-sequence
    /// token, or the drafting ended where the pacing's rule said).
    async fn pull(&mut self) -> Result<bool, EngineError> {
        if self.tokens.len() >= self.cap + usize::from(self.guess) {
            self.stream = None;
        }
        let Some(stream) = self.stream.as_mut() else { return Ok(false) };
        let Some(drawn) = stream.next().await.transpose()? else {
            self.stream = None;
            return Ok(false);
        };
        self.tokens.push(drawn.token);
        self.confidences.push(drawn.confidence);
        self.busy = drawn.at.saturating_duration_since(self.started);
        self.first.get_or_insert(self.busy);
        Ok(self.stream.is_some())
    }

    /// Drafts while `until` runs and returns its output. A drafting error only ends the drafting: the
    /// block is then treated as incomplete (its tokens so far stay valid).
    pub async fn pull_while<F: Future>(&mut self, until: F) -> F::Output {
        tokio::pin!(until);
        loop {
            if self.stream.is_none() {
                return until.await;
            }
            tokio::select! {
                biased;
                output = &mut until => return output,
                pulled = self.pull() => if let Err(e) = pulled {
                    tracing::debug!("drafting ahead failed: {e}");
                    self.stream = None;
                },
            }
        }
    }

    /// The guess, waiting for it if it is not drawn yet (None if the drafting ended without one).
    pub async fn guess(&mut self) -> Option<u32> {
        if self.tokens.is_empty() {
            let _ = self.pull().await;
        }
        self.drawn_guess()
    }

    /// The guess if it is already drawn.
    pub fn drawn_guess(&self) -> Option<u32> {
        self.tokens.first().map(|t| t.token).filter(|_| self.guess)
    }

    /// Drafting after the guess proved right: the rest becomes the current block, completed to at
    /// most `cap` tokens.
    pub fn without_guess(mut self, cap: usize) -> Self {
        if self.guess && !self.tokens.is_empty() {
            self.tokens.remove(0);
            self.confidences.remove(0);
            self.dropped_guess = true;
        }
        self.guess = false;
        self.cap = cap;
        self
    }

    /// Drafts the rest of the block (to its cap, an end-of-sequence token, or where the pacing's rule ends it) and
    /// returns its tokens, any beyond the cap dropped, with the draft model's pace over the whole stream.
    pub async fn complete(mut self) -> Result<Drafted, EngineError> {
        while self.pull().await? {}
        let pulled = self.tokens.len() + usize::from(self.dropped_guess);
        self.tokens.truncate(self.cap + usize::from(self.guess));
        self.confidences.truncate(self.tokens.len());
        let timing = match self.first {
            Some(first) if pulled >= 2 => {
                let step = self.busy.saturating_sub(first) / (pulled - 1) as u32;
                DraftTiming { start: first.saturating_sub(step), step }
            }
            _ => DraftTiming::default(),
        };
        Ok(Drafted { tokens: self.tokens, confidences: self.confidences, timing })
    }
}

/// A completed block: its tokens, how sure the draft was of each, and the draft model's pace.
#[derive(Debug, Default)]
pub(crate) struct Drafted {
    pub tokens: Vec<DraftToken>,
    pub confidences: Vec<f32>,
    pub timing: DraftTiming,
}

/// What a round observed, for the pacing.
pub(crate) fn observation(
    drafted: &Drafted,
    accepted: usize,
    latency: Duration,
    verifier: Option<Duration>,
    guess: Option<bool>,
) -> RoundObservation {
    RoundObservation {
        drafted: drafted.tokens.len(),
        accepted,
        confidences: drafted.confidences.clone(),
        draft_step: drafted.timing.step,
        draft_start: drafted.timing.start,
        call_latency: latency,
        verifier_time: verifier,
        ahead_guess: guess,
    }
}

/// Awaits a verify call; with a `drafter`, while it prefills `context` (the prompt on the first call,
/// so that the two prefills overlap instead of adding up).
pub(crate) async fn with_prefill<F: Future>(
    call: F,
    drafter: Option<&dyn Drafter>,
    context: &[u32],
    params: &DraftParams,
) -> F::Output {
    let Some(drafter) = drafter else {
        return call.await;
    };
    tokio::join!(call, reading(drafter, context.to_vec(), params)).0
}

/// The draft model reading a copied block's context and tokens: a prefill whose result only
/// matters for speed.
pub(crate) type Reading<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

pub(crate) fn reading<'a>(
    drafter: &'a dyn Drafter,
    context: Vec<u32>,
    params: &'a DraftParams,
) -> Reading<'a> {
    Box::pin(async move {
        // A failed prefill only costs speed; the next draft call reports a real failure.
        if let Err(e) = drafter.prefill(&context, params).await {
            tracing::debug!("draft prefill failed: {e}");
        }
    })
}

/// Awaits a verify call while the reading (if any) goes on; a reading that ends first is dropped, one
/// that outlasts the call is kept for the next round.
pub(crate) async fn alongside<F: Future>(call: F, reading: &mut Option<Reading<'_>>) -> F::Output {
    let Some(read) = reading.as_mut() else {
        return call.await;
    };
    tokio::pin!(call);
    let verified = tokio::select! {
        biased;
        verified = &mut call => Some(verified),
        () = read => None,
    };
    match verified {
        Some(verified) => verified,
        None => {
            *reading = None;
            call.await
        }
    }
}

/// Waits for a reading still going on.
pub(crate) async fn finish_reading(reading: &mut Option<Reading<'_>>) {
    if let Some(read) = reading.take() {
        read.await;
    }
}
