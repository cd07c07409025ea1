//! The node handshake annotation `hami.io/node-handshake` (contract §2.3).
//!
//! v2.10: only the scheduler writes `Requesting_<Go DateTime>`; older plugins wrote
//! `Reported <Go time.String()>` and older schedulers `Deleted_<DateTime>`.

use std::fmt;

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

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(y) => 29,
        _ => 28,
    }
}

/// Days from 1970-01-01 to y-m-d (proleptic Gregorian; Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

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
    let (y, mo, d) = (i64::from(num(0..4)?), num(5..7)?, num(8..10)?);
    let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || d == 0 || d > days_in_month(y, mo) || h > 23 || mi > 59 || s > 59
    {
        return None;
    }
    Some(days_from_civil(y, mo, d) * 86_400 + i64::from(h * 3600 + mi * 60 + s))
}

/// Formats seconds since 1970-01-01 00:00:00 (wall clock) as Go `time.DateTime`. Years outside
/// 0000–9999 are clamped into that range (Go prints them differently; HAMi never writes them).
pub fn format_go_datetime(secs: i64) -> String {
    const MIN: i64 = -62_167_219_200; // 0000-01-01 00:00:00
    const MAX: i64 = 253_402_300_799; // 9999-12-31 23:59:59
    let secs = secs.clamp(MIN, MAX);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
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
