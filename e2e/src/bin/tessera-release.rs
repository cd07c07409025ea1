//! `tessera-release`: the release's images, SBOMs and chart archive from built binaries
//! (`scripts/release.sh` runs it; `docs/release.md`).

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use tessera_e2e::release::{self, PlatformBuild, Release};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Builds Tessera's release images, SBOMs and chart archive."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One multi-platform OCI archive per image into OUT/images, its SBOM into OUT/sbom, and
    /// OUT/values-digests.yaml pinning the chart's images by digest.
    Images {
        #[arg(long)]
        version: String,
        #[arg(long)]
        revision: String,
        /// RFC 3339: the commit's time.
        #[arg(long)]
        created: String,
        #[arg(long, default_value = "https://github.com/tessera-gpu/tessera")]
        source: String,
        /// ARCH=DIR: a platform's binaries (amd64, arm64); repeat per platform.
        #[arg(long = "bin", required = true)]
        bins: Vec<String>,
        /// ARCH=PATH: a static busybox of that architecture; one per --bin.
        #[arg(long = "busybox", required = true)]
        busyboxes: Vec<String>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Rewrites a .tgz with every entry's time set to --mtime and no time in its gzip header.
    NormalizeTgz {
        #[arg(long)]
        mtime: u64,
        file: PathBuf,
    },
}

fn pair(s: &str) -> anyhow::Result<(String, PathBuf)> {
    let (k, v) = s
        .split_once('=')
        .with_context(|| format!("{s}: expected ARCH=PATH"))?;
    Ok((k.to_owned(), PathBuf::from(v)))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Images {
            version,
            revision,
            created,
            source,
            bins,
            busyboxes,
            out,
        } => {
            let busyboxes: std::collections::BTreeMap<String, PathBuf> = busyboxes
                .iter()
                .map(|b| pair(b))
                .collect::<Result<_, _>>()?;
            let mut platforms = Vec::new();
            for b in &bins {
                let (arch, bin_dir) = pair(b)?;
                let Some(busybox) = busyboxes.get(&arch).cloned() else {
                    bail!("no --busybox {arch}=PATH");
                };
                platforms.push(PlatformBuild {
                    arch,
                    bin_dir,
                    busybox,
                });
            }
            let r = Release {
                version,
                revision,
                created,
                source,
            };
            let built = release::build_release_images(&r, &platforms, &out)?;
            let mut overlay = String::from(
                "# The release's images by digest: helm install ... -f values-digests.yaml\n",
            );
            for image in &built {
                // The chart's images; the probe workload is no chart's.
                let value = match image.id.as_str() {
                    "tessera-scheduler" => {
                        Some(("scheduler:\n  extender:\n    image:\n", "      "))
                    }
                    "tessera-simulated-gpu" => Some(("simulatedGpus:\n  image:\n", "    ")),
                    "tessera-device-plugin" => Some(("devicePlugin:\n  image:\n", "    ")),
                    _ => None,
                };
                if let Some((key, indent)) = value {
                    overlay.push_str(&format!(
                        "{key}{indent}tag: \"{}\"\n{indent}digest: \"{}\"\n",
                        r.version, image.manifest_digest
                    ));
                }
                println!(
                    "{} {} {}",
                    image.names[0],
                    image.manifest_digest,
                    image.tar.display()
                );
            }
            std::fs::write(out.join("values-digests.yaml"), overlay)?;
        }
        Command::NormalizeTgz { mtime, file } => release::normalize_tgz(&file, mtime)?,
    }
    Ok(())
}
