//! Soak: 320 draft rounds on one engine, alone in this test process so RSS means something.

mod common;

use common::*;
use spade_core::SamplingParams;
use spade_engine::drafter::DrafterOptions;
use spade_engine::DraftParams;
use spade_engine::{Drafter, Role};
use spade_test_support::threads;

fn rss_mb() -> f64 {
    spade_test_support::rss_mb(std::process::id())
}

/// 320 rounds on one engine, no rebuilds: prefix-cache eviction keeps memory bounded (unpatched
/// 0.8.1 never evicted on CPU: ~11 MB more every round here), and seeded generations that rebuild the
/// engine leave no thread behind (unpatched, each dropped engine's logger thread looped forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_memory_and_threads_stay_bounded() {
    let own =
        drafter(TINY, DrafterOptions { cache_budget_bytes: None, ..DrafterOptions::default() })
            .await;
    let params = DraftParams {
        sampling: SamplingParams { temperature: 0.8, ..SamplingParams::default() },
        seed: 1,
        ..DraftParams::default()
    };
    let mut samples = Vec::new();
    let mut seq = Vec::new();
    let started = std::time::Instant::now();
    for round in 0..320 {
        if round % 40 == 0 {
            seq = own
                .encode_chat(&[(Role::User, PROMPTS[round / 40 % PROMPTS.len()].into())])
                .await
                .unwrap();
        }
        let drafts = own.draft(&seq, 4, &params).await.unwrap();
        seq.extend(drafts.iter().map(|d| d.token));
        seq.push(drafts.last().map_or(1, |d| d.token));
        if round % 32 == 31 {
            samples.push(rss_mb());
        }
    }
    println!(
        "RSS (MB) every 32 rounds: {samples:?}; {:.1}s for 320 rounds",
        started.elapsed().as_secs_f64()
    );
    // Unbounded, the 160 rounds between the two halves' peaks would add ~1.8 GB; allow a quarter of
    // that for allocator and context-length noise.
    let half = samples.len() / 2;
    let peak = |xs: &[f64]| xs.iter().cloned().fold(0.0, f64::max);
    let (early, late) = (peak(&samples[..half]), peak(&samples[half..]));
    assert!(late < early + 450.0, "RSS peaks grew from {early} MB to {late} MB");

    // Twelve seeded generations on an idle drafter: twelve engine rebuilds.
    let before = threads(std::process::id());
    for _ in 0..12 {
        own.begin_generation(true).await;
        own.draft(&seq, 2, &params).await.unwrap();
        own.end_generation();
    }
    // The old engines' threads check for their end every 5 s.
    tokio::time::sleep(std::time::Duration::from_secs(7)).await;
    let after = threads(std::process::id());
    println!("threads: {before} before 12 engine rebuilds, {after} after");
    assert!(after <= before + 2, "engine rebuilds left threads behind: {before} -> {after}");
}
