//! Per-session KV caches and the prefix cache of finished sessions, under one memory budget.
//!
//! A live session is a generation in progress. When its gateway ends it, its KV rows are kept as a
//! prefix cache entry (unless `--prefix-cache false`), indexed by their tokens
//! ([`PrefixIndex`]): a later session whose full context starts with the same tokens (the next turn
//! of a conversation, which resends everything before it) starts from those rows and prefills only
//! the rest. The rows are the ones a cold prefill computes, bit for bit, since the scorer computes
//! every row the same whatever the chunking.
//!
//! Over the budget, cache entries go first, least recently used first; then idle live sessions, least
//! recently used first. A session a call is using is never evicted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use spade_core::grammar::GrammarState;
use spade_core::prefix_index::{shared_prefix, PrefixIndex, DEFAULT_BLOCK};
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

/// A finished session's KV rows, kept for the sessions that start with the same tokens.
struct Entry {
    score: Box<dyn ScoreSession>,
    last_used: u64,
    bytes: usize,
}

/// What [`SessionStore::update_size`] and [`SessionStore::end`] evicted to stay within the budget.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub sessions: usize,
    pub cache_entries: usize,
}

/// The store's contents now, for `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub sessions: usize,
    pub session_bytes: usize,
    pub cache_entries: usize,
    pub cache_bytes: usize,
}

struct Inner {
    slots: HashMap<String, Slot>,
    entries: HashMap<u64, Entry>,
    index: PrefixIndex<u64>,
    next_entry: u64,
    clock: u64,
}

impl Inner {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn total_bytes(&self) -> usize {
        self.slots.values().map(|s| s.bytes).sum::<usize>()
            + self.entries.values().map(|e| e.bytes).sum::<usize>()
    }

    fn remove_entry(&mut self, key: u64) -> Option<Entry> {
        self.index.remove(&key);
        self.entries.remove(&key)
    }

    /// Evicts until the total fits `budget`: cache entries first, then idle live sessions other than
    /// `keep`, least recently used first. Returns what went, to be dropped outside the lock.
    fn evict(
        &mut self,
        budget: usize,
        keep: Option<&str>,
    ) -> (Evicted, Vec<Box<dyn ScoreSession>>, Vec<SharedSession>) {
        let (mut evicted, mut entries, mut sessions) = (Evicted::default(), Vec::new(), Vec::new());
        while self.total_bytes() > budget {
            if let Some(key) = self.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| *k)
            {
                entries.extend(self.remove_entry(key).map(|e| e.score));
                evicted.cache_entries += 1;
                continue;
            }
            let victim = self
                .slots
                .iter()
                .filter(|(name, s)| {
                    Some(name.as_str()) != keep && Arc::strong_count(&s.session) == 1
                })
                .min_by_key(|(_, s)| s.last_used)
                .map(|(name, _)| name.clone());
            match victim {
                Some(name) => {
                    sessions.extend(self.slots.remove(&name).map(|s| s.session));
                    evicted.sessions += 1;
                }
                None => break,
            }
        }
        (evicted, entries, sessions)
    }
}

pub struct SessionStore {
    inner: Mutex<Inner>,
    budget_bytes: usize,
    prefix_cache: bool,
}

