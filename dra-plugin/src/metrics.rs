//! The DRA plugin's Prometheus metrics: what an operator watches to see that claims get prepared,
//! how fast, which GPUs are offered and which GPU processes no claim accounts for
//! (`tessera_dra_plugin_*`; the last under the device plugin's names, re-prefixed), and what each
//! claim uses of its share (`tessera_dra_claim_*`, from the shim's region in the claim's
//! directory). HAMi's DRA driver exports none, so there are no HAMi names to keep here.

use std::collections::BTreeMap;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use tessera_node::metrics::{
    ExposedRegistry, SampleSeries, VgpuSample, register_values, registered, result_labels, sample,
};
use tessera_node::process_watch::UnaccountedMetrics;

type Labels = Vec<(String, String)>;

/// Claim UID → (namespace, name) of the prepared claims.
pub type ClaimNames = BTreeMap<String, (String, String)>;

/// The plugin's metrics; clones share one registry.
#[derive(Clone)]
pub struct DraMetrics {
    registry: ExposedRegistry,
    prepare_seconds: Histogram,
    prepares: Family<Labels, Counter>,
    unprepares: Family<Labels, Counter>,
    prepared_claims: Gauge,
    registrations: Counter,
    gpu_healthy: Family<Labels, Gauge>,
    slice_syncs: Family<Labels, Counter>,
    unaccounted_processes: Family<Labels, Gauge>,
    undetermined_processes: Gauge,
    unaccounted_actions: Family<Labels, Counter>,
    /// `tessera_dra_claim_*`: one series per (claim, device).
    claim_usage: SampleSeries,
}

impl std::fmt::Debug for DraMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraMetrics").finish_non_exhaustive()
    }
}

