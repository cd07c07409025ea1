//! Logging flags and setup, the same for both daemons.
//!
//! HAMi's chart passes klog flags (`-v=4` to every daemon, `--debug` to its scheduler); a HAMi
//! values file must keep working, so both daemons accept them in every klog spelling and map them
//! onto a `tracing` filter ([`hami_contract::verbosity`]). Precedence: an explicit `RUST_LOG`,
//! then `-v`/`--debug`, then `info`.

use std::io::IsTerminal;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, ValueEnum};
use tracing_subscriber::EnvFilter;

/// Log line format on stderr.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// klog's verbosity and HAMi's `--debug`. Global, so a daemon with subcommands accepts them
/// before or after the subcommand (`tessera-scheduler serve -v=4` and `-v=4 serve`).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
#[command(about = None, long_about = None)]
pub struct Verbosity {
    /// klog verbosity, as HAMi's chart passes it (`-v=4`, `--v 4`): 4 or more logs Tessera's own
    /// crates at debug, 6 at trace, 8 everything at trace. An explicit RUST_LOG wins.
    #[arg(
        short = 'v',
        long = "v",
        env = "TESSERA_VERBOSITY",
        value_name = "LEVEL",
        global = true
    )]
    pub verbosity: Option<u8>,
    /// HAMi's `--debug`: the same as `-v=4` (also `--debug=true|false`).
    #[arg(
        long,
        env = "TESSERA_DEBUG",
        action = ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        default_value = "false",
        value_parser = BoolishValueParser::new(),
        global = true
    )]
    pub debug: bool,
}

impl Verbosity {
    /// The filter directive these flags ask for, raising `own_crates` (the daemon's own target
    /// prefixes, e.g. `["tessera_scheduler", "hami_contract"]`) first; `None` keeps the default.
    #[must_use]
    pub fn directive(&self, own_crates: &[&str]) -> Option<String> {
        hami_contract::verbosity::filter_directive(self.verbosity, self.debug, own_crates)
    }
}

/// The logging flags a daemon flattens into its command line:
/// `#[command(flatten)] pub logging: LogArgs`.
///
/// `--log-format` reads `TESSERA_LOG_FORMAT`; a daemon that has always read another variable keeps
/// it with `#[command(mut_arg("log_format", |a| a.env("LOG_FORMAT")))]` on its parser.
// `about = None`: this doc comment is for developers; without it clap would print it as the
// daemon's description in `--help`.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
#[command(about = None, long_about = None)]
pub struct LogArgs {
    /// Log format on stderr.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub verbosity: Verbosity,
}

/// Why the subscriber could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("cannot install the log subscriber")]
pub struct LoggingError(#[source] Box<dyn std::error::Error + Send + Sync + 'static>);

impl LogArgs {
    /// The filter directive `-v`/`--debug` ask for (see [`Verbosity::directive`]).
    #[must_use]
    pub fn directive(&self, own_crates: &[&str]) -> Option<String> {
        self.verbosity.directive(own_crates)
    }

    /// Installs the process's `tracing` subscriber on stderr: `RUST_LOG` if set and valid,
    /// otherwise the flags' directive, otherwise `info`.
    pub fn init(&self, own_crates: &[&str]) -> Result<(), LoggingError> {
        init(self.log_format, self.directive(own_crates).as_deref())
    }
}

/// The filter: `RUST_LOG` if set and valid, otherwise `directive`, otherwise `info`.
#[must_use]
pub fn env_filter(directive: Option<&str>) -> EnvFilter {
    EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(directive.unwrap_or("info")))
}

