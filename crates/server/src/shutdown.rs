//! The signals that stop the server: SIGTERM, SIGHUP (its terminal gone) and Ctrl-C (SIGINT)
//! alike. The first starts the graceful shutdown; a second, of any of them, ends it at once.
use tokio::sync::mpsc;

/// The stop signals as they arrive.
pub struct Signals {
    rx: mpsc::UnboundedReceiver<&'static str>,
}

impl Signals {
    /// Listens for the stop signals from now on (inside a Tokio runtime).
    pub fn listen() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            for (kind, name) in [
                (SignalKind::terminate(), "SIGTERM"),
                (SignalKind::hangup(), "SIGHUP"),
                (SignalKind::interrupt(), "SIGINT"),
            ] {
                let mut s = signal(kind)?;
                let tx = tx.clone();
                tokio::spawn(async move {
                    while s.recv().await.is_some() {
                        if tx.send(name).is_err() {
                            break;
                        }
                    }
                });
            }
        }
        #[cfg(not(unix))]
        {
            tokio::spawn(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    if tx.send("Ctrl-C").is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self { rx })
    }

    /// The next stop signal's name (never resolves if none can come).
    pub async fn next(&mut self) -> &'static str {
        match self.rx.recv().await {
            Some(name) => name,
            None => std::future::pending().await,
        }
    }
}