impl Default for DraMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl DraMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let prepare_seconds = registered(
            &mut registry,
            "tessera_dra_plugin_prepare_duration_seconds",
            "Time to prepare one claim (reading it, writing its CDI spec), including claims already prepared",
            Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
        );
        let prepares = registered(
            &mut registry,
            "tessera_dra_plugin_prepares",
            "Claims prepared for the kubelet, by result (success, failure)",
            Family::<Labels, Counter>::default(),
        );
        let unprepares = registered(
            &mut registry,
            "tessera_dra_plugin_unprepares",
            "Claims unprepared (by the kubelet or the stale-claim sweep), by result",
            Family::<Labels, Counter>::default(),
        );
        let prepared_claims = registered(
            &mut registry,
            "tessera_dra_plugin_prepared_claims",
            "Claims prepared on this node now (their CDI specs)",
            Gauge::default(),
        );
        let registrations = registered(
            &mut registry,
            "tessera_dra_plugin_kubelet_registrations",
            "Successful registrations with the kubelet",
            Counter::default(),
        );
        let gpu_healthy = registered(
            &mut registry,
            "tessera_dra_plugin_gpu_healthy",
            "1 when the GPU is healthy and offered in the ResourceSlice, 0 while it is left out",
            Family::<Labels, Gauge>::default(),
        );
        let slice_syncs = registered(
            &mut registry,
            "tessera_dra_plugin_resource_slice_syncs",
            "Checks of this node's ResourceSlice against the GPUs, by result",
            Family::<Labels, Counter>::default(),
        );
        // The device plugin's unaccounted-process series (`tessera_device_plugin_*`), under this
        // plugin's prefix: one dashboard query per prefix covers both kinds of node.
        let unaccounted_processes = registered(
            &mut registry,
            "tessera_dra_plugin_unaccounted_gpu_processes",
            "GPU processes no claim accounts for, confirmed over two passes (reason: GpuNotBooked, GpuProcessWithoutShim, GpuProcessOutsidePods, as the Events)",
            Family::<Labels, Gauge>::default(),
        );
        let undetermined_processes = registered(
            &mut registry,
            "tessera_dra_plugin_undetermined_gpu_processes",
            "GPU processes whose /proc entry could not be read in the last pass (exited meanwhile; all of them without hostPID)",
            Gauge::default(),
        );
        let unaccounted_actions = registered(
            &mut registry,
            "tessera_dra_plugin_unaccounted_actions",
            "What the plugin did about pods with unaccounted GPU processes (action: reported, evicted, eviction_failed)",
            Family::<Labels, Counter>::default(),
        );
        let mut values = |name: &str, help: &str| register_values(&mut registry, name, help);
        let claim_usage = SampleSeries(vec![
            (
                values(
                    "tessera_dra_claim_memory_used_bytes",
                    "GPU memory the claim's live processes use on the device (context, modules, buffers)",
                ),
                sample::memory_used,
            ),
            (
                values(
                    "tessera_dra_claim_memory_limit_bytes",
                    "The claim's memory limit on the device, as its shim enforces it",
                ),
                sample::memory_limit,
            ),
            (
                values(
                    "tessera_dra_claim_sm_limit_percent",
                    "The claim's SM limit on the device in percent (0 or 100: none)",
                ),
                sample::sm_limit,
            ),
            (
                values(
                    "tessera_dra_claim_sm_utilization_percent",
                    "SM utilization of the claim's live processes on the device, summed, as the shim measures it",
                ),
                sample::sm_util,
            ),
            (
                values(
                    "tessera_dra_claim_last_kernel_elapsed_seconds",
                    "Seconds since the claim's last kernel launch (absent until one ran)",
                ),
                sample::last_kernel_elapsed,
            ),
        ]);
        tessera_runtime::register_build_info(&mut registry, env!("CARGO_PKG_VERSION"));
        DraMetrics {
            registry: ExposedRegistry::new(registry),
            prepare_seconds,
            prepares,
            unprepares,
            prepared_claims,
            registrations,
            gpu_healthy,
            slice_syncs,
            unaccounted_processes,
            undetermined_processes,
            unaccounted_actions,
            claim_usage,
        }
    }

    /// Replaces every per-claim series with `samples` (one per claim and device; `pod_uid` is
    /// the claim's UID): claims that went away disappear. A sample whose claim is not in `names`
    /// (prepared after the names were read) keeps its UID as the name. `now_unix_secs` dates
    /// the last kernel.
    pub fn set_claim_usage(&self, samples: &[VgpuSample], names: &ClaimNames, now_unix_secs: u64) {
        self.registry
            .replace(|| self.replace_claim_usage(samples, names, now_unix_secs));
    }

    fn replace_claim_usage(&self, samples: &[VgpuSample], names: &ClaimNames, now_unix_secs: u64) {
        self.claim_usage.clear();
        for s in samples {
            let (ns, name) = names
                .get(&s.pod_uid)
                .cloned()
                .unwrap_or_else(|| (String::new(), s.pod_uid.clone()));
            let labels = vec![
                ("namespace".into(), ns),
                ("claim".into(), name),
                ("vdevice_index".into(), s.vdevice_index.to_string()),
                ("device_uuid".into(), s.device_uuid.clone()),
            ];
            self.claim_usage.set(&labels, s, now_unix_secs);
        }
    }

    pub fn observe_prepare(&self, took: Duration, ok: bool) {
        self.prepare_seconds.observe(took.as_secs_f64());
        self.prepares.get_or_create(&result_labels(ok)).inc();
    }

    pub fn observe_unprepare(&self, ok: bool) {
        self.unprepares.get_or_create(&result_labels(ok)).inc();
    }

    pub fn set_prepared_claims(&self, n: usize) {
        self.prepared_claims
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn registered(&self) {
        self.registrations.inc();
    }

    pub fn gpu_health(&self, uuid: &str, healthy: bool) {
        self.gpu_healthy
            .get_or_create(&vec![("device_uuid".into(), uuid.into())])
            .set(i64::from(healthy));
    }

    pub fn slice_sync(&self, ok: bool) {
        self.slice_syncs.get_or_create(&result_labels(ok)).inc();
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        self.registry.encode()
    }
}

