//! `tessera-scheduler`: the kube-scheduler extender daemon and its offline `simulate` tool.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use tessera_scheduler::decide::DecisionConfig;
use tessera_scheduler::podspec::PolicyDefaults;

#[derive(Debug, Parser)]
#[command(name = "tessera-scheduler", version, about)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
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

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Simulate { file, policy } => {
            let cfg = policy.decision_config()?;
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let input = tessera_scheduler::simulate::Input::parse(&text)
                .with_context(|| format!("parsing {}", file.display()))?;
            for skipped in &input.ignored {
                tracing::warn!(object = %skipped, "ignoring object of a kind simulate does not use");
            }
            let mut out = std::io::stdout().lock();
            for line in tessera_scheduler::simulate::run(&input, &cfg) {
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
