//! Fault injection for the load test (and the tests): a TCP proxy that can cut every connection
//! through it and refuse new ones.
//!
//! Put in front of PostgreSQL it is a database outage exactly as a worker sees one (connections
//! reset, new ones refused) without stopping a server others may share; put in front of the
//! Pub/Sub emulator it drops every streaming pull at once, like a network blip or a server
//! restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A loopback TCP proxy with an off switch. Dropping it stops it.
#[derive(Debug)]
pub struct Proxy {
    addr: String,
    up: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `upstream` (host:port).
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let up = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let (up2, conns2) = (up.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if !up2.load(Ordering::SeqCst) {
                    drop(client); // refused: the peer sees a reset
                    continue;
                }
                let upstream = upstream.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
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
            conns,
            accept,
        })
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

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.drop_connections();
    }
}
