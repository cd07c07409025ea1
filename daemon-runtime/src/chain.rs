//! An error with its causes on one line.

use std::error::Error;
use std::fmt;

/// Displays an error and every [`Error::source`] below it as `outer: cause: root cause`, the
/// way `anyhow` prints `{:#}`, so a log line names the kube, I/O or NVML cause and not only
/// the outermost context.
///
/// Many library errors (kube's, nvml-wrapper's) already print their source inside their own
/// message *and* return it from `source()`; a cause whose text the line already holds is
/// skipped, so it is not printed twice.
///
/// ```
/// use tessera_runtime::DisplayChain;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("cannot read the device config")]
/// struct ConfigError(#[source] std::io::Error);
///
/// let e = ConfigError(std::io::Error::other("permission denied"));
/// assert_eq!(
///     DisplayChain(&e).to_string(),
///     "cannot read the device config: permission denied"
/// );
/// ```
#[derive(Clone, Copy)]
pub struct DisplayChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut written = self.0.to_string();
        f.write_str(&written)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            let text = e.to_string();
            if !text.is_empty() && !written.contains(&text) {
                write!(f, ": {text}")?;
                written.push_str(": ");
                written.push_str(&text);
            }
            cause = e.source();
        }
        Ok(())
    }
}

impl fmt::Debug for DisplayChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot patch node n1")]
    struct Patch(#[source] Api);

    #[derive(Debug, thiserror::Error)]
    #[error("ApiError: {0}")]
    struct Api(#[source] std::io::Error);

    #[test]
    fn every_cause_once_outermost_first() {
        let e = Patch(Api(std::io::Error::other("connection refused")));
        // `Api` prints its source itself: the chain does not repeat it.
        assert_eq!(
            DisplayChain(&e).to_string(),
            "cannot patch node n1: ApiError: connection refused"
        );
        assert_eq!(
            format!("{:?}", DisplayChain(&e)),
            DisplayChain(&e).to_string()
        );
        let io = std::io::Error::other("plain");
        assert_eq!(DisplayChain(&io).to_string(), "plain");
    }
}
