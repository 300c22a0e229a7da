//! Quantising the draft's q to multiples of 1/4096 before drawing from it keeps the rule exact (the
//! q sent is the q drawn from); what it may cost is acceptance. Measured without sampling noise:
//! the expected acceptance of a draft token is sum_x min(p(x), q(x)), over every prompt position of
//! the Qwen pair at T = 0.8 (the draft capped at the gateway's default top-32).

mod common;

use common::*;
use spade_core::{distribution, SamplingParams, SparseDist};
use spade_engine::drafter::DrafterOptions;
use spade_engine::{Role, Scorer};

fn overlap(p: &SparseDist, q: &SparseDist) -> f64 {
    q.entries().iter().map(|&(t, _)| p.prob(t).min(q.prob(t))).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantised_q_costs_under_a_point_of_acceptance() {
    let target = scorer(TARGET);
    let draft = drafter(DRAFT, DrafterOptions::default()).await;
    let sampling = SamplingParams { temperature: 0.8, ..SamplingParams::default() };
    let draft_sampling = sampling.for_draft(32);
    let (mut exact, mut quantised, mut positions, mut entries) = (0.0, 0.0, 0usize, 0usize);
    for prompt in &PROMPTS[..6] {
        let ids = draft.encode_chat(&[(Role::User, prompt.to_string())]).await.unwrap();
        let p_rows = target.new_session().score(&ids, ids.len()).unwrap();
        let q_rows = draft.raw_logits(&ids).await.unwrap();
        for (p_row, q_row) in p_rows.iter().zip(&q_rows) {
            let p = distribution(p_row, &sampling).unwrap();
            let q = distribution(q_row, &draft_sampling).unwrap();
            let qq = q.quantized();
            exact += overlap(&p, &q);
            quantised += overlap(&p, &qq);
            positions += 1;
            entries += qq.len();
        }
    }
    let (exact, quantised) = (exact / positions as f64, quantised / positions as f64);
    println!(
        "{positions} positions: expected acceptance {:.4} with q, {:.4} with quantised q ({:+.4}); {:.1} entries per quantised q",
        exact,
        quantised,
        quantised - exact,
        entries as f64 / positions as f64
    );
    assert!(positions > 100);
    assert!(
        (exact - quantised).abs() < 0.01,
        "quantising q moved acceptance by {:.4}",
        quantised - exact
    );
}
