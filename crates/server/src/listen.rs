//! Connections as a bounded resource (hyper's HTTP/1 server under the axum router).
//!
//! - At most `--max-connections` are open at once. At the cap a newcomer first takes the
//!   place of the connection that has been open longest without a request in progress
//!   (idle, or still sending its head), which is closed; only when every open connection
//!   is serving a request is the newcomer *shed*: answered `503` with `Retry-After` and
//!   closed at once. Both are counted in `/metrics` and logged (the first time, then every
//!   1000th). So a flood of idle sockets cannot lock other clients out, nor take the file
//!   descriptors the server needs: the cap is checked at start-up against the open-file
//!   limit (raised to its hard limit) with [`FD_RESERVE`] kept
//!   for the model, the caches and the engine.
//! - A connection that has not sent a whole request head within `--header-timeout` — one
//!   that sends nothing, part of its headers, or stays idle between requests — is closed
//!   (hyper's header-read timer, armed whenever a connection waits for a head). A body
//!   slower than `--body-timeout` is a 408 ([`crate::intake`]).
//! - A connection whose answer makes no progress for `--send-timeout` — a client that
//!   stopped reading, its socket buffers full — is closed, and its request cancelled
//!   ([`SendDeadline`]): a reader that stalls cannot hold a place for ever.
//! - On shutdown the listener closes, every connection is told to finish its current
//!   response and close, and [`Connections::drained`] says when none is left; the caller
//!   bounds that wait by `--shutdown-timeout` (half-open connections are dropped with the
//!   runtime after it).
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{ensure, Result};
use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tower::ServiceExt;

use crate::error::ApiError;
use crate::flags::FD_RESERVE;
use crate::metrics::Metrics;

/// How long an evicted connection may take to answer a request that raced its eviction.
const EVICTION_GRACE: Duration = Duration::from_millis(250);

/// The table, even if a task panicked while holding it (it holds no invariant a panic
/// could break halfway).
fn lock(t: &Mutex<Table>) -> MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What bounds a connection.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at most.
    pub max_connections: usize,
    /// Time to send a request head, or to stay idle between requests.
    pub header_timeout: Duration,
    /// Time a write to the client may make no progress.
    pub send_timeout: Duration,
}

