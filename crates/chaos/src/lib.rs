//! Fault injection for spotinfer's load test and tests: a TCP proxy that can cut every connection
//! through it and refuse new ones.
//!
//! Put in front of PostgreSQL it is a database outage exactly as a worker sees one (connections
//! reset, new ones refused) without stopping a server others may share; put in front of the
//! Pub/Sub emulator it drops every streaming pull at once, like a network blip or a server
//! restart. It can also add latency to every chunk it forwards: a server that answers slowly.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A loopback TCP proxy with an off switch. Dropping it stops it.
#[derive(Debug)]
pub struct Proxy {
    addr: String,
    up: Arc<AtomicBool>,
    latency_us: Arc<AtomicU64>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `upstream` (host:port).
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let up = Arc::new(AtomicBool::new(true));
        let latency_us = Arc::new(AtomicU64::new(0));
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let (up2, conns2, latency2) = (up.clone(), conns.clone(), latency_us.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    // Out of descriptors, say: wait instead of spinning on the error.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                if !up2.load(Ordering::SeqCst) {
                    drop(client); // refused: the peer sees a reset
                    continue;
                }
                let upstream = upstream.clone();
                let latency = latency2.clone();
                let task = tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, latency.clone()) => {},
                        _ = pump(sr, cw, latency) => {},
                    }
                });
                if let Ok(mut c) = conns2.lock() {
                    c.retain(|h| !h.is_finished());
                    c.push(task.abort_handle());
                }
            }
        })
        .abort_handle();
        Ok(Self {
            addr,
            up,
            latency_us,
            conns,
            accept,
        })
    }

    /// Delays every chunk forwarded in either direction by `latency` (zero: none).
    pub fn set_latency(&self, latency: Duration) {
        self.latency_us
            .store(latency.as_micros() as u64, Ordering::SeqCst);
    }

    /// host:port to connect to instead of the upstream.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Cuts every open connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.drop_connections();
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    /// Cuts every open connection but keeps accepting new ones (clients reconnect at once).
    pub fn drop_connections(&self) {
        if let Ok(mut c) = self.conns.lock() {
            for h in c.drain(..) {
                h.abort();
            }
        }
    }
}

/// Copies `from` to `to`, sleeping the current latency before each chunk. Not
/// `tokio::io::copy_bidirectional`: that one cannot delay each chunk, and the latency can change
/// while a connection is open.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency_us: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = latency_us.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.drop_connections();
    }
}