impl SessionStore {
    /// `prefix_cache`: keep finished sessions' rows for later sessions that share their prefix.
    pub fn new(budget_bytes: usize, prefix_cache: bool) -> Self {
        let inner = Inner {
            slots: HashMap::new(),
            entries: HashMap::new(),
            index: PrefixIndex::new(DEFAULT_BLOCK),
            next_entry: 0,
            clock: 0,
        };
        Self { inner: Mutex::new(inner), budget_bytes, prefix_cache }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The session for a call that sends the full `context`: the live one named `id`, else a new one
    /// (named `id` when given) that starts from the longest cached prefix of `context`, or empty
    /// from `fresh`.
    pub fn open(
        &self,
        id: Option<&str>,
        context: &[u32],
        fresh: impl FnOnce() -> Box<dyn ScoreSession>,
    ) -> SharedSession {
        let mut inner = self.lock();
        let now = inner.tick();
        if let Some(slot) = id.and_then(|id| inner.slots.get_mut(id)) {
            slot.last_used = now;
            return slot.session.clone();
        }
        let score =
            self.start_from_cache(&mut inner, context, now, id.is_some()).unwrap_or_else(fresh);
        let session = Arc::new(AsyncMutex::new(Session::new(score)));
        if let Some(id) = id {
            inner.slots.insert(
                id.to_string(),
                Slot { session: session.clone(), last_used: now, bytes: MIN_SESSION_BYTES },
            );
        }
        session
    }

    /// The rows of the cache entry sharing the longest prefix with `context`, as a session of their
    /// own: the entry itself when `context` extends all of it (the next turn of its conversation), a
    /// copy of the shared rows otherwise (the entry stays for the other branches), and always for a
    /// one-off call (`keeps`: false), whose session goes when the call does. An idle live
    /// session sharing more is copied instead: a generation whose end has not reached us yet (its
    /// gateway ends it after answering, so the next turn may arrive first).
    fn start_from_cache(
        &self,
        inner: &mut Inner,
        context: &[u32],
        now: u64,
        keeps: bool,
    ) -> Option<Box<dyn ScoreSession>> {
        if !self.prefix_cache {
            return None;
        }
        let entries = &inner.entries;
        let hit = inner.index.longest(context, |key| entries.get(key).map_or(0, |e| e.last_used));
        let cached = hit.as_ref().map_or(0, |h| h.shared);
        if let Some(copy) =
            fork_idle_session(inner.slots.values(), context, cached.max(inner.index.block() - 1))
        {
            return Some(copy);
        }
        let hit = hit?;
        let whole = inner.index.tokens(&hit.key).is_some_and(|t| t.len() == hit.shared);
        let entry = inner.entries.get_mut(&hit.key)?;
        entry.last_used = now;
        if !whole || !keeps {
            if let Some(copy) = entry.score.fork(hit.shared) {
                return Some(copy);
            }
        }
        // The entry itself: taken whole, or cut to the shared rows where the scorer cannot copy.
        let mut score = inner.remove_entry(hit.key)?.score;
        score.truncate(hit.shared);
        Some(score)
    }

    /// The session named `id`, if it exists (never creates one).
    pub fn get(&self, id: &str) -> Option<SharedSession> {
        let mut inner = self.lock();
        let now = inner.tick();
        let slot = inner.slots.get_mut(id)?;
        slot.last_used = now;
        Some(slot.session.clone())
    }

    /// Records a session's size after a call, then evicts until the total fits the budget.
    pub fn update_size(&self, id: &str, bytes: usize) -> Evicted {
        let mut inner = self.lock();
        if let Some(slot) = inner.slots.get_mut(id) {
            slot.bytes = bytes.max(MIN_SESSION_BYTES);
        }
        let (evicted, entries, sessions) = inner.evict(self.budget_bytes, Some(id));
        drop(inner);
        release(entries, sessions);
        evicted
    }

    /// Ends a session: its rows join the prefix cache (when it is on and no call still uses the
    /// session), else they are freed. None if the session was unknown.
    pub fn end(&self, id: &str) -> Option<Evicted> {
        let mut inner = self.lock();
        let slot = inner.slots.remove(id)?;
        let mut dropped: Vec<Box<dyn ScoreSession>> = Vec::new();
        // A call still holding the session finishes on its own copy, which is then freed.
        let score = Arc::try_unwrap(slot.session).ok().map(|m| m.into_inner().score);
        match score {
            Some(score)
                if self.prefix_cache && score.cached_tokens().len() >= inner.index.block() =>
            {
                let now = inner.tick();
                let key = inner.next_entry;
                inner.next_entry += 1;
                inner.index.insert(key, score.cached_tokens().to_vec());
                let bytes = score.memory_bytes().max(MIN_SESSION_BYTES);
                inner.entries.insert(key, Entry { score, last_used: now, bytes });
            }
            score => dropped.extend(score),
        }
        let (evicted, entries, sessions) = inner.evict(self.budget_bytes, None);
        drop(inner);
        dropped.extend(entries);
        release(dropped, sessions);
        Some(evicted)
    }

    /// Whether finished sessions' rows are kept (`--prefix-cache`).
    pub fn prefix_cache(&self) -> bool {
        self.prefix_cache
    }

    pub fn usage(&self) -> Usage {
        let inner = self.lock();
        Usage {
            sessions: inner.slots.len(),
            session_bytes: inner.slots.values().map(|s| s.bytes).sum(),
            cache_entries: inner.entries.len(),
            cache_bytes: inner.entries.values().map(|e| e.bytes).sum(),
        }
    }
}

/// A copy of the rows an idle live session shares with `context`, where it shares more than `beat`.
fn fork_idle_session<'a>(
    slots: impl Iterator<Item = &'a Slot>,
    context: &[u32],
    beat: usize,
) -> Option<Box<dyn ScoreSession>> {
    let mut best: Option<(usize, tokio::sync::MutexGuard<'a, Session>)> = None;
    for slot in slots {
        // Held by a call (locked, or about to be): its rows are changing.
        let Ok(session) = slot.session.try_lock() else { continue };
        let shared = shared_prefix(session.score.cached_tokens(), context);
        if shared > best.as_ref().map_or(beat, |b| b.0) {
            best = Some((shared, session));
        }
    }
    let (shared, session) = best?;
    session.score.fork(shared)
}

/// Frees evicted caches outside the store's lock, and hands their pages back to the system.
fn release(entries: Vec<Box<dyn ScoreSession>>, sessions: Vec<SharedSession>) {
    if entries.is_empty() && sessions.is_empty() {
        return;
    }
    drop(entries);
    drop(sessions);
    spade_engine::release_freed_memory();
}

#[cfg(test)]
mod tests {
    use super::*;
    use spade_engine::EngineError;

    /// A session that holds token ids and charges a fixed number of bytes per token.
    struct Rows {
        tokens: Vec<u32>,
        forks: bool,
    }

    const BYTES_PER_TOKEN: usize = 1000;

    impl ScoreSession for Rows {
        fn score(
            &mut self,
            tokens: &[u32],
            _n_logits: usize,
        ) -> Result<Vec<Vec<f32>>, EngineError> {
            self.tokens = tokens.to_vec();
            Ok(Vec::new())
        }
        fn cached_tokens(&self) -> &[u32] {
            &self.tokens
        }
        fn truncate(&mut self, len: usize) {
            self.tokens.truncate(len);
        }
        fn memory_bytes(&self) -> usize {
            self.tokens.len() * BYTES_PER_TOKEN
        }
        fn fork(&self, len: usize) -> Option<Box<dyn ScoreSession>> {
            self.forks.then(|| {
                Box::new(Rows { tokens: self.tokens[..len].to_vec(), forks: true })
                    as Box<dyn ScoreSession>
            })
        }
    }

    fn fresh() -> Box<dyn ScoreSession> {
        Box::new(Rows { tokens: Vec::new(), forks: true })
    }

    fn turn(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }

    /// Opens `id` with `context`, scores it, records its size; returns the rows it started with.
    fn run(store: &SessionStore, id: &str, context: &[u32]) -> usize {
        let session = store.open(Some(id), context, fresh);
        let mut s = session.try_lock().unwrap();
        let reused = s.score.cached_tokens().len();
        s.score.score(context, 1).unwrap();
        let bytes = s.bytes();
        drop(s);
        store.update_size(id, bytes);
        reused
    }

    #[test]
    fn a_conversations_next_turn_starts_from_its_last() {
        let store = SessionStore::new(usize::MAX, true);
        assert_eq!(run(&store, "a", &turn(100)), 0);
        store.end("a").unwrap();
        assert_eq!(store.usage().cache_entries, 1);
        // Turn 2 extends all of turn 1: the entry is taken over, not copied.
        assert_eq!(run(&store, "b", &turn(180)), 100);
        assert_eq!(store.usage().cache_entries, 0);
        store.end("b").unwrap();
        // A branch off turn 1 copies the shared rows and leaves the entry for the others.
        let mut branch = turn(150);
        branch[120] = 9999;
        assert_eq!(run(&store, "c", &branch), 120);
        assert_eq!(store.usage().cache_entries, 1);
        // Without the prefix cache, every session starts empty.
        let off = SessionStore::new(usize::MAX, false);
        run(&off, "a", &turn(100));
        off.end("a").unwrap();
        assert_eq!((run(&off, "b", &turn(180)), off.usage().cache_entries), (0, 0));
    }

    #[test]
    fn a_turn_that_arrives_before_the_last_one_ended_copies_its_rows() {
        let store = SessionStore::new(usize::MAX, true);
        run(&store, "a", &turn(100));
        // "a" is idle but not ended: the next turn copies its rows, and "a" keeps them.
        assert_eq!(run(&store, "b", &turn(150)), 100);
        assert_eq!(store.get("a").unwrap().try_lock().unwrap().score.cached_tokens().len(), 100);
        // A session a call holds is not a source.
        let held = store.get("b").unwrap();
        let _guard = held.try_lock().unwrap();
        assert_eq!(run(&store, "c", &turn(200)), 100, "from a, not from the held b");
    }

    #[test]
    fn a_scorer_that_cannot_copy_hands_over_the_entry_cut_short() {
        let store = SessionStore::new(usize::MAX, true);
        let session = store
            .open(Some("a"), &turn(64), || Box::new(Rows { tokens: Vec::new(), forks: false }));
        session.try_lock().unwrap().score.score(&turn(64), 1).unwrap();
        drop(session);
        store.end("a").unwrap();
        let mut branch = turn(64);
        branch[40] = 7;
        assert_eq!(run(&store, "b", &branch), 40);
        assert_eq!(store.usage().cache_entries, 0);
    }

    #[test]
    fn the_budget_evicts_cache_entries_oldest_first_before_any_live_session() {
        // Room for 250 tokens' rows.
        let store = SessionStore::new(250 * BYTES_PER_TOKEN, true);
        let conversation = |salt: u32, n: usize| -> Vec<u32> {
            (0..n as u32).map(|i| i + salt * 100_000).collect()
        };
        for (i, salt) in [1u32, 2, 3].iter().enumerate() {
            let id = format!("s{i}");
            run(&store, &id, &conversation(*salt, 80));
            assert_eq!(store.end(&id), Some(Evicted::default()));
        }
        assert_eq!(store.usage().cache_entries, 3);
        // A live session of 100 rows: the two oldest entries go, the newest stays.
        let live = store.open(Some("live"), &conversation(9, 100), fresh);
        live.try_lock().unwrap().score.score(&conversation(9, 100), 1).unwrap();
        let bytes = live.try_lock().unwrap().bytes();
        assert_eq!(store.update_size("live", bytes), Evicted { sessions: 0, cache_entries: 2 });
        let rows_for = |salt| {
            store
                .open(None, &conversation(salt, 90), fresh)
                .try_lock()
                .unwrap()
                .score
                .cached_tokens()
                .len()
        };
        assert_eq!((rows_for(1), rows_for(2), rows_for(3)), (0, 0, 80));
        // A live session over the budget on its own stays; idle ones and the entry make room for it.
        drop(live);
        let huge = store.open(Some("huge"), &conversation(5, 400), fresh);
        let mut guard = huge.try_lock().unwrap();
        guard.score.score(&conversation(5, 400), 1).unwrap();
        let bytes = guard.bytes();
        drop(guard);
        assert_eq!(store.update_size("huge", bytes), Evicted { sessions: 1, cache_entries: 1 });
        assert!(store.get("huge").is_some());
        assert_eq!(store.usage().cache_entries, 0);
    }

    #[test]
    fn ending_a_session_in_use_frees_it_instead_of_caching() {
        let store = SessionStore::new(usize::MAX, true);
        let session = store.open(Some("a"), &turn(64), fresh);
        session.try_lock().unwrap().score.score(&turn(64), 1).unwrap();
        assert!(store.end("a").is_some());
        assert_eq!(store.usage(), Usage::default());
        assert_eq!(store.end("a"), None);
        // Too short for one block: not worth an entry.
        run(&store, "b", &turn(10));
        store.end("b");
        assert_eq!(store.usage().cache_entries, 0);
    }
}
