//! At most one log line per period for an event that repeats (accept errors, refused
//! connections, Events the API server would not take): the line says how many were left out.

use std::time::Duration;
use tokio::time::Instant;

/// At most one log line per `period` for a repeated event; the line carries how many were not
/// logged since the previous one.
#[derive(Debug)]
pub struct RateLimitedLog {
    period: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    pub fn new(period: Duration) -> Self {
        RateLimitedLog {
            period,
            last: None,
            suppressed: 0,
        }
    }

    /// One more occurrence at `now`: `Some(n)` when a line is due, `n` occurrences having been
    /// suppressed since the previous line.
    pub fn note(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.period => {
                self.suppressed = self.suppressed.saturating_add(1);
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// A [`RateLimitedLog`] that threads and tasks share; `const`, so a `static` can hold it.
#[derive(Debug)]
pub struct SharedRateLimitedLog {
    period: Duration,
    log: std::sync::Mutex<Option<RateLimitedLog>>,
}

impl SharedRateLimitedLog {
    pub const fn new(period: Duration) -> Self {
        SharedRateLimitedLog {
            period,
            log: std::sync::Mutex::new(None),
        }
    }

    /// [`RateLimitedLog::note`] now.
    pub fn note_now(&self) -> Option<u64> {
        let mut log = self.log.lock().ok()?;
        log.get_or_insert_with(|| RateLimitedLog::new(self.period))
            .note(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_errors_logs_one_line_per_period_with_the_count() {
        // The review's numbers: 3.57 million accept errors in 13 s.
        let start = Instant::now();
        let mut log = RateLimitedLog::new(Duration::from_secs(10));
        let total = 3_570_000u64;
        let mut lines = Vec::new();
        for i in 0..total {
            let now = start + Duration::from_nanos(i * 13_000_000_000 / total);
            if let Some(n) = log.note(now) {
                lines.push(n);
            }
        }
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0], 0);
        assert!(lines[1] > 2_000_000, "{lines:?}");
    }
}
