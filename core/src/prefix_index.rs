//! An index of token sequences by prefix, for a prefix cache: which stored sequence shares the
//! longest prefix with a new one.
//!
//! As vLLM's automatic prefix caching does, sequences are cut into fixed-size blocks and each full
//! block is keyed by a hash chain (the hash of the block's tokens and of the key of the block
//! before it), so a key names a whole prefix, not one block. A lookup walks the new sequence's
//! chain while some stored sequence has that key: the cost is one pass over the new tokens, however
//! many sequences are stored. The entries found at the deepest key are the only candidates for the
//! longest match (any other shares at least one block less); [`PrefixIndex::longest`] then compares
//! their tokens, which also makes a hash collision harmless.
//!
//! Matches shorter than one block are not found: a cache entry that saves fewer than
//! [`PrefixIndex::block`] positions is not worth its lookup.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// Tokens per block, the unit prefixes are matched in (vLLM's default block size).
pub const DEFAULT_BLOCK: usize = 16;

/// The chain key of each full block of `tokens`: key i names `tokens[..(i + 1) * block]`.
pub fn chain_keys(tokens: &[u32], block: usize) -> Vec<u64> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(block)
        .map(|chunk| {
            // DefaultHasher::new() has fixed keys: the same tokens give the same key in every process.
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            chunk.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// Stored sequences, named by `K`, indexed by their blocks' chain keys.
#[derive(Debug, Clone)]
pub struct PrefixIndex<K: Ord + Clone> {
    block: usize,
    /// Chain key -> the sequences that have that prefix.
    by_key: HashMap<u64, BTreeSet<K>>,
    /// Each sequence's tokens and chain keys.
    entries: HashMap<K, (Vec<u32>, Vec<u64>)>,
}

/// A lookup's answer: the entry and how many leading tokens it shares with the sequence looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch<K> {
    pub key: K,
    pub shared: usize,
}

impl<K: Ord + Clone + Hash> PrefixIndex<K> {
    pub fn new(block: usize) -> Self {
        assert!(block > 0, "a block holds at least one token");
        Self { block, by_key: HashMap::new(), entries: HashMap::new() }
    }

    pub fn block(&self) -> usize {
        self.block
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Stores `tokens` under `key`, replacing what `key` held.
    pub fn insert(&mut self, key: K, tokens: Vec<u32>) {
        self.remove(&key);
        let keys = chain_keys(&tokens, self.block);
        for k in &keys {
            self.by_key.entry(*k).or_default().insert(key.clone());
        }
        self.entries.insert(key, (tokens, keys));
    }

    /// Forgets `key`; its tokens, if it was stored.
    pub fn remove(&mut self, key: &K) -> Option<Vec<u32>> {
        let (tokens, keys) = self.entries.remove(key)?;
        for k in keys {
            if let Some(set) = self.by_key.get_mut(&k) {
                set.remove(key);
                if set.is_empty() {
                    self.by_key.remove(&k);
                }
            }
        }
        Some(tokens)
    }

    /// The stored tokens of `key`.
    pub fn tokens(&self, key: &K) -> Option<&[u32]> {
        self.entries.get(key).map(|(t, _)| t.as_slice())
    }

    /// The stored sequence sharing the longest prefix with `tokens` (at least one block), and how
    /// long that prefix is. Among equally long matches, `prefer` picks (for example the most
    /// recently used): the greatest by its ordering wins.
    pub fn longest<P: Ord>(
        &self,
        tokens: &[u32],
        prefer: impl Fn(&K) -> P,
    ) -> Option<PrefixMatch<K>> {
        let mut deepest = None;
        for k in chain_keys(tokens, self.block) {
            match self.by_key.get(&k) {
                Some(set) => deepest = Some(set),
                None => break,
            }
        }
        deepest?
            .iter()
            .map(|key| {
                let stored = &self.entries[key].0;
                PrefixMatch { key: key.clone(), shared: shared_prefix(stored, tokens) }
            })
            // A colliding key shares fewer tokens than its blocks claim: no match at all.
            .filter(|m| m.shared >= self.block)
            .max_by(|a, b| {
                a.shared.cmp(&b.shared).then_with(|| prefer(&a.key).cmp(&prefer(&b.key)))
            })
    }
}

/// How many leading tokens `a` and `b` share.
pub fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 31 + salt).collect()
    }

    #[test]
    fn finds_the_longest_shared_prefix_past_block_boundaries() {
        let mut index = PrefixIndex::new(4);
        let base = seq(30, 0);
        index.insert("short", base[..9].to_vec());
        index.insert("long", base[..22].to_vec());
        let mut other = base[..6].to_vec();
        other.extend([999, 998, 997, 996, 995]);
        index.insert("branch", other);

        // Shares 22 with "long" (5 full blocks, then 2 more tokens), 9 with "short", 6 with "branch".
        let m = index.longest(&base, |_| 0).unwrap();
        assert_eq!(m, PrefixMatch { key: "long", shared: 22 });
        // A query that diverges inside the third block: "long" and "short" share 9, "short" ends there.
        let mut q = base[..9].to_vec();
        q.extend([5000, 5001, 5002, 5003]);
        let m = index.longest(&q, |k| *k == "short").unwrap();
        assert_eq!(m.shared, 9);
        assert_eq!(m.key, "short", "ties go to the preferred entry");
        let m = index.longest(&q, |k| *k == "long").unwrap();
        assert_eq!((m.key, m.shared), ("long", 9));
    }

    #[test]
    fn less_than_a_block_is_no_match() {
        let mut index = PrefixIndex::new(16);
        index.insert(1u32, seq(15, 0));
        assert_eq!(index.longest(&seq(40, 0), |_| 0), None);
        index.insert(2, seq(16, 0));
        assert_eq!(index.longest(&seq(40, 0), |_| 0), Some(PrefixMatch { key: 2, shared: 16 }));
        assert_eq!(
            index.longest(&seq(40, 1), |_| 0),
            None,
            "different tokens from the first one on"
        );
    }

    #[test]
    fn remove_and_replace_keep_the_index_exact() {
        let mut index = PrefixIndex::new(4);
        index.insert(7u8, seq(20, 0));
        index.insert(8, seq(12, 0));
        assert_eq!(index.longest(&seq(40, 0), |_| 0).unwrap().key, 7);
        assert_eq!(index.remove(&7).map(|t| t.len()), Some(20));
        assert_eq!(index.longest(&seq(40, 0), |_| 0), Some(PrefixMatch { key: 8, shared: 12 }));
        index.insert(8, seq(8, 3));
        assert_eq!(index.longest(&seq(40, 0), |_| 0), None, "8 now holds other tokens");
        assert_eq!(index.remove(&8).map(|t| t.len()), Some(8));
        assert!(index.is_empty() && index.by_key.is_empty(), "no key left behind");
        assert_eq!(index.remove(&8), None);
    }

    #[test]
    fn keys_name_whole_prefixes_not_single_blocks() {
        // The same block after different prefixes has different keys.
        let a = [1, 2, 3, 4, 9, 9, 9, 9];
        let b = [5, 6, 7, 8, 9, 9, 9, 9];
        assert_ne!(chain_keys(&a, 4)[1], chain_keys(&b, 4)[1]);
        assert_eq!(chain_keys(&a, 4), chain_keys(&a[..], 4), "deterministic");
        let mut index = PrefixIndex::new(4);
        index.insert(0u8, b.to_vec());
        assert_eq!(index.longest(&a, |_| 0), None);
    }
}
