//! SIGTERM (the kubelet stopping a pod) and SIGINT (a terminal) as one shutdown signal.

use std::fmt;

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Which signal asked the daemon to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownSignal {
    Terminate,
    Interrupt,
}

impl fmt::Display for ShutdownSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ShutdownSignal::Terminate => "SIGTERM",
            ShutdownSignal::Interrupt => "SIGINT",
        })
    }
}

/// Both handlers, installed at once so that a signal arriving before the first `await` is not
/// lost (and does not kill the process with the default action).
struct Handlers {
    term: Signal,
    int: Signal,
}

impl Handlers {
    fn install() -> std::io::Result<Self> {
        Ok(Handlers {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn first(mut self) -> ShutdownSignal {
        tokio::select! {
            _ = self.term.recv() => ShutdownSignal::Terminate,
            _ = self.int.recv() => ShutdownSignal::Interrupt,
        }
    }
}

/// Waits for SIGTERM or SIGINT. Errors only when the handlers cannot be installed. Must be
/// called inside a tokio runtime.
pub async fn wait_for_shutdown_signal() -> std::io::Result<ShutdownSignal> {
    Ok(Handlers::install()?.first().await)
}

/// A token cancelled on the first SIGTERM or SIGINT; see [`cancel_on_signals`].
pub fn shutdown_on_signals() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    cancel_on_signals(&token)?;
    Ok(token)
}

/// Cancels `token` on the first SIGTERM or SIGINT (logged as `SIGTERM: shutting down`), for a
/// token that already exists (work started before the handlers). The handlers are installed
/// before this returns; a task named `signals` waits for them. Must be called inside a tokio
/// runtime.
pub fn cancel_on_signals(token: &CancellationToken) -> std::io::Result<()> {
    let handlers = Handlers::install()?;
    let cancel = token.clone();
    crate::task::spawn_task("signals", async move {
        let which = handlers.first().await;
        tracing::info!("{which}: shutting down");
        cancel.cancel();
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn sigterm_cancels_the_token() {
        let token = shutdown_on_signals().expect("handlers");
        assert!(!token.is_cancelled());
        // With the handler installed, SIGTERM only wakes it; the test process lives on.
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).expect("raise");
        tokio::time::timeout(Duration::from_secs(10), token.cancelled())
            .await
            .expect("cancelled on SIGTERM");
    }

    #[test]
    fn signal_names_as_logged() {
        assert_eq!(ShutdownSignal::Terminate.to_string(), "SIGTERM");
        assert_eq!(ShutdownSignal::Interrupt.to_string(), "SIGINT");
    }
}
