//! The emulated link: when a chunk read from one side may be written to the other.
//!
//! The usual way to slow down loopback is `tc qdisc … netem`, which needs the `sch_netem` kernel
//! module (and `CAP_NET_ADMIN`). Neither is available here, so the proxy re-times the byte stream in
//! userspace instead. The model, per direction and per chunk (one `read()` of up to 64 KiB):
//!
//! - **Delay.** A chunk read at time `t` is written at `t + RTT/2 + jitter`, jitter drawn uniformly
//!   from `[0, jitter]`. Bandwidth is not limited: a chunk costs no serialisation time.
//! - **Order.** A chunk never overtakes an earlier one: it is delivered at
//!   `max(previous delivery, t + delay)`, as TCP's in-order delivery would have it.
//! - **Loss.** TCP over loopback never loses a byte, and dropping bytes in a proxy would corrupt the
//!   stream rather than emulate TCP. What a lost segment costs an application is time: the sender
//!   waits for the retransmission timeout and resends. So with probability `loss` a chunk is delayed
//!   by an extra [`LinkConfig::retransmit_penalty`], `max(200 ms, 2·RTT)` (Linux's minimum RTO is
//!   200 ms). Every later chunk of that direction waits behind it (head-of-line blocking). No byte is
//!   ever dropped.
//!
//! What it does not model: the TCP handshake (a client's `connect` completes at once; only data is
//! delayed), congestion windows and bandwidth.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::time::Instant;

/// Floor of the retransmission penalty: Linux's `TCP_RTO_MIN`.
pub const MIN_RTO: Duration = Duration::from_millis(200);

/// The link between the two ends of every proxied connection.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LinkConfig {
    /// Round-trip time; each direction adds half of it.
    pub rtt: Duration,
    /// Upper bound of the extra one-way delay drawn uniformly per chunk.
    pub jitter: Duration,
    /// Probability, in `[0, 1]`, that a chunk pays the retransmission penalty.
    pub loss: f64,
    /// Seed for the jitter and loss draws, so runs repeat; `None` draws one at random.
    pub seed: Option<u64>,
}

impl LinkConfig {
    /// A link with this round-trip time and no jitter or loss.
    pub fn with_rtt(rtt: Duration) -> Self {
        Self { rtt, ..Self::default() }
    }

    /// The extra delay of a "lost" chunk: the retransmission timeout, `max(200 ms, 2·RTT)`.
    pub fn retransmit_penalty(&self) -> Duration {
        MIN_RTO.max(self.rtt * 2)
    }

    /// Refuses a loss probability outside `[0, 1]`.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.loss) {
            return Err(format!("loss must be a probability in [0, 1], got {}", self.loss));
        }
        Ok(())
    }
}

/// One direction of one connection: turns the times chunks are read into the times they are written.
#[derive(Debug)]
pub(crate) struct Schedule {
    cfg: LinkConfig,
    rng: ChaCha8Rng,
    last: Option<Instant>,
}

impl Schedule {
    pub(crate) fn new(cfg: &LinkConfig, seed: u64) -> Self {
        Self { cfg: *cfg, rng: ChaCha8Rng::seed_from_u64(seed), last: None }
    }

    /// Switches to another link for the chunks read from now on (the proxy's RTT can change between
    /// benchmark runs while connections stay open); chunks already scheduled keep their times.
    pub(crate) fn set_config(&mut self, cfg: &LinkConfig) {
        self.cfg = *cfg;
    }

    /// When a chunk read at `read_at` is due at the other end; never earlier than the previous chunk.
    pub(crate) fn deliver_at(&mut self, read_at: Instant) -> Instant {
        let mut delay = self.cfg.rtt / 2;
        if !self.cfg.jitter.is_zero() {
            delay += self.rng.random_range(Duration::ZERO..=self.cfg.jitter);
        }
        if self.cfg.loss > 0.0 && self.rng.random_bool(self.cfg.loss) {
            delay += self.cfg.retransmit_penalty();
        }
        let at = self.last.map_or(read_at + delay, |last| last.max(read_at + delay));
        self.last = Some(at);
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn config(rtt_ms: u32, jitter_ms: u32, loss: f64) -> LinkConfig {
        LinkConfig { rtt: MS * rtt_ms, jitter: MS * jitter_ms, loss, seed: None }
    }

    #[test]
    fn delay_is_half_the_rtt_plus_bounded_jitter() {
        let mut link = Schedule::new(&config(100, 10, 0.0), 1);
        let start = Instant::now();
        for i in 0..1000 {
            let read_at = start + MS * (i * 20);
            let delay = link.deliver_at(read_at) - read_at;
            assert!(delay >= MS * 50 && delay <= MS * 60, "{delay:?}");
        }
    }

    #[test]
    fn chunks_never_overtake_earlier_ones() {
        let mut link = Schedule::new(&config(10, 50, 0.1), 2);
        let start = Instant::now();
        let times: Vec<Instant> = (0..1000).map(|i| link.deliver_at(start + MS * i)).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn certain_loss_adds_the_retransmission_timeout() {
        assert_eq!(config(20, 0, 1.0).retransmit_penalty(), MIN_RTO);
        assert_eq!(config(300, 0, 1.0).retransmit_penalty(), MS * 600);
        let mut link = Schedule::new(&config(20, 0, 1.0), 3);
        let start = Instant::now();
        assert_eq!(link.deliver_at(start) - start, MS * 210);
    }

    #[test]
    fn a_new_config_applies_to_later_chunks_without_reordering() {
        let mut link = Schedule::new(&config(100, 0, 0.0), 4);
        let start = Instant::now();
        let first = link.deliver_at(start);
        link.set_config(&config(0, 0, 0.0));
        assert_eq!(
            link.deliver_at(start + MS),
            first,
            "a faster link never overtakes the chunk before"
        );
        assert_eq!(link.deliver_at(start + MS * 60), start + MS * 60);
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let cfg = config(40, 30, 0.2);
        let start = Instant::now();
        let run = |seed| {
            let mut link = Schedule::new(&cfg, seed);
            (0..100).map(|i| link.deliver_at(start + MS * i)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn loss_outside_zero_to_one_is_refused() {
        assert!(config(0, 0, 1.5).check().is_err());
        assert!(config(0, 0, f64::NAN).check().is_err());
        assert!(config(0, 0, 0.25).check().is_ok());
    }
}