/// Installs the global `tracing` subscriber: stderr, `format`, [`env_filter`]`(directive)`.
/// Colour only on a terminal: container logs (`kubectl logs`) must stay plain text.
pub fn init(format: LogFormat, directive: Option<&str>) -> Result<(), LoggingError> {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter(directive))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    }
    .map_err(LoggingError)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser, Subcommand};

    /// A daemon without subcommands (the device plugin's shape).
    #[derive(Debug, Parser)]
    struct Plain {
        #[command(flatten)]
        logging: LogArgs,
    }

    /// A daemon with subcommands (the scheduler's shape).
    #[derive(Debug, Parser)]
    struct WithSub {
        #[command(flatten)]
        logging: LogArgs,
        #[command(subcommand)]
        command: Sub,
    }

    #[derive(Debug, Subcommand)]
    enum Sub {
        Serve,
    }

    /// A daemon that keeps its historical `LOG_FORMAT` variable.
    #[derive(Debug, Parser)]
    #[command(mut_arg("log_format", |a| a.env("LOG_FORMAT")))]
    struct OwnEnv {
        #[command(flatten)]
        logging: LogArgs,
    }

    fn plain(args: &[&str]) -> Result<Plain, clap::Error> {
        Plain::try_parse_from(std::iter::once(&"d").chain(args))
    }

    const OWN: &[&str] = &["tessera_x", "hami_contract"];

    #[test]
    fn klog_verbosity_in_every_form() {
        for form in [
            &["-v=4"][..],
            &["--v=4"],
            &["-v", "4"],
            &["--v", "4"],
            &["-v4"],
        ] {
            let cli = plain(form).unwrap_or_else(|e| panic!("{form:?}: {e}"));
            assert_eq!(cli.logging.verbosity.verbosity, Some(4), "{form:?}");
            assert!(!cli.logging.verbosity.debug);
            assert_eq!(
                cli.logging.directive(OWN).as_deref(),
                Some("info,tessera_x=debug,hami_contract=debug")
            );
        }
        assert_eq!(
            plain(&["-v=6"])
                .expect("v6")
                .logging
                .directive(OWN)
                .as_deref(),
            Some("debug,tessera_x=trace,hami_contract=trace")
        );
        assert!(plain(&["-v=lots"]).is_err());
        assert!(plain(&["-v=-1"]).is_err());
        assert_eq!(plain(&["-v=2"]).expect("v2").logging.directive(OWN), None);
    }

    #[test]
    fn hami_debug_flag() {
        assert!(plain(&["--debug"]).expect("bare").logging.verbosity.debug);
        assert!(
            plain(&["--debug=true"])
                .expect("=true")
                .logging
                .verbosity
                .debug
        );
        assert!(
            !plain(&["--debug=false"])
                .expect("=false")
                .logging
                .verbosity
                .debug
        );
        // `--debug false` is not klog's form: the value must be attached.
        assert!(plain(&["--debug", "false"]).is_err());
        let none = plain(&[]).expect("no flags");
        assert_eq!(none.logging, LogArgs::default());
        assert_eq!(none.logging.directive(OWN), None);
        assert!(
            plain(&["--debug", "-v=2"])
                .expect("debug wins")
                .logging
                .directive(OWN)
                .is_some()
        );
    }

    #[test]
    fn flags_are_accepted_before_or_after_a_subcommand() {
        for form in [
            &["serve", "-v=4", "--log-format=json"][..],
            &["-v", "4", "--log-format", "json", "serve"],
            &["--debug", "serve", "-v4", "--log-format=json"],
        ] {
            let cli = WithSub::try_parse_from(std::iter::once(&"d").chain(form))
                .unwrap_or_else(|e| panic!("{form:?}: {e}"));
            assert!(matches!(cli.command, Sub::Serve));
            assert_eq!(cli.logging.verbosity.verbosity, Some(4), "{form:?}");
            assert_eq!(cli.logging.log_format, LogFormat::Json, "{form:?}");
        }
    }

    #[test]
    fn log_format_values_and_env_names() {
        assert_eq!(
            plain(&[]).expect("default").logging.log_format,
            LogFormat::Text
        );
        assert_eq!(
            plain(&["--log-format=json"])
                .expect("json")
                .logging
                .log_format,
            LogFormat::Json
        );
        assert!(plain(&["--log-format=xml"]).is_err());
        let env_of = |cmd: clap::Command, id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        };
        assert_eq!(
            env_of(Plain::command(), "log_format").as_deref(),
            Some("TESSERA_LOG_FORMAT")
        );
        assert_eq!(
            env_of(OwnEnv::command(), "log_format").as_deref(),
            Some("LOG_FORMAT")
        );
        assert_eq!(
            env_of(Plain::command(), "verbosity").as_deref(),
            Some("TESSERA_VERBOSITY")
        );
        assert_eq!(
            env_of(Plain::command(), "debug").as_deref(),
            Some("TESSERA_DEBUG")
        );
        Plain::command().debug_assert();
        WithSub::command().debug_assert();
        OwnEnv::command().debug_assert();
    }

    #[test]
    fn a_second_subscriber_is_an_error_not_a_panic() {
        // The first call may fail too when another test installed one; the second always does.
        let _ = init(LogFormat::Text, None);
        let err = init(LogFormat::Json, Some("debug")).expect_err("already installed");
        assert_eq!(err.to_string(), "cannot install the log subscriber");
        assert!(std::error::Error::source(&err).is_some());
    }
}