/// A socket whose writes fail once they have made no progress for `limit` (the client
/// stopped reading); reads pass through.
pub struct SendDeadline<T> {
    io: T,
    limit: Duration,
    /// Armed while a write waits.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> SendDeadline<T> {
    /// `io` with writes bounded by `limit`.
    pub fn new(io: T, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stalled: None,
        }
    }

    /// After a write came back pending: an error once it has waited `limit`.
    fn waited(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        sleep.as_mut().poll(cx).map(|()| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing of its answer for --send-timeout",
            )
        })
    }

    /// A write's outcome: progress disarms the timer; waiting arms it.
    fn progress<R>(&mut self, cx: &mut Context<'_>, p: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match p {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.waited(cx).map(Err),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let p = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progress(cx, p)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let p = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progress(cx, p)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let p = Pin::new(&mut self.io).poll_flush(cx);
        self.progress(cx, p)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Raises the open-file limit to its hard limit and checks that `max_connections` fit in it
/// with [`FD_RESERVE`] to spare.
pub fn fit_open_files(max_connections: usize) -> Result<()> {
    #[cfg(unix)]
    {
        let (soft, hard) = rlimit::Resource::NOFILE.get()?;
        let limit = if soft < hard {
            // Servers raise it for their connections (nginx's worker_rlimit_nofile).
            rlimit::Resource::NOFILE
                .set(hard, hard)
                .map_or(soft, |()| hard)
        } else {
            soft
        };
        ensure!(
            (max_connections as u64).saturating_add(FD_RESERVE) <= limit,
            "--max-connections {max_connections}: the open-file limit is {limit} (`ulimit -n`) and {FD_RESERVE} are kept for the model, the caches and the engine; give at most {} or raise the limit",
            limit.saturating_sub(FD_RESERVE)
        );
    }
    Ok(())
}

/// Why `--host`/`--port` could not be listened on (`e`, from binding `addr`), as one line
/// that names the fix.
pub fn bind_error(addr: std::net::SocketAddr, e: &io::Error) -> String {
    let port = addr.port();
    let fix = match e.kind() {
        io::ErrorKind::AddrInUse => format!(
            "port {port} is already taken (another kvpolicy-server?); stop what listens there (`ss -ltnp 'sport = :{port}'` names it), or choose another port with --port N (--port 0 picks a free one)"
        ),
        io::ErrorKind::PermissionDenied if port < 1024 => format!(
            "port {port} is below 1024 and needs privileges; choose --port 1024 or above (e.g. --port 8080)"
        ),
        io::ErrorKind::AddrNotAvailable => format!(
            "{} is not an address of this machine; give one of its addresses with --host (127.0.0.1: this machine only, 0.0.0.0: every interface)",
            addr.ip()
        ),
        _ => "check --host and --port, or choose another port with --port N".to_string(),
    };
    format!("cannot listen on {addr}: {e}; {fix}")
}

/// An open connection as the accept loop sees it.
struct Open {
    /// Requests in progress on it (their responses included).
    busy: Arc<AtomicUsize>,
    /// Closes it at once.
    close: Arc<Notify>,
    /// Its place among `--max-connections`: handed to the newcomer that evicts it.
    place: OwnedSemaphorePermit,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Open>,
}

impl Table {
    /// Closes the oldest connection with no request in progress; its place, if there was
    /// one (the evicted connection's last moments no longer count against the cap).
    fn evict_idle(&mut self) -> Option<OwnedSemaphorePermit> {
        // Marked evicted only while no request is in progress: one that begins after
        // this is answered 503 (see `Busy::start`), none is cut off.
        let idle = self
            .open
            .iter()
            .find(|(_, c)| {
                c.busy
                    .compare_exchange(0, EVICTED, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            })
            .map(|(&id, _)| id);
        let c = self.open.remove(&idle?)?;
        c.close.notify_one();
        Some(c.place)
    }
}

/// A connection's request count once it has been evicted: no request may start.
const EVICTED: usize = usize::MAX;

/// Counts a request in progress on its connection until dropped (with its response body).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    /// A request begins; `None` when its connection was evicted just before.
    fn start(count: &Arc<AtomicUsize>) -> Option<Self> {
        count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n != EVICTED).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(count.clone()))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Logs the first of a kind of event, then every 1000th.
fn every_thousandth(n: u64) -> bool {
    n == 1 || n.is_multiple_of(1000)
}

/// The open connections, and the way to tell them to close.
pub struct Connections {
    slots: Arc<Semaphore>,
    max: u32,
    stop: watch::Sender<bool>,
}

impl Connections {
    /// Tells every connection to finish its current response and close.
    pub fn close_all(&self) {
        let _ = self.stop.send(true);
    }

    /// Resolves once no connection is open.
    pub async fn drained(&self) {
        let _ = self.slots.acquire_many(self.max).await;
    }
}

/// Accepts connections on `listener` for `app` until `until` resolves; then the listener
/// closes. The returned [`Connections`] outlive the accept loop.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    until: impl std::future::Future<Output = ()>,
) -> Connections {
    let max = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let slots = Arc::new(Semaphore::new(max as usize));
    let (stop, stopping) = watch::channel(false);
    let table = Arc::new(Mutex::new(Table::default()));
    let mut accept_errors = 0u64;
    tokio::pin!(until);
    loop {
        let accepted = tokio::select! {
            () = &mut until => break,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors (another process's share, a lower limit than checked):
                // wait a little instead of spinning on the same error.
                accept_errors += 1;
                if every_thousandth(accept_errors) {
                    eprintln!("accepting a connection failed ({accept_errors} times so far): {e}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                let place = lock(&table).evict_idle();
                if place.is_some() {
                    let evicted = metrics.connections_evicted.inc() + 1;
                    if every_thousandth(evicted) {
                        eprintln!(
                            "{} connections open (--max-connections): the longest idle ones are closed for newcomers ({evicted} so far)",
                            limits.max_connections
                        );
                    }
                }
                place
            }
        };
        let Some(permit) = permit else {
            let shed_count = metrics.connections_shed.inc() + 1;
            if every_thousandth(shed_count) {
                eprintln!(
                    "{} connections open (--max-connections), every one serving a request: new ones are answered 503 and closed ({shed_count} so far)",
                    limits.max_connections
                );
            }
            shed(stream);
            continue;
        };
        let open = Open {
            busy: Arc::new(AtomicUsize::new(0)),
            close: Arc::new(Notify::new()),
            place: permit,
        };
        let (busy, close) = (open.busy.clone(), open.close.clone());
        let id = {
            let mut t = lock(&table);
            let id = t.next;
            t.next += 1;
            t.open.insert(id, open);
            id
        };
        let (app, metrics, table) = (app.clone(), metrics.clone(), table.clone());
        let stopping = stopping.clone();
        let limits = limits.clone();
        tokio::spawn(async move {
            metrics.connections.inc();
            connection(
                stream,
                app,
                &limits,
                Control {
                    stopping,
                    close,
                    busy,
                },
            )
            .await;
            metrics.connections.dec();
            // Its place back (unless an eviction handed it on already).
            lock(&table).open.remove(&id);
        });
    }
    Connections { slots, max, stop }
}

/// How a connection is told to end.
struct Control {
    /// Becomes true at shutdown: finish the current response, then close.
    stopping: watch::Receiver<bool>,
    /// Close now (evicted for a newcomer).
    close: Arc<Notify>,
    /// Requests in progress.
    busy: Arc<AtomicUsize>,
}

/// One connection, served until it closes, is evicted, or is told to stop (then it
/// finishes its response).
async fn connection(stream: TcpStream, app: Router, limits: &Limits, mut c: Control) {
    let _ = stream.set_nodelay(true);
    let busy = c.busy.clone();
    let service = hyper::service::service_fn(move |req: axum::http::Request<Incoming>| {
        let working = Busy::start(&busy);
        let app = app.clone();
        async move {
            let Some(working) = working else {
                // Evicted for a newcomer between requests: closed after this answer.
                let mut e = ApiError::status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "this idle connection was closed for another client; retry on a new one",
                );
                e.retry_after = Some(1);
                let mut r = e.into_response();
                r.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return Ok(r);
            };
            let response = app.oneshot(req.map(Body::new)).await?;
            // The count ends with the response's body (a stream may run long after).
            Ok::<_, Infallible>(response.map(|b| {
                Body::new(b.map_err(move |e| {
                    let _ = &working;
                    e
                }))
            }))
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let io = SendDeadline::new(stream, limits.send_timeout);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        () = c.close.notified() => {
            // Evicted: a request that raced the eviction gets its 503, then it closes.
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(EVICTION_GRACE, conn).await;
            return;
        }
        () = stop_asked(&mut c.stopping) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// Resolves once shutdown is asked for.
async fn stop_asked(stopping: &mut watch::Receiver<bool>) {
    let _ = stopping.wait_for(|s| *s).await;
}

/// A connection past the cap: a 503 written if the socket takes it now, then closed.
fn shed(stream: TcpStream) {
    const BODY: &str = r#"{"error":{"message":"too many connections; retry shortly","type":"server_error","param":null,"code":"503"}}"#;
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = stream.try_write(reply.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Each way of failing to listen names its fix (a port in use is run for real in
    /// `tests/startup.rs`; the others need privileges or addresses a test cannot count on).
    #[test]
    fn bind_errors_name_the_fix() -> anyhow::Result<()> {
        let e = |k| io::Error::from(k);
        let m = bind_error("127.0.0.1:8080".parse()?, &e(io::ErrorKind::AddrInUse));
        assert!(m.starts_with("cannot listen on 127.0.0.1:8080: "), "{m}");
        assert!(m.contains("port 8080 is already taken"), "{m}");
        assert!(m.contains("choose another port with --port N"), "{m}");
        let m = bind_error("0.0.0.0:80".parse()?, &e(io::ErrorKind::PermissionDenied));
        assert!(m.contains("choose --port 1024 or above"), "{m}");
        let m = bind_error(
            "10.9.9.9:8080".parse()?,
            &e(io::ErrorKind::AddrNotAvailable),
        );
        assert!(
            m.contains("10.9.9.9 is not an address of this machine"),
            "{m}"
        );
        assert!(m.contains("--host"), "{m}");
        assert!(!m.contains('\n'), "{m}");
        Ok(())
    }

    /// A peer that reads nothing: the write fails once it has waited the limit. A peer
    /// that reads slowly, but within the limit each time, gets everything.
    #[tokio::test(start_paused = true)]
    async fn a_write_that_makes_no_progress_fails_after_the_limit() -> anyhow::Result<()> {
        let limit = Duration::from_secs(5);
        let (ours, _silent) = tokio::io::duplex(64);
        let stalled = SendDeadline::new(ours, limit).write_all(&[7u8; 1024]).await;
        let e = stalled
            .err()
            .ok_or_else(|| anyhow::anyhow!("the write went through"))?;
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);

        let (ours, mut theirs) = tokio::io::duplex(64);
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 64];
            while got < 1024 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                got += theirs.read(&mut buf).await?;
            }
            anyhow::Ok(got)
        });
        SendDeadline::new(ours, limit)
            .write_all(&[7u8; 1024])
            .await?;
        assert_eq!(reader.await??, 1024);
        Ok(())
    }
}
