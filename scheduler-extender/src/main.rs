//! `tessera-scheduler`: the kube-scheduler extender daemon and its offline `simulate` tool.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::builder::BoolishValueParser;
use clap::{ArgAction, Parser, Subcommand, ValueEnum};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::podspec::PolicyDefaults;

#[derive(Debug, Parser)]
#[command(name = "tessera-scheduler", version, about)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// klog verbosity, as HAMi's chart passes it (`-v=4`, `--v 4`): 4 or more logs Tessera's own
    /// crates at debug, 6 at trace, 8 everything at trace. An explicit RUST_LOG wins.
    #[arg(
        short = 'v',
        long = "v",
        env = "TESSERA_VERBOSITY",
        value_name = "LEVEL",
        global = true
    )]
    verbosity: Option<u8>,
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
    debug: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Policies and device config shared by `serve` and `simulate`.
#[derive(Debug, clap::Args)]
pub struct PolicyArgs {
    /// Default node policy: `binpack` (fullest node first) or `spread`.
    #[arg(long, env = "TESSERA_NODE_SCHEDULER_POLICY", default_value = "binpack")]
    node_scheduler_policy: String,
    /// Default GPU policy: `spread`, `binpack`, `topology-aware`, `mutex`, `numa` or a comma chain.
    #[arg(long, env = "TESSERA_GPU_SCHEDULER_POLICY", default_value = "spread")]
    gpu_scheduler_policy: String,
    /// HAMi's device-config.yaml (resource names, defaults, memoryFactor).
    #[arg(long, alias = "device-config-file", env = "TESSERA_DEVICE_CONFIG")]
    device_config: Option<PathBuf>,
}

impl PolicyArgs {
    fn decision_config(&self) -> anyhow::Result<DecisionConfig> {
        let nvidia = match &self.device_config {
            None => Default::default(),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading device config {}", p.display()))?;
                hami_contract::DeviceConfig::from_yaml(&text)
                    .with_context(|| format!("device config {}", p.display()))?
                    .nvidia
            }
        };
        let defaults =
            PolicyDefaults::parse(&self.gpu_scheduler_policy, &self.node_scheduler_policy)
                .map_err(|e| anyhow::anyhow!("invalid scheduler policy flag: {e}"))?;
        Ok(DecisionConfig {
            nvidia,
            defaults,
            node_selector: Vec::new(),
            filter_threads: 1,
        })
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Place the pending pods of a file offline and print one JSON line per pod.
    Simulate {
        /// Multi-document YAML (or a v1 List): Nodes, running Pods, ResourceQuotas, pending Pods.
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        #[command(flatten)]
        policy: PolicyArgs,
    },
    /// Run the extender, webhook and metrics servers.
    Serve(Box<serve::ServeArgs>),
}

mod serve;

impl Cli {
    /// The log filter asked for by `-v`/`--debug`; `None` keeps the default. RUST_LOG wins.
    fn log_directive(&self) -> Option<String> {
        hami_contract::verbosity::filter_directive(
            self.verbosity,
            self.debug,
            &["tessera_scheduler", "hami_contract"],
        )
    }
}

/// RUST_LOG wins; otherwise `-v`/`--debug` (HAMi's flags), otherwise `info`.
fn init_logging(format: LogFormat, directive: Option<String>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(directive.as_deref().unwrap_or("info"))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour only on a terminal: container logs (`kubectl logs`) must stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format, cli.log_directive());
    match cli.command {
        Command::Simulate { file, policy } => {
            let cfg = policy.decision_config()?;
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let input = tessera_scheduler_core::simulate::Input::parse(&text)
                .with_context(|| format!("parsing {}", file.display()))?;
            for skipped in &input.ignored {
                tracing::warn!(object = %skipped, "ignoring object of a kind simulate does not use");
            }
            let mut out = std::io::stdout().lock();
            for line in tessera_scheduler_core::simulate::run(&input, &cfg) {
                serde_json::to_writer(&mut out, &line)?;
                writeln!(out)?;
            }
            Ok(())
        }
        Command::Serve(args) => {
            let mut cfg = args.policy.decision_config()?;
            cfg.node_selector = serve::parse_selector(&args.node_label_selector)?;
            cfg.filter_threads = args.filter_threads;
            serve::run(*args, cfg)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once(&"tessera-scheduler").chain(args.iter()))
    }

    #[test]
    fn klog_verbosity_in_every_form_before_or_after_the_subcommand() {
        for form in [
            &["serve", "-v=4"][..],
            &["serve", "--v=4"],
            &["serve", "-v", "4"],
            &["serve", "--v", "4"],
            &["-v=4", "serve"],
            &["--v", "4", "serve"],
            &["simulate", "-f", "x.yaml", "-v", "4"],
        ] {
            let cli = parse(form).unwrap_or_else(|e| panic!("{form:?}: {e}"));
            assert_eq!(cli.verbosity, Some(4), "{form:?}");
            assert_eq!(
                cli.log_directive().as_deref(),
                Some("info,tessera_scheduler=debug,hami_contract=debug"),
                "{form:?}"
            );
        }
        assert!(parse(&["serve", "-v=x"]).is_err());
        let trace = parse(&["serve", "-v=6"]).expect("v6").log_directive();
        assert_eq!(
            trace.as_deref(),
            Some("debug,tessera_scheduler=trace,hami_contract=trace")
        );
    }

    #[test]
    fn hami_scheduler_extra_args_parse() {
        // HAMi v2.10's default scheduler.extender.extraArgs, after the chart's own flags.
        let cli = parse(&["serve", "--debug", "-v=4"]).expect("HAMi's defaults");
        assert!(cli.debug);
        assert_eq!(cli.verbosity, Some(4));
        assert!(parse(&["serve", "--debug=true"]).expect("=true").debug);
        assert!(!parse(&["serve", "--debug=false"]).expect("=false").debug);
        assert!(parse(&["--debug", "serve"]).expect("before").debug);
        let plain = parse(&["serve"]).expect("plain");
        assert!(!plain.debug);
        assert_eq!(plain.log_directive(), None);
        assert!(
            parse(&["serve", "--debug", "-v=2"])
                .expect("debug wins")
                .log_directive()
                .is_some()
        );
    }
}
