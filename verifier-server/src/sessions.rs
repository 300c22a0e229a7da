//! Per-session KV caches under a memory budget, evicted least recently used first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use spade_core::grammar::GrammarState;
use spade_engine::ScoreSession;
use tokio::sync::Mutex as AsyncMutex;

/// A gateway's context on this verifier: the committed ids and the target's cache for them.
pub struct Session {
    pub score: Box<dyn ScoreSession>,
    pub committed: Vec<u32>,
    /// The output's grammar, set by the call that sent the full context.
    pub grammar: Option<GrammarState>,
}

impl Session {
    pub fn new(score: Box<dyn ScoreSession>) -> Self {
        Self { score, committed: Vec::new(), grammar: None }
    }

    pub fn bytes(&self) -> usize {
        self.score.memory_bytes() + self.committed.capacity() * 4
    }
}

pub type SharedSession = Arc<AsyncMutex<Session>>;

/// What the budget charges a session at least, so that many tiny sessions cannot grow the map
/// without limit.
const MIN_SESSION_BYTES: usize = 4096;

struct Slot {
    session: SharedSession,
    last_used: u64,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    slots: HashMap<String, Slot>,
    clock: u64,
}

pub struct SessionStore {
    inner: Mutex<Inner>,
    budget_bytes: usize,
}

impl SessionStore {
    pub fn new(budget_bytes: usize) -> Self {
        Self { inner: Mutex::default(), budget_bytes }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The session named `id`, created empty by `make` if absent.
    pub fn get_or_create(&self, id: &str, make: impl FnOnce() -> Session) -> SharedSession {
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        let slot =
            inner.slots.entry(id.to_string()).or_insert_with(|| Slot { session: Arc::new(AsyncMutex::new(make())), last_used: now, bytes: MIN_SESSION_BYTES });
        slot.last_used = now;
        slot.session.clone()
    }

    /// The session named `id`, if it exists (never creates one).
    pub fn get(&self, id: &str) -> Option<SharedSession> {
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        let slot = inner.slots.get_mut(id)?;
        slot.last_used = now;
        Some(slot.session.clone())
    }

    /// Records a session's size after a call, then evicts idle sessions, least recently used first,
    /// until the total fits the budget. A session in use is never evicted.
    pub fn update_size(&self, id: &str, bytes: usize) -> usize {
        let mut inner = self.lock();
        if let Some(slot) = inner.slots.get_mut(id) {
            slot.bytes = bytes.max(MIN_SESSION_BYTES);
        }
        let mut evicted = 0;
        while inner.slots.values().map(|s| s.bytes).sum::<usize>() > self.budget_bytes {
            let victim = inner
                .slots
                .iter()
                .filter(|(name, s)| name.as_str() != id && Arc::strong_count(&s.session) == 1)
                .min_by_key(|(_, s)| s.last_used)
                .map(|(name, _)| name.clone());
            match victim {
                Some(name) => {
                    inner.slots.remove(&name);
                    evicted += 1;
                }
                None => break,
            }
        }
        evicted
    }

    /// Forgets a session (a call still using it finishes on its own copy). False if it was unknown.
    pub fn remove(&self, id: &str) -> bool {
        self.lock().slots.remove(id).is_some()
    }

    /// (sessions, bytes held).
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.slots.len(), inner.slots.values().map(|s| s.bytes).sum())
    }
}
