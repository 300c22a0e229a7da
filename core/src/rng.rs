//! Deterministic randomness keyed by (stream, seed, position).
//!
//! The verifier's decision at a position depends only on the request, so a retried `/verify` gets the
//! same answer and runs with a `seed` reproduce. The draft and the verifier use separate streams: the
//! acceptance test must be independent of the draw it judges, or the output would be biased.

use rand::SeedableRng;
use rand_chacha::ChaCha12Rng;

/// Which party draws: the edge drafting a token, or the cloud judging one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Draft = 1,
    Verify = 2,
    /// Seeds of a request's further choices (`n` > 1).
    Choice = 3,
}

/// A generator for one decision at one absolute token position.
pub fn rng_for(stream: Stream, seed: u64, position: u64) -> ChaCha12Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&position.to_le_bytes());
    key[16..24].copy_from_slice(&(stream as u64).to_le_bytes());
    key[24..].copy_from_slice(b"SPADE-v1");
    ChaCha12Rng::from_seed(key)
}

/// The seed of choice `index` of a request seeded with `seed`: the first keeps it (so `n` = 1 answers
/// as before); the others get independent ones, the same for the same request.
pub fn choice_seed(seed: u64, index: u32) -> u64 {
    use rand::Rng;
    if index == 0 {
        seed
    } else {
        rng_for(Stream::Choice, seed, index as u64).random()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn keyed_by_all_three() {
        let draw = |s, seed, pos| rng_for(s, seed, pos).random::<u64>();
        assert_eq!(draw(Stream::Verify, 1, 2), draw(Stream::Verify, 1, 2));
        assert_ne!(draw(Stream::Verify, 1, 2), draw(Stream::Draft, 1, 2));
        assert_ne!(draw(Stream::Verify, 1, 2), draw(Stream::Verify, 2, 2));
        assert_ne!(draw(Stream::Verify, 1, 2), draw(Stream::Verify, 1, 3));
    }

    #[test]
    fn choices_get_distinct_reproducible_seeds() {
        assert_eq!(choice_seed(7, 0), 7);
        let seeds: std::collections::HashSet<u64> = (0..64).map(|i| choice_seed(7, i)).collect();
        assert_eq!(seeds.len(), 64);
        assert_eq!(choice_seed(7, 5), choice_seed(7, 5));
        assert_ne!(choice_seed(7, 5), choice_seed(8, 5));
    }
}
