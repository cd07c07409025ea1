//! The node handshake annotation `hami.io/node-handshake` (contract §2.3).
//!
//! v2.10: only the scheduler writes `Requesting_<Go DateTime>`; older plugins wrote
//! `Reported <Go time.String()>` and older schedulers `Deleted_<DateTime>`.

use std::fmt;

use jiff::SignedDuration;
use jiff::civil::DateTime;

/// How long a `Requesting_` value stays fresh before the allocatable check decides (seconds).
pub const REQUESTING_TIMEOUT_SECS: i64 = 60;

/// A parsed handshake value. The payload is the time text exactly as written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Handshake {
    /// Contains `Requesting` (HAMi's test): the text after the first `_` (empty if none).
    Requesting(String),
    /// `Reported <time>` (≤ v2.7 device plugins): the text after `Reported` and one space.
    Reported(String),
    /// Contains `Deleted` (v2.8–v2.9 schedulers): the text after the first `_`.
    Deleted(String),
    /// Anything else, as written (absent annotations are the caller's `None`).
    Other(String),
}

fn after_first_underscore(v: &str) -> String {
    v.split_once('_')
        .map(|(_, t)| t.to_owned())
        .unwrap_or_default()
}

impl Handshake {
    /// Classifies a value the way HAMi's scheduler does: `Requesting` anywhere wins, then
    /// `Deleted` anywhere, then a `Reported` prefix.
    pub fn parse(v: &str) -> Self {
        if v.contains("Requesting") {
            Handshake::Requesting(after_first_underscore(v))
        } else if v.contains("Deleted") {
            Handshake::Deleted(after_first_underscore(v))
        } else if let Some(rest) = v.strip_prefix("Reported") {
            Handshake::Reported(rest.strip_prefix(' ').unwrap_or(rest).to_owned())
        } else {
            Handshake::Other(v.to_owned())
        }
    }

    /// The value the scheduler writes: `Requesting_<datetime>`, where `datetime` is Go
    /// `time.DateTime` (`2006-01-02 15:04:05`, local time, see [`format_go_datetime`]).
    pub fn requesting(datetime: &str) -> String {
        format!("Requesting_{datetime}")
    }

    /// The annotation value for this handshake (inverse of [`Handshake::parse`] for values HAMi
    /// writes).
    pub fn encode(&self) -> String {
        self.to_string()
    }

    /// For `Requesting`: true when the request is older than [`REQUESTING_TIMEOUT_SECS`] at
    /// `now` (both as [`parse_go_datetime`] seconds, same time zone). An unparsable time is
    /// never expired (HAMi: "healthy, no update"). `None` for other variants.
    pub fn requesting_expired(&self, now: i64) -> Option<bool> {
        match self {
            Handshake::Requesting(t) => Some(
                parse_go_datetime(t)
                    .is_some_and(|at| now >= at.saturating_add(REQUESTING_TIMEOUT_SECS)),
            ),
            _ => None,
        }
    }
}

impl fmt::Display for Handshake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Handshake::Requesting(t) => write!(f, "Requesting_{t}"),
            Handshake::Reported(t) => write!(f, "Reported {t}"),
            Handshake::Deleted(t) => write!(f, "Deleted_{t}"),
            Handshake::Other(v) => f.write_str(v),
        }
    }
}

/// The epoch the wall-clock seconds count from.
const EPOCH: DateTime = DateTime::constant(1970, 1, 1, 0, 0, 0, 0);

/// Parses Go's `time.DateTime` layout `2006-01-02 15:04:05` exactly (4-digit year, 2-digit
/// fields, real calendar dates) into seconds since 1970-01-01 00:00:00 *of the same wall clock*:
/// the text carries no zone, so the caller compares it with a "now" taken in the writer's zone.
pub fn parse_go_datetime(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() != 19
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b' '
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |range: std::ops::Range<usize>| -> Option<u32> {
        let s = text.get(range)?;
        if s.bytes().all(|c| c.is_ascii_digit()) {
            s.parse().ok()
        } else {
            None
        }
    };
    let field = |range| num(range).and_then(|n| i8::try_from(n).ok());
    let year = num(0..4).and_then(|n| i16::try_from(n).ok())?;
    let (month, day) = (field(5..7)?, field(8..10)?);
    let (hour, minute, second) = (field(11..13)?, field(14..16)?, field(17..19)?);
    // jiff refuses what is not a real date or time of day.
    let at = DateTime::new(year, month, day, hour, minute, second, 0).ok()?;
    Some(at.duration_since(EPOCH).as_secs())
}

/// Formats seconds since 1970-01-01 00:00:00 (wall clock) as Go `time.DateTime`. Years outside
/// 0000–9999 are clamped into that range (Go prints them differently; HAMi never writes them).
pub fn format_go_datetime(secs: i64) -> String {
    const MIN: i64 = -62_167_219_200; // 0000-01-01 00:00:00
    const MAX: i64 = 253_402_300_799; // 9999-12-31 23:59:59
    let secs = secs.clamp(MIN, MAX);
    let at = EPOCH
        .checked_add(SignedDuration::from_secs(secs))
        .unwrap_or(EPOCH);
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        at.year(),
        at.month(),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datetime_round_trip_and_validation() {
        let t = parse_go_datetime("2025-06-13 09:07:40").unwrap();
        assert_eq!(t, 1_749_805_660);
        assert_eq!(format_go_datetime(t), "2025-06-13 09:07:40");
        assert_eq!(parse_go_datetime("1970-01-01 00:00:00"), Some(0));
        assert_eq!(
            parse_go_datetime("2024-02-29 00:00:00")
                .map(format_go_datetime)
                .as_deref(),
            Some("2024-02-29 00:00:00")
        );
        for bad in [
            "2025-02-29 00:00:00",
            "2025-06-13T09:07:40",
            "2025-6-13 09:07:40",
            "2025-06-13 24:00:00",
            "",
            "+025-06-13 09:07:40",
        ] {
            assert_eq!(parse_go_datetime(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_whole_range_formats_and_parses_back() {
        for secs in [
            -62_167_219_200,
            -1,
            0,
            951_782_400,
            1_749_805_660,
            253_402_300_799,
        ] {
            let text = format_go_datetime(secs);
            assert_eq!(parse_go_datetime(&text), Some(secs), "{text}");
        }
        assert_eq!(format_go_datetime(i64::MIN), "0000-01-01 00:00:00");
        assert_eq!(format_go_datetime(i64::MAX), "9999-12-31 23:59:59");
        assert_eq!(format_go_datetime(-1), "1969-12-31 23:59:59");
    }

    #[test]
    fn expiry_is_sixty_seconds() {
        let h = Handshake::parse("Requesting_2025-06-13 09:07:40");
        let t = parse_go_datetime("2025-06-13 09:07:40").unwrap();
        assert_eq!(h.requesting_expired(t + 59), Some(false));
        assert_eq!(h.requesting_expired(t + 60), Some(true));
        assert_eq!(
            Handshake::parse("Requesting_garbage").requesting_expired(i64::MAX),
            Some(false)
        );
        assert_eq!(Handshake::parse("Deleted_x").requesting_expired(0), None);
    }
}
