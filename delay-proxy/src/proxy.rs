//! The delay proxy: every accepted connection is relayed to the upstream through an emulated link.
//!
//! Each direction of a connection is a reader and a writer joined by a bounded channel: the reader
//! stamps each chunk with its delivery time ([`crate::link`]) and the writer sleeps until then. The
//! channel holds at most [`QUEUE_CHUNKS`] chunks of at most [`CHUNK_BYTES`], so a slow receiver
//! pushes back on the sender instead of growing memory. An EOF is passed on as a half-close once the
//! data before it has been delivered; an error on either side ends the whole connection.
//!
//! Both halves of a connection run in one task, so nothing outlives the connection, and shutting the
//! proxy down drops (and so closes) every connection still open.
//!
//! The link can be changed while the proxy runs ([`ProxyHandle::set_link`]): readers look at the
//! current link for every chunk, so a benchmark can sweep RTTs over the same kept-alive connections
//! without restarting what sits behind the proxy.

use std::future::Future;
use std::io;
use std::net::SocketAddr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{sleep, sleep_until, Duration, Instant};

use crate::link::{LinkConfig, Schedule};

/// Largest chunk read at once, and so the unit that delay, jitter and loss apply to.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// Chunks in flight per direction before the reader waits for the writer.
pub const QUEUE_CHUNKS: usize = 256;

/// Bytes read from one side and the time they are due at the other.
type Chunk = (Instant, Vec<u8>);

/// Accepts connections on `listener` and relays each to `upstream` through the link `cfg` until
/// `shutdown` resolves; then stops accepting and closes the connections still open.
pub async fn run_proxy(
    listener: TcpListener,
    upstream: String,
    cfg: LinkConfig,
    shutdown: impl Future,
) -> io::Result<()> {
    cfg.check().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // Nobody changes this link: the receivers keep reading its one value after the sender is gone.
    let (_, link) = watch::channel(cfg);
    serve(listener, upstream, link, shutdown).await
}

/// [`run_proxy`] with a link that may change while it runs.
async fn serve(
    listener: TcpListener,
    upstream: String,
    link: watch::Receiver<LinkConfig>,
    shutdown: impl Future,
) -> io::Result<()> {
    let cfg = *link.borrow();
    let seed = cfg.seed.unwrap_or_else(rand::random);
    tracing::info!(addr = %listener.local_addr()?, %upstream, rtt = ?cfg.rtt, jitter = ?cfg.jitter, loss = cfg.loss, seed, "proxying");
    // Connections draw their own seeds from this one, so a run with a seed repeats exactly.
    let mut seeds = ChaCha8Rng::seed_from_u64(seed);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    let now = *link.borrow();
                    let links = (Schedule::new(&now, seeds.random()), Schedule::new(&now, seeds.random()));
                    connections.spawn(connection(client, peer, upstream.clone(), links, link.clone()));
                }
                Err(e) => {
                    // Usually out of file descriptors: wait for some to close rather than spin.
                    tracing::warn!("accept failed: {e}");
                    sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    tracing::info!(open = connections.len(), "proxy shutting down");
    Ok(())
}

/// A proxy started by [`spawn_proxy`]; dropping the handle stops it too.
#[derive(Debug)]
pub struct ProxyHandle {
    addr: SocketAddr,
    link: watch::Sender<LinkConfig>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<io::Result<()>>,
}

impl ProxyHandle {
    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Changes the link for every chunk read from now on, on open connections too.
    pub fn set_link(&self, cfg: LinkConfig) -> io::Result<()> {
        cfg.check().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        self.link.send_replace(cfg);
        Ok(())
    }

    /// The link in force.
    pub fn link(&self) -> LinkConfig {
        *self.link.borrow()
    }

    /// Stops accepting, closes the open connections and waits for the proxy to finish.
    pub async fn shutdown(self) -> io::Result<()> {
        let Self { stop, task, .. } = self;
        drop(stop);
        task.await.map_err(io::Error::other)?
    }
}

/// Starts a proxy on `127.0.0.1` with a free port, relaying to `upstream` (`host:port`).
pub async fn spawn_proxy(upstream: impl Into<String>, cfg: LinkConfig) -> io::Result<ProxyHandle> {
    cfg.check().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let (link, links) = watch::channel(cfg);
    // The sender is only ever dropped: its drop is the signal.
    let task = tokio::spawn(serve(listener, upstream.into(), links, stopped));
    Ok(ProxyHandle { addr, link, stop, task })
}

async fn connection(
    client: TcpStream,
    peer: SocketAddr,
    upstream: String,
    links: (Schedule, Schedule),
    link: watch::Receiver<LinkConfig>,
) {
    match relay(client, &upstream, links, link).await {
        Ok((up, down)) => tracing::debug!(%peer, up, down, "connection closed"),
        Err(e) => tracing::debug!(%peer, "connection ended: {e}"),
    }
}

/// Relays both directions until both have closed; returns the bytes carried up and down.
async fn relay(
    mut client: TcpStream,
    upstream: &str,
    (up, down): (Schedule, Schedule),
    link: watch::Receiver<LinkConfig>,
) -> io::Result<(u64, u64)> {
    let mut server = TcpStream::connect(upstream)
        .await
        .inspect_err(|e| tracing::warn!("cannot connect to {upstream}: {e}"))?;
    // The link sets the timing; Nagle's algorithm would add its own.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (client_read, client_write) = client.split();
    let (server_read, server_write) = server.split();
    tokio::try_join!(
        pipe(client_read, server_write, up, link.clone()),
        pipe(server_read, client_write, down, link)
    )
}

/// One direction: reads chunks, holds each until its delivery time, writes it; passes EOF on as a
/// half-close after the last chunk.
async fn pipe(
    from: impl AsyncRead + Unpin,
    to: impl AsyncWrite + Unpin,
    schedule: Schedule,
    link: watch::Receiver<LinkConfig>,
) -> io::Result<u64> {
    let (tx, rx) = mpsc::channel(QUEUE_CHUNKS);
    let ((), carried) =
        tokio::try_join!(read_chunks(from, tx, schedule, link), write_chunks(rx, to))?;
    Ok(carried)
}

/// Stamps each chunk with its delivery time; returns at EOF, dropping `tx` so the writer drains.
async fn read_chunks(
    mut from: impl AsyncRead + Unpin,
    tx: mpsc::Sender<Chunk>,
    mut schedule: Schedule,
    link: watch::Receiver<LinkConfig>,
) -> io::Result<()> {
    let mut buf = vec![0; CHUNK_BYTES];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        schedule.set_config(&link.borrow());
        let due = schedule.deliver_at(Instant::now());
        if tx.send((due, buf[..n].to_vec())).await.is_err() {
            return Ok(()); // the writer has stopped and reports why
        }
    }
}

/// Writes each chunk when it is due, then half-closes; returns the bytes written.
async fn write_chunks(
    mut rx: mpsc::Receiver<Chunk>,
    mut to: impl AsyncWrite + Unpin,
) -> io::Result<u64> {
    let mut carried = 0;
    while let Some((due, chunk)) = rx.recv().await {
        sleep_until(due).await;
        to.write_all(&chunk).await?;
        carried += chunk.len() as u64;
    }
    to.shutdown().await?;
    Ok(carried)
}
