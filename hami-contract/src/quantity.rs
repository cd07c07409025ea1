//! Kubernetes resource quantities (`3000`, `16Gi`, `1.5`, `2e3`), parsed exactly.
//!
//! HAMi reads every GPU resource with `resource.Quantity.AsInt64()` (integer values only) or
//! `Value()` (rounded up). This module gives the same answers without floating point: a quantity
//! is kept as an exact fraction.

use std::fmt;

/// A parsed quantity: `numer / denom`, exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity {
    numer: i128,
    denom: u128,
    plain: bool,
}

/// Why a string is not a Kubernetes quantity (or is one too large to hold).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Not of the form `[+-]<number>[<suffix>]` with a known suffix.
    #[error("{0:?} is not a Kubernetes quantity")]
    Invalid(String),
    /// A quantity, but beyond what this parser holds exactly (±2^127).
    #[error("quantity {0:?} is out of range")]
    OutOfRange(String),
}

impl Quantity {
    /// The value when it is a whole number (HAMi's `AsInt64` succeeding, widened).
    pub fn as_integer(&self) -> Option<i128> {
        (self.numer % self.denom as i128 == 0).then(|| self.numer / self.denom as i128)
    }

    /// The value rounded up to a whole number (Go's `Quantity.Value()`).
    pub fn ceil(&self) -> i128 {
        let d = self.denom as i128;
        let q = self.numer / d;
        if self.numer % d != 0 && self.numer > 0 {
            q + 1
        } else {
            q
        }
    }

    /// True when the text is a decimal integer as the API server writes one: digits with no
    /// fraction and no exponent, optionally with a decimal multiplier (`3000`, `+5`, `3k`, `2M`).
    /// HAMi documents `gpumem` as a plain number of MiB, and a user's `3000` reaches every reader
    /// (webhook, scheduler, device plugin) as `3k`: the API server stores quantities in canonical
    /// form. Binary suffixes (`4Ki`), fractions and exponents stay as written and are not plain.
    pub fn is_plain_integer(&self) -> bool {
        self.plain
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_integer() {
            Some(v) => write!(f, "{v}"),
            None => write!(f, "{}/{}", self.numer, self.denom),
        }
    }
}

/// Parses a quantity in Kubernetes' canonical grammar: an optional sign, digits with an optional
/// decimal point, then one suffix: binary (`Ki` `Mi` `Gi` `Ti` `Pi` `Ei`), decimal (`n` `u` `m`
/// `k` `M` `G` `T` `P` `E`) or an exponent (`e3`, `E-2`). Never panics.
pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
    let invalid = || QuantityError::Invalid(text.to_owned());
    let out_of_range = || QuantityError::OutOfRange(text.to_owned());
    let (negative, rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let number_len = rest
        .bytes()
        .position(|b| !(b.is_ascii_digit() || b == b'.'))
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(number_len);
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if frac_part.contains('.') || (int_part.is_empty() && frac_part.is_empty()) {
        return Err(invalid());
    }
    let (mut scale10, pow2): (i64, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        s if s.starts_with(['e', 'E']) => {
            let exp = &s[1..];
            let digits = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid());
            }
            let magnitude: i64 = digits.parse().map_err(|_| out_of_range())?;
            (
                if exp.starts_with('-') {
                    -magnitude
                } else {
                    magnitude
                },
                0,
            )
        }
        _ => return Err(invalid()),
    };
    let plain = frac_part.is_empty()
        && !number.contains('.')
        && matches!(suffix, "" | "k" | "M" | "G" | "T" | "P" | "E");
    let digits: String = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    scale10 -= frac_part.len() as i64;
    if digits.is_empty() {
        return Ok(Quantity {
            numer: 0,
            denom: 1,
            plain,
        });
    }
    if digits.len() > 38 {
        return Err(out_of_range());
    }
    let mantissa: u128 = digits.parse().map_err(|_| out_of_range())?;
    let pow10 = |e: i64| -> Option<u128> { 10u128.checked_pow(u32::try_from(e).ok()?) };
    let (mut numer, mut denom) = (mantissa, 1u128);
    if scale10 >= 0 {
        numer = numer
            .checked_mul(pow10(scale10).ok_or_else(out_of_range)?)
            .ok_or_else(out_of_range)?;
    } else {
        denom = pow10(-scale10).ok_or_else(out_of_range)?;
    }
    numer = numer.checked_mul(1u128 << pow2).ok_or_else(out_of_range)?;
    // Reduce by common powers of ten so the fraction stays small and `as_integer` is cheap.
    while denom > 1 && numer % 10 == 0 {
        numer /= 10;
        denom /= 10;
    }
    let numer = i128::try_from(numer).map_err(|_| out_of_range())?;
    if i128::try_from(denom).is_err() {
        return Err(out_of_range());
    }
    Ok(Quantity {
        numer: if negative { -numer } else { numer },
        denom,
        plain,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(s: &str) -> Option<i128> {
        parse(s).ok().and_then(|q| q.as_integer())
    }

    #[test]
    fn integers_and_suffixes() {
        assert_eq!(int("3000"), Some(3000));
        assert_eq!(int("+5"), Some(5));
        assert_eq!(int("-1"), Some(-1));
        assert_eq!(int("16Gi"), Some(17_179_869_184));
        assert_eq!(int("16.0Gi"), Some(17_179_869_184));
        assert_eq!(int("1k"), Some(1000));
        assert_eq!(int("2e3"), Some(2000));
        assert_eq!(int("1500m"), None);
        assert_eq!(int("2000m"), Some(2));
        assert_eq!(int("1.5"), None);
        assert_eq!(int(".5Ki"), Some(512));
        assert_eq!(int("0.000"), Some(0));
    }

    #[test]
    fn plain_means_bare_digits() {
        assert!(parse("3000").unwrap().is_plain_integer());
        assert!(!parse("16Gi").unwrap().is_plain_integer());
        // The API server's canonical form of 3000 and 2000000.
        assert!(parse("3k").unwrap().is_plain_integer());
        assert!(parse("2M").unwrap().is_plain_integer());
        assert!(!parse("4Ki").unwrap().is_plain_integer());
        assert!(!parse("1500m").unwrap().is_plain_integer());
        assert!(!parse("16.0").unwrap().is_plain_integer());
        assert!(!parse("1e3").unwrap().is_plain_integer());
    }

    #[test]
    fn ceil_rounds_up_like_go_value() {
        assert_eq!(parse("1500m").unwrap().ceil(), 2);
        assert_eq!(parse("-1500m").unwrap().ceil(), -1);
        assert_eq!(parse("7").unwrap().ceil(), 7);
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        for bad in [
            "", "-", ".", "1..2", "Gi", "1K", "1e", "1e+", "1ee3", "1 ", " 1", "1Gi2", "é",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            parse("1e999999999999"),
            Err(QuantityError::OutOfRange(_))
        ));
        assert!(matches!(
            parse("99999999999999999999999999999999999999999"),
            Err(QuantityError::OutOfRange(_))
        ));
    }
}
