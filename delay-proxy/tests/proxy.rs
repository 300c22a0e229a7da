//! The delay proxy over real TCP on 127.0.0.1, in front of an echo server.

use std::net::SocketAddr;
use std::time::Duration;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use spade_delay_proxy::{spawn_proxy, LinkConfig, ProxyHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

const MS: Duration = Duration::from_millis(1);

/// An echo server: writes back what it reads, and half-closes when the client does.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                if tokio::io::copy(&mut r, &mut w).await.is_ok() {
                    let _ = w.shutdown().await;
                }
            });
        }
    });
    addr
}

async fn proxy_to_echo(cfg: LinkConfig) -> ProxyHandle {
    spawn_proxy(echo_server().await.to_string(), cfg).await.unwrap()
}

async fn connect(proxy: &ProxyHandle) -> TcpStream {
    TcpStream::connect(proxy.addr()).await.unwrap()
}

/// Reads until EOF, which must come within two seconds.
async fn read_to_eof(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut got = Vec::new();
    timeout(Duration::from_secs(2), stream.read_to_end(&mut got))
        .await
        .expect("no EOF within 2 s")?;
    Ok(got)
}

/// Sends a 4-byte request and times until its echo is back.
async fn round_trip(stream: &mut TcpStream) -> Duration {
    let start = Instant::now();
    stream.write_all(b"ping").await.unwrap();
    let mut reply = [0; 4];
    stream.read_exact(&mut reply).await.unwrap();
    assert_eq!(&reply, b"ping");
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transfer_arrives_intact_and_in_order_both_ways() {
    let cfg = LinkConfig { rtt: MS * 10, jitter: MS * 20, loss: 0.0, seed: Some(1) };
    let proxy = proxy_to_echo(cfg).await;
    let mut data = vec![0; 8 << 20];
    ChaCha8Rng::seed_from_u64(2).fill_bytes(&mut data);

    let stream = connect(&proxy).await;
    let (mut r, mut w) = stream.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&sent).await.unwrap();
        w.shutdown().await.unwrap();
    });
    let mut echoed = Vec::with_capacity(data.len());
    timeout(Duration::from_secs(5), r.read_to_end(&mut echoed)).await.unwrap().unwrap();
    writer.await.unwrap();
    assert!(echoed == data, "echo differs: {} bytes back of {}", echoed.len(), data.len());
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_round_trip_takes_one_rtt() {
    let proxy = proxy_to_echo(LinkConfig::with_rtt(MS * 100)).await;
    let mut stream = connect(&proxy).await;
    for _ in 0..3 {
        let took = round_trip(&mut stream).await;
        assert!(took >= MS * 100 && took < MS * 180, "{took:?}");
    }
}

#[tokio::test]
async fn a_new_rtt_applies_to_an_open_connection() {
    let proxy = proxy_to_echo(LinkConfig::default()).await;
    let mut stream = connect(&proxy).await;
    assert!(round_trip(&mut stream).await < MS * 50);
    proxy.set_link(LinkConfig::with_rtt(MS * 100)).unwrap();
    assert_eq!(proxy.link().rtt, MS * 100);
    let took = round_trip(&mut stream).await;
    assert!(took >= MS * 100 && took < MS * 180, "{took:?}");
    assert!(proxy.set_link(LinkConfig { loss: -1.0, ..LinkConfig::default() }).is_err());
}

#[tokio::test]
async fn without_delay_a_round_trip_is_fast() {
    let proxy = proxy_to_echo(LinkConfig::default()).await;
    let mut stream = connect(&proxy).await;
    let mut total = Duration::ZERO;
    for _ in 0..10 {
        total += round_trip(&mut stream).await;
    }
    assert!(total < MS * 100, "10 round trips took {total:?}");
}

#[tokio::test]
async fn certain_loss_adds_the_retransmission_timeout_each_way() {
    let cfg = LinkConfig { rtt: MS * 20, loss: 1.0, ..LinkConfig::default() };
    let proxy = proxy_to_echo(cfg).await;
    let mut stream = connect(&proxy).await;
    let took = round_trip(&mut stream).await;
    // 20 ms of RTT plus 200 ms (the minimum RTO) in each direction.
    assert!(took >= MS * 420 && took < MS * 600, "{took:?}");
}

#[tokio::test]
async fn a_client_half_close_reaches_the_server_after_the_data() {
    let proxy = proxy_to_echo(LinkConfig::with_rtt(MS * 20)).await;
    let mut stream = connect(&proxy).await;
    stream.write_all(b"last words").await.unwrap();
    stream.shutdown().await.unwrap();
    // The echo server only half-closes once it sees EOF, so reaching the end proves both ways.
    assert_eq!(read_to_eof(&mut stream).await.unwrap(), b"last words");
}

#[tokio::test]
async fn a_server_close_reaches_the_client_after_the_data() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        stream.write_all(b"bye").await.unwrap();
    });
    let proxy = spawn_proxy(upstream, LinkConfig::with_rtt(MS * 20)).await.unwrap();
    let mut stream = connect(&proxy).await;
    assert_eq!(read_to_eof(&mut stream).await.unwrap(), b"bye");
}

#[tokio::test]
async fn an_unreachable_upstream_closes_the_client() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = closed.local_addr().unwrap().to_string();
    drop(closed);
    let proxy = spawn_proxy(upstream, LinkConfig::default()).await.unwrap();
    let mut stream = connect(&proxy).await;
    // Closed or reset, but never data.
    let read = read_to_eof(&mut stream).await;
    assert!(read.as_ref().map_or(true, Vec::is_empty), "{read:?}");
}

#[tokio::test]
async fn shutdown_stops_listening() {
    let proxy = proxy_to_echo(LinkConfig::default()).await;
    let addr = proxy.addr();
    proxy.shutdown().await.unwrap();
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn an_impossible_loss_is_refused() {
    let cfg = LinkConfig { loss: 2.0, ..LinkConfig::default() };
    let err = spawn_proxy("127.0.0.1:1", cfg).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}
