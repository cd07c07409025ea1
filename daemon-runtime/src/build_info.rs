//! The labels of HAMi's `hami_build_info` gauge (constant 1), for both daemons: dashboards and
//! alerts select a rollout's version with it.
//!
//! `revision` and `build_date` come from `TESSERA_REVISION` / `TESSERA_BUILD_DATE` in the
//! environment of the compile: `make release` sets them (the commit and its time); a developer's
//! build says `unknown`.
//! HAMi's `go_version` label is left out: a Tessera binary has no Go version, and an empty label
//! is the same as none to Prometheus.

/// What every binary's `--version` prints after its name: `0.1.0 (revision <commit>, built
/// <date>)`.
pub fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        format!(
            "{} (revision {}, built {})",
            env!("CARGO_PKG_VERSION"),
            option_env!("TESSERA_REVISION").unwrap_or("unknown"),
            option_env!("TESSERA_BUILD_DATE").unwrap_or("unknown"),
        )
    })
}

/// `(label, value)` pairs, in HAMi's order: `version`, `revision`, `build_date`, `compiler`,
/// `platform`. `version` is the daemon's crate version.
pub fn build_info_labels(version: &str) -> Vec<(String, String)> {
    vec![
        ("version".to_owned(), version.to_owned()),
        (
            "revision".to_owned(),
            option_env!("TESSERA_REVISION")
                .unwrap_or("unknown")
                .to_owned(),
        ),
        (
            "build_date".to_owned(),
            option_env!("TESSERA_BUILD_DATE")
                .unwrap_or("unknown")
                .to_owned(),
        ),
        ("compiler".to_owned(), "rustc".to_owned()),
        (
            "platform".to_owned(),
            format!(
                "{}/{}",
                std::env::consts::OS,
                go_arch(std::env::consts::ARCH)
            ),
        ),
    ]
}

/// Registers `hami_build_info` (constant 1, [`build_info_labels`]) in `registry`.
pub fn register_build_info(registry: &mut prometheus_client::registry::Registry, version: &str) {
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    let build_info = Family::<Vec<(String, String)>, Gauge>::default();
    build_info.get_or_create(&build_info_labels(version)).set(1);
    registry.register(
        "hami_build_info",
        "Build metadata as labels, constant 1",
        build_info,
    );
}

/// Go's name for the architecture (HAMi's `platform` is `runtime.GOOS/GOARCH`).
fn go_arch(rust: &str) -> &str {
    match rust {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_hamis_names_and_platform_form() {
        let labels = build_info_labels("1.2.3");
        let names: Vec<&str> = labels.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            ["version", "revision", "build_date", "compiler", "platform"]
        );
        assert_eq!(labels[0].1, "1.2.3");
        assert!(labels[4].1.starts_with("linux/"), "{}", labels[4].1);
        assert_eq!(go_arch("x86_64"), "amd64");
    }
}

#[cfg(test)]
mod version_tests {
    #[test]
    fn version_names_the_release_commit_and_build_date() {
        let v = super::version();
        assert!(v.starts_with(env!("CARGO_PKG_VERSION")), "{v}");
        assert!(v.contains("(revision ") && v.contains(", built "), "{v}");
    }
}