impl UnaccountedMetrics for DraMetrics {
    fn set_unaccounted(&self, per_reason: &[(&'static str, usize)], undetermined: usize) {
        for (reason, count) in per_reason {
            self.unaccounted_processes
                .get_or_create(&vec![("reason".into(), (*reason).into())])
                .set(i64::try_from(*count).unwrap_or(i64::MAX));
        }
        self.undetermined_processes
            .set(i64::try_from(undetermined).unwrap_or(i64::MAX));
    }

    fn unaccounted_action(&self, action: &'static str) {
        self.unaccounted_actions
            .get_or_create(&vec![("action".into(), action.into())])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_what_an_operator_watches() {
        let m = DraMetrics::new();
        m.observe_prepare(Duration::from_millis(3), true);
        m.observe_prepare(Duration::from_millis(1), false);
        m.observe_unprepare(true);
        m.set_prepared_claims(4);
        m.registered();
        m.gpu_health("GPU-a", false);
        m.slice_sync(true);
        m.set_unaccounted(&[("GpuNotBooked", 2), ("GpuProcessWithoutShim", 0)], 1);
        m.unaccounted_action("evicted");
        let sample = |uid: &str, used: u64, last_kernel_time: u64| VgpuSample {
            pod_uid: uid.into(),
            container: String::new(),
            vdevice_index: 0,
            device_uuid: "GPU-a".into(),
            memory_used_bytes: used,
            memory_limit_bytes: 1 << 30,
            context_bytes: 0,
            module_bytes: 0,
            buffer_bytes: 0,
            host_memory_bytes: 0,
            sm_limit: 25,
            sm_util: 12,
            last_kernel_time,
        };
        let names = ClaimNames::from([("uid-1".into(), ("team".into(), "share".into()))]);
        m.set_claim_usage(&[sample("uid-gone", 1, 0)], &names, 1000);
        m.set_claim_usage(&[sample("uid-1", 512 << 20, 990)], &names, 1000);
        let text = m.encode();
        assert!(
            !text.contains("uid-gone"),
            "a gone claim's series stayed:\n{text}"
        );
        for line in [
            r#"tessera_dra_plugin_prepares_total{result="success"} 1"#,
            r#"tessera_dra_plugin_prepares_total{result="failure"} 1"#,
            r#"tessera_dra_plugin_unprepares_total{result="success"} 1"#,
            "tessera_dra_plugin_prepared_claims 4",
            "tessera_dra_plugin_kubelet_registrations_total 1",
            r#"tessera_dra_plugin_gpu_healthy{device_uuid="GPU-a"} 0"#,
            r#"tessera_dra_plugin_resource_slice_syncs_total{result="success"} 1"#,
            "tessera_dra_plugin_prepare_duration_seconds_count 2",
            r#"tessera_dra_plugin_unaccounted_gpu_processes{reason="GpuNotBooked"} 2"#,
            r#"tessera_dra_plugin_unaccounted_gpu_processes{reason="GpuProcessWithoutShim"} 0"#,
            "tessera_dra_plugin_undetermined_gpu_processes 1",
            r#"tessera_dra_plugin_unaccounted_actions_total{action="evicted"} 1"#,
            r#"tessera_dra_claim_memory_used_bytes{namespace="team",claim="share",vdevice_index="0",device_uuid="GPU-a"} 536870912.0"#,
            r#"tessera_dra_claim_memory_limit_bytes{namespace="team",claim="share",vdevice_index="0",device_uuid="GPU-a"} 1073741824.0"#,
            r#"tessera_dra_claim_sm_limit_percent{namespace="team",claim="share",vdevice_index="0",device_uuid="GPU-a"} 25.0"#,
            r#"tessera_dra_claim_sm_utilization_percent{namespace="team",claim="share",vdevice_index="0",device_uuid="GPU-a"} 12.0"#,
            r#"tessera_dra_claim_last_kernel_elapsed_seconds{namespace="team",claim="share",vdevice_index="0",device_uuid="GPU-a"} 10.0"#,
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
