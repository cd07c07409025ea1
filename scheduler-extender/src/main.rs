//! `tessera-scheduler`: the kube-scheduler extender daemon and its offline `simulate` tool.
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tessera_runtime::LogArgs;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::podspec::PolicyDefaults;

#[derive(Debug, Parser)]
#[command(name = "tessera-scheduler", version = tessera_runtime::build_info::version(), about)]
struct Cli {
    /// `--log-format`, and klog's `-v`/`--v` and HAMi's `--debug` (global: before or after the
    /// subcommand, as HAMi's chart passes them).
    #[command(flatten)]
    logging: LogArgs,
    #[command(subcommand)]
    command: Command,
}

/// Policies and device config shared by `serve` and `simulate`.
#[derive(Debug, clap::Args)]
#[command(about = None, long_about = None)]
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
            // The daemon answers kube-scheduler, which reads other nodes' reasons only when
            // nothing fits; `simulate` asks for them itself.
            reasons_when_placed: false,
            writes: Default::default(),
        })
    }
}

/// How `simulate` prints its results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Json,
    Table,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Place the pending pods of a file offline and print one JSON line (or table row) per pod.
    Simulate {
        /// Multi-document YAML (or a v1 List): Nodes, running Pods, ResourceQuotas, pending Pods;
        /// for pods that use claims, ResourceSlices, ResourceClaims, ResourceClaimTemplates and
        /// DeviceClasses. Repeat to read several files, in order; `-` reads standard input
        /// (`kubectl get nodes,pods -A -o yaml | tessera-scheduler simulate -f -`).
        #[arg(short = 'f', long = "file", required = true)]
        file: Vec<PathBuf>,
        /// `json`: one JSON object per pod (for scripts); `table`: a table for a terminal.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Json)]
        output: Output,
        #[command(flatten)]
        policy: PolicyArgs,
    },
    /// Run the extender, webhook and metrics servers.
    Serve(Box<serve::ServeArgs>),
}

mod serve;

/// The crates whose logs `-v`/`--debug` raise.
const OWN_CRATES: &[&str] = &[
    "tessera_scheduler",
    "tessera_scheduler_core",
    "hami_contract",
];

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.logging.init(OWN_CRATES)?;
    match cli.command {
        Command::Simulate {
            file,
            output,
            policy,
        } => {
            let cfg = policy.decision_config()?;
            let mut input = tessera_scheduler_core::simulate::Input::default();
            for file in &file {
                let text = tessera_runtime::input::read_file_or_stdin(file)?;
                input
                    .add_text(&text)
                    .with_context(|| format!("parsing {}", file.display()))?;
            }
            for skipped in &input.ignored {
                tracing::warn!(object = %skipped, "ignoring object of a kind simulate does not use");
            }
            for problem in tessera_scheduler_core::simulate::input_warnings(&input) {
                tracing::warn!(%problem, "simulate leaves part of the input out");
            }
            let results = tessera_scheduler_core::simulate::run(&input, &cfg);
            let text = match output {
                Output::Json => results.iter().try_fold(String::new(), |mut text, line| {
                    text.push_str(&serde_json::to_string(line)?);
                    text.push('\n');
                    Ok::<_, serde_json::Error>(text)
                })?,
                Output::Table => tessera_scheduler_core::simulate::table(&results),
            };
            // A reader that stops early (`| head`) is not an error.
            match std::io::stdout().lock().write_all(text.as_bytes()) {
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                written => written.context("writing to standard output")?,
            }
            let no_gpu_nodes = results.iter().any(|line| {
                line.error.as_deref() == Some(tessera_scheduler_core::simulate::NO_GPU_NODES)
            });
            if no_gpu_nodes {
                anyhow::bail!(tessera_scheduler_core::simulate::NO_GPU_NODES);
            }
            Ok(())
        }
        Command::Serve(args) => {
            let mut cfg = args.policy.decision_config()?;
            cfg.node_selector = serve::parse_selector(&args.node_label_selector)?;
            cfg.filter_threads = args.filter_threads;
            cfg.writes = tessera_scheduler_core::config::WriteOptions {
                decision_at_filter: args.write_decision_at_filter,
                success_events: args.pod_events == serve::PodEvents::All,
            };
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

    /// `--help` starts with what the program and each subcommand are, not with the doc comment
    /// of a group of flags they flatten (issue 34: it printed the logging flags' developer note).
    #[test]
    fn help_describes_the_program_and_its_subcommands() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        let help = cmd.render_help().to_string();
        assert!(help.starts_with(env!("CARGO_PKG_DESCRIPTION")), "{help}");
        assert!(!help.contains("flatten"), "{help}");
        for (sub, about) in [
            ("serve", "Run the extender, webhook and metrics servers"),
            ("simulate", "Place the pending pods of a file offline"),
        ] {
            let help = cmd
                .find_subcommand_mut(sub)
                .unwrap()
                .render_help()
                .to_string();
            assert!(help.starts_with(about), "{sub}: {help}");
        }
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
            assert_eq!(cli.logging.verbosity.verbosity, Some(4), "{form:?}");
            assert_eq!(
                cli.logging.directive(OWN_CRATES).as_deref(),
                Some(
                    "info,tessera_scheduler=debug,tessera_scheduler_core=debug,hami_contract=debug"
                ),
                "{form:?}"
            );
        }
        assert!(parse(&["serve", "-v=x"]).is_err());
        let trace = parse(&["serve", "-v=6"])
            .expect("v6")
            .logging
            .directive(OWN_CRATES);
        assert_eq!(
            trace.as_deref(),
            Some("debug,tessera_scheduler=trace,tessera_scheduler_core=trace,hami_contract=trace")
        );
    }

    #[test]
    fn hami_scheduler_extra_args_parse() {
        // HAMi v2.10's default scheduler.extender.extraArgs, after the chart's own flags.
        let cli = parse(&["serve", "--debug", "-v=4"]).expect("HAMi's defaults");
        assert!(cli.logging.verbosity.debug);
        assert_eq!(cli.logging.verbosity.verbosity, Some(4));
        assert!(
            parse(&["serve", "--debug=true"])
                .expect("=true")
                .logging
                .verbosity
                .debug
        );
        assert!(
            !parse(&["serve", "--debug=false"])
                .expect("=false")
                .logging
                .verbosity
                .debug
        );
        assert!(
            parse(&["--debug", "serve"])
                .expect("before")
                .logging
                .verbosity
                .debug
        );
        let plain = parse(&["serve"]).expect("plain");
        assert!(!plain.logging.verbosity.debug);
        assert_eq!(plain.logging.directive(OWN_CRATES), None);
        assert!(
            parse(&["serve", "--debug", "-v=2"])
                .expect("debug wins")
                .logging
                .directive(OWN_CRATES)
                .is_some()
        );
    }
}
