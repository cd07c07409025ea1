//! Named background tasks. Each runs inside a `tracing` span `task{name=…}`, so every line it
//! logs (and every line logged by what it calls) says which task it came from; a failure is
//! logged with its whole error chain ([`DisplayChain`]).

use std::error::Error;
use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::DisplayChain;

/// The span a task named `name` runs in. For work that cannot be a tokio task (a blocking
/// thread): enter it there.
#[must_use]
pub fn task_span(name: &'static str) -> tracing::Span {
    tracing::info_span!("task", name = %name)
}

/// Runs blocking `work` (file walks, `NVML`) on tokio's blocking pool inside the caller's span:
/// blocking threads do not inherit it, and what `work` logs should still say which task it
/// belongs to.
pub fn spawn_blocking_in_span<T, F>(work: F) -> JoinHandle<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(work))
}

/// What a task or one run of a periodic task returns: `()` (cannot fail) or `Result<(), E>`.
pub trait TaskOutcome {
    /// The error, when this run failed.
    fn failure(&self) -> Option<&(dyn Error + 'static)>;
}

impl TaskOutcome for () {
    fn failure(&self) -> Option<&(dyn Error + 'static)> {
        None
    }
}

impl<E: Error + 'static> TaskOutcome for Result<(), E> {
    fn failure(&self) -> Option<&(dyn Error + 'static)> {
        self.as_ref().err().map(|e| e as &(dyn Error + 'static))
    }
}

/// Spawns `task` inside [`task_span`]`(name)`. A task that ends with an error is logged at
/// `error` with the chain. The future decides itself when to stop (e.g. a server's graceful
/// shutdown); a task with no notion of shutdown can be wrapped in
/// [`CancellationToken::run_until_cancelled`].
pub fn spawn_task<F>(name: &'static str, task: F) -> JoinHandle<()>
where
    F: Future + Send + 'static,
    F::Output: TaskOutcome,
{
    tokio::spawn(
        async move {
            let outcome = task.await;
            match outcome.failure() {
                Some(e) => tracing::error!(error = %DisplayChain(e), "task failed"),
                None => tracing::debug!("task finished"),
            }
        }
        .instrument(task_span(name)),
    )
}

/// When a periodic task runs: every `period` after the previous run *ended* (a slow run never
/// piles up), the first run at once unless [`Schedule::first_after`] delays it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    period: Duration,
    first_delay: Duration,
}

impl Schedule {
    /// First run at once, then `period` after each run.
    #[must_use]
    pub const fn every(period: Duration) -> Self {
        Schedule {
            period,
            first_delay: Duration::ZERO,
        }
    }

    /// First run only after `delay`.
    #[must_use]
    pub const fn first_after(mut self, delay: Duration) -> Self {
        self.first_delay = delay;
        self
    }

    #[must_use]
    pub const fn period(&self) -> Duration {
        self.period
    }
}

impl From<Duration> for Schedule {
    fn from(period: Duration) -> Self {
        Schedule::every(period)
    }
}

/// Runs `run` on `schedule` inside [`task_span`]`(name)` until `shutdown` is cancelled (a run in
/// progress is dropped at that point). A failed run is logged at `warn` with its chain and the
/// task carries on: the next run is the retry.
pub fn spawn_periodic<F, Fut>(
    name: &'static str,
    schedule: impl Into<Schedule>,
    shutdown: CancellationToken,
    mut run: F,
) -> JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future + Send,
    Fut::Output: TaskOutcome,
{
    let schedule = schedule.into();
    spawn_task(name, async move {
        let mut wait = schedule.first_delay;
        loop {
            let ran = shutdown
                .run_until_cancelled(async {
                    tokio::time::sleep(wait).await;
                    run().await
                })
                .await;
            let Some(outcome) = ran else {
                tracing::debug!("stopping: shutdown");
                return;
            };
            if let Some(e) = outcome.failure() {
                tracing::warn!(error = %DisplayChain(e), period = ?schedule.period, "run failed; next run is the retry");
            }
            wait = schedule.period;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::time::Instant;

    /// Log lines of the current thread (the paused-clock tests run on one thread).
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn install(&self) -> tracing::subscriber::DefaultGuard {
            let writer = self.clone();
            tracing::subscriber::set_default(
                tracing_subscriber::fmt()
                    .with_writer(move || writer.clone())
                    .with_ansi(false)
                    .with_max_level(tracing::Level::DEBUG)
                    .finish(),
            )
        }
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("cannot list pods")]
    struct ListError(#[source] std::io::Error);

    #[tokio::test(start_paused = true)]
    async fn periodic_runs_at_once_then_every_period_until_shutdown() {
        let started = Instant::now();
        let runs = Arc::new(Mutex::new(Vec::new()));
        let shutdown = CancellationToken::new();
        let seen = runs.clone();
        let task = spawn_periodic(
            "ticker",
            Duration::from_secs(15),
            shutdown.clone(),
            move || {
                let seen = seen.clone();
                async move {
                    seen.lock().expect("lock").push(started.elapsed());
                    // A run that takes time: the next one starts a period after it ends.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
        );
        tokio::time::sleep(Duration::from_secs(40)).await;
        shutdown.cancel();
        task.await.expect("no panic");
        assert_eq!(
            *runs.lock().expect("lock"),
            [0, 16, 32].map(Duration::from_secs)
        );
        // Nothing runs after shutdown.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(runs.lock().expect("lock").len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn first_run_can_wait_one_period() {
        let started = Instant::now();
        let runs = Arc::new(Mutex::new(Vec::new()));
        let shutdown = CancellationToken::new();
        let seen = runs.clone();
        let period = Duration::from_secs(30);
        let task = spawn_periodic(
            "gc",
            Schedule::every(period).first_after(period),
            shutdown.clone(),
            move || {
                let seen = seen.clone();
                async move { seen.lock().expect("lock").push(started.elapsed()) }
            },
        );
        tokio::time::sleep(Duration::from_secs(29)).await;
        assert!(runs.lock().expect("lock").is_empty());
        tokio::time::sleep(Duration::from_secs(32)).await;
        shutdown.cancel();
        task.await.expect("no panic");
        assert_eq!(
            *runs.lock().expect("lock"),
            [30, 60].map(Duration::from_secs)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_run_is_logged_with_its_chain_in_the_task_span_and_retried() {
        let logs = Captured::default();
        let _guard = logs.install();
        let runs = Arc::new(Mutex::new(0u32));
        let shutdown = CancellationToken::new();
        let count = runs.clone();
        let task = spawn_periodic(
            "pod-list",
            Duration::from_secs(5),
            shutdown.clone(),
            move || {
                let count = count.clone();
                async move {
                    *count.lock().expect("lock") += 1;
                    Err(ListError(std::io::Error::other("connection refused")))
                }
            },
        );
        tokio::time::sleep(Duration::from_secs(6)).await;
        shutdown.cancel();
        task.await.expect("no panic");
        assert_eq!(*runs.lock().expect("lock"), 2, "the failure is retried");
        let text = logs.text();
        let failures: Vec<&str> = text.lines().filter(|l| l.contains("run failed")).collect();
        assert_eq!(failures.len(), 2, "{text}");
        assert!(
            failures[0].contains("task{name=pod-list}")
                && failures[0].contains("cannot list pods: connection refused"),
            "{text}"
        );
        assert!(text.contains("stopping: shutdown"), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_drops_a_run_in_progress() {
        let shutdown = CancellationToken::new();
        let task = spawn_periodic("hangs", Duration::from_secs(1), shutdown.clone(), || {
            std::future::pending::<()>()
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("stops at once")
            .expect("no panic");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_task_is_logged_at_error_with_its_chain() {
        let logs = Captured::default();
        let _guard = logs.install();
        spawn_task("watch", async {
            Err(ListError(std::io::Error::other("stream closed")))
        })
        .await
        .expect("no panic");
        spawn_task("fine", async {}).await.expect("no panic");
        let text = logs.text();
        assert!(
            text.lines().any(|l| l.contains("ERROR")
                && l.contains("task{name=watch}")
                && l.contains("cannot list pods: stream closed")),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.contains("task{name=fine}") && l.contains("task finished")),
            "{text}"
        );
    }
}
