//! HAMi's logging flags: klog's `-v`/`--v` verbosity and HAMi's `--debug`, mapped onto a
//! `tracing` filter directive.
//!
//! HAMi's chart passes `-v=4` to every daemon and `--debug` to its scheduler; Tessera's daemons
//! accept both (so a HAMi values file works unchanged) and translate them:
//!
//! | flags | filter |
//! |---|---|
//! | none, or `-v` below 4 | the default (`info`) |
//! | `-v` 4 or 5, or `--debug` | `info`, Tessera's own crates at `debug` |
//! | `-v` 6 or 7 | `debug`, Tessera's own crates at `trace` |
//! | `-v` 8 or more | `trace` everywhere |
//!
//! An explicit `RUST_LOG` always wins over these flags (the daemons decide that, not this module).

/// klog's verbosity from which Tessera's own crates log at `debug`.
pub const DEBUG_FROM: u8 = 4;
/// klog's verbosity from which Tessera's own crates log at `trace`.
pub const TRACE_FROM: u8 = 6;
/// klog's verbosity from which every crate (HTTP, TLS, Kubernetes client) logs at `trace`.
pub const TRACE_ALL_FROM: u8 = 8;

/// The filter directive for klog verbosity `v` and HAMi's `--debug`, or `None` when neither asks
/// for more than the default. `own_crates` are the target prefixes raised first (the daemon's
/// own crates), e.g. `["tessera_scheduler", "hami_contract"]`.
#[must_use]
pub fn filter_directive(v: Option<u8>, debug: bool, own_crates: &[&str]) -> Option<String> {
    let v = v.unwrap_or(0);
    let v = if debug { v.max(DEBUG_FROM) } else { v };
    let (base, own) = if v >= TRACE_ALL_FROM {
        return Some("trace".to_string());
    } else if v >= TRACE_FROM {
        ("debug", "trace")
    } else if v >= DEBUG_FROM {
        ("info", "debug")
    } else {
        return None;
    };
    let mut directive = base.to_string();
    for krate in own_crates {
        directive.push(',');
        directive.push_str(krate);
        directive.push('=');
        directive.push_str(own);
    }
    Some(directive)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &[&str] = &["tessera_x", "hami_contract"];

    #[test]
    fn low_verbosity_keeps_the_default() {
        assert_eq!(filter_directive(None, false, OWN), None);
        for v in 0..DEBUG_FROM {
            assert_eq!(filter_directive(Some(v), false, OWN), None, "v={v}");
        }
    }

    #[test]
    fn hami_default_v4_and_debug_raise_own_crates_to_debug() {
        let want = Some("info,tessera_x=debug,hami_contract=debug".to_string());
        assert_eq!(filter_directive(Some(4), false, OWN), want);
        assert_eq!(filter_directive(Some(5), false, OWN), want);
        assert_eq!(filter_directive(None, true, OWN), want);
        assert_eq!(filter_directive(Some(2), true, OWN), want);
    }

    #[test]
    fn higher_verbosity_traces() {
        assert_eq!(
            filter_directive(Some(6), false, OWN).as_deref(),
            Some("debug,tessera_x=trace,hami_contract=trace")
        );
        assert_eq!(
            filter_directive(Some(7), true, OWN).as_deref(),
            Some("debug,tessera_x=trace,hami_contract=trace")
        );
        assert_eq!(
            filter_directive(Some(8), false, OWN).as_deref(),
            Some("trace")
        );
        assert_eq!(
            filter_directive(Some(u8::MAX), true, &[]).as_deref(),
            Some("trace")
        );
    }
}
