//! Faults on real nodes. The cluster starts on the previous release (`e2e/previous-release.sh`:
//! its daemons, shim and chart, built from this repository's history); long-running GPU jobs
//! hold most of the cluster's GPU memory; then one thing happens at a time: `helm upgrade` to
//! this version during a burst of GPU pods, the kubelet, containerd and the device-plugin pod
//! restarted, `helm upgrade` back to the previous release (a downgrade) during a burst and up
//! again, the tessera-scheduler Deployment rolled during a burst, the API server restarted, a
//! Node object deleted under its running GPU pods. After each, the running jobs still run with
//! their own devices and limits (their latest report from inside; one process that loaded the
//! shim before the upgrade still refuses past its limit), new pods are placed and see their own
//! limits and the shim of the version that runs, a pod that only fits if the books forgot a
//! running job is not placed, and no GPU is over-booked. Across each upgrade the host's
//! `libvgpu.so` is only ever one of the two versions' files, never a partly written one.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::probe::{self, Report, Slice, Steady};
use tessera_e2e::real::{
    self, ChartValues, NAMESPACE, PreviousInstall, RealCluster, RealClusterOptions, RealNodeSpec,
};
use tessera_e2e::{Error, Result, eventually};

const TENANT: &str = "jobs";
const A100: &str = "a100-node";
const T4: &str = "t4-node";
const A100_MIB: u64 = 40960;
const T4_MIB: u64 = 15360;

/// The long-running jobs: 30000 MiB on each A100, 12000 MiB on the T4. Afterwards no GPU has
/// 20000 MiB free.
const JOBS: [(&str, &str, Slice); 3] = [
    ("job-a", A100, Slice::mib(1, 30000)),
    ("job-b", A100, Slice::mib(1, 30000)),
    ("job-t4", T4, Slice::mib(1, 12000).with_cores(40)),
];
/// Fits only if the books forgot a job.
const TOO_BIG: Slice = Slice::mib(1, 20000);

/// A job that loaded the shim once, before the upgrade, and keeps allocating through it: an
/// 8000 MiB slice of an A100, 4000 MiB of it held.
const STEADY: &str = "steady";
const STEADY_JOB: Steady = Steady {
    slice: Slice::mib(1, 8000),
    held_mib: 4000,
};
/// Where containers find the shim (the chart's `devicePlugin.libPath`).
const SHIM_IN_CONTAINER: &str = "/usr/local/vgpu/libvgpu.so";

fn pod(name: &str, node: Option<&str>, slice: &Slice, forever: bool) -> Pod {
    let main = probe::container("main", slice, forever);
    probe::pod(TENANT, name, node, Vec::new(), vec![main])
}

/// The running jobs' containers: same container (no restart), Running, and their latest
/// report is their own slice.
async fn jobs_keep_their_limits(c: &RealCluster, after: &str, uids: &BTreeMap<String, String>) {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    for (name, _, slice) in JOBS.iter().filter(|(n, _, _)| uids.contains_key(*n)) {
        let name = *name;
        let slice = *slice;
        let r = eventually(
            &format!("{name} to report its own limits after {after}"),
            Duration::from_secs(90),
            Duration::from_secs(1),
            || async {
                let p = pods.get_opt(name).await.ok().flatten()?;
                let st = p.status.clone()?;
                let cs = st.container_statuses.clone()?.into_iter().next()?;
                let running = cs.state.as_ref().and_then(|s| s.running.as_ref()).is_some();
                let logs = c.logs(TENANT, name, "main").await.ok()?;
                (running && probe::judge(&logs, &slice, true) == Report::Own)
                    .then_some((p.metadata.uid.clone().unwrap_or_default(), cs.restart_count))
            },
        )
        .await;
        match r {
            Ok((uid, restarts)) => {
                assert_eq!(
                    Some(&uid),
                    uids.get(name),
                    "{name} was replaced after {after}"
                );
                assert_eq!(restarts, 0, "{name} restarted after {after}");
            }
            Err(e) => panic!("{e}\n{}", c.describe_pods(TENANT).await),
        }
    }
}

async fn no_gpu_overbooked(c: &RealCluster, after: &str) -> Result<()> {
    let nodes = Api::<Node>::all(c.admin().clone())
        .list(&ListParams::default())
        .await?
        .items;
    let pods = Api::<Pod>::all(c.admin().clone())
        .list(&ListParams::default())
        .await?
        .items;
    let v = tessera_e2e::booking::violations(&nodes, &pods);
    assert!(v.is_empty(), "over-booked after {after}:\n{}", v.join("\n"));
    Ok(())
}

/// A new small pod on `node` runs with its own limits and the shim of the version that runs
/// (`shim`: its SHA-256), and a pod that fits only if the books forgot a running job stays
/// unplaced meanwhile.
async fn new_pods_are_placed_and_nothing_overbooked(
    c: &RealCluster,
    after: &str,
    node: &str,
    shim: &str,
) -> Result<()> {
    let small = Slice::mib(1, 1000 + after.len() as u64);
    let small_name = format!("new-{after}");
    let big_name = format!("too-big-{after}");
    c.create_pod_as_user(&pod(&big_name, None, &TOO_BIG, false))
        .await?;
    let mut main = probe::container("main", &small, false);
    let script = main["command"][2].as_str().unwrap_or_default().to_owned();
    main["command"][2] = json!(format!("sha256sum {SHIM_IN_CONTAINER}; {script}"));
    c.create_pod_as_user(&probe::pod(
        TENANT,
        &small_name,
        Some(node),
        Vec::new(),
        vec![main],
    ))
    .await?;
    let done = c
        .wait_finished(TENANT, &small_name, Duration::from_secs(120))
        .await?;
    assert_eq!(
        done.status.and_then(|s| s.phase).as_deref(),
        Some("Succeeded"),
        "{small_name}\n{}",
        c.describe_pods(TENANT).await
    );
    let logs = c.logs(TENANT, &small_name, "main").await?;
    assert_eq!(
        probe::judge(&logs, &small, false),
        Report::Own,
        "{small_name}: {logs}"
    );
    assert!(
        logs.lines()
            .any(|l| l.starts_with(shim) && l.ends_with(SHIM_IN_CONTAINER)),
        "{small_name} did not get the shim of the version that runs ({shim}): {logs}"
    );
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let big = pods.get(&big_name).await?;
    assert_eq!(
        big.spec.and_then(|s| s.node_name),
        None,
        "{big_name} was placed after {after}: the books forgot a running job"
    );
    no_gpu_overbooked(c, after).await?;
    c.delete_pod(TENANT, &small_name).await?;
    c.delete_pod(TENANT, &big_name).await?;
    Ok(())
}

/// The node is Ready and advertises its GPUs again (the plugin registered with the kubelet).
async fn node_serves_gpus(c: &RealCluster, node: &str) -> Result<()> {
    let nodes: Api<Node> = Api::all(c.admin().clone());
    eventually(
        &format!("{node} Ready with nvidia.com/gpu allocatable"),
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let n = nodes.get_opt(node).await.ok().flatten()?;
            let st = n.status?;
            let ready = st
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let gpus = st
                .allocatable?
                .get("nvidia.com/gpu")
                .is_some_and(|q| q.0 != "0");
            (ready && gpus).then_some(())
        },
    )
    .await
}

async fn scheduler_rolled_out(c: &RealCluster) -> Result<()> {
    let deploys: Api<Deployment> = Api::namespaced(c.admin().clone(), NAMESPACE);
    eventually(
        "the tessera-scheduler Deployment rolled out",
        Duration::from_secs(180),
        Duration::from_millis(500),
        || async {
            let list = deploys.list(&ListParams::default()).await.ok()?;
            list.items
                .iter()
                .all(|d| {
                    let st = d.status.clone().unwrap_or_default();
                    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                    st.observed_generation == d.metadata.generation
                        && st.updated_replicas.unwrap_or(0) == want
                        && st.available_replicas.unwrap_or(0) == want
                        && st.replicas.unwrap_or(0) == want
                })
                .then_some(())
        },
    )
    .await
}

/// Patches every Deployment of the release so that it rolls (`kubectl rollout restart`).
async fn restart_deployments(c: &RealCluster) -> Result<()> {
    let deploys: Api<Deployment> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let patch = json!({"spec": {"template": {"metadata": {"annotations": {
        "kubectl.kubernetes.io/restartedAt": "e2e-rollout"}}}}});
    for d in deploys.list(&ListParams::default()).await?.items {
        let name = d.metadata.name.unwrap_or_default();
        deploys
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    Ok(())
}

/// Twelve small pods at once while `roll` rolls the release: each runs with its own limits and
/// no GPU is over-booked. A pod the kubelet refused at admission (`UnexpectedAdmissionError`:
/// bound while the node's device plugin was being replaced) is created again, as its owner
/// would; such refusals are printed.
async fn burst_during(
    c: &RealCluster,
    label: &str,
    roll: impl std::future::Future<Output = Result<()>>,
) -> Result<()> {
    let slices: Vec<(String, Slice)> = (0..12)
        .map(|i| (format!("{label}-{i}"), Slice::mib(1, 300 + 10 * i)))
        .collect();
    let creates = slices
        .iter()
        .map(|(n, s)| async { c.create_pod_as_user(&pod(n, None, s, false)).await });
    let (created, rolled) = tokio::join!(join_all(creates), roll);
    rolled?;
    for r in created {
        r?;
    }
    let mut refused = Vec::new();
    for (name, slice) in &slices {
        let mut attempts = 0;
        let done = loop {
            let done = c
                .wait_finished(TENANT, name, Duration::from_secs(240))
                .await?;
            let status = done.status.clone().unwrap_or_default();
            if status.reason.as_deref() == Some("UnexpectedAdmissionError") && attempts < 3 {
                attempts += 1;
                refused.push(format!("{name}: {}", status.message.unwrap_or_default()));
                c.delete_pod(TENANT, name).await?;
                c.create_pod_as_user(&pod(name, None, slice, false)).await?;
                continue;
            }
            break done;
        };
        assert_eq!(
            done.status.and_then(|s| s.phase).as_deref(),
            Some("Succeeded"),
            "{name}\n{}",
            c.describe_pods(TENANT).await
        );
        let logs = c.logs(TENANT, name, "main").await?;
        assert_eq!(
            probe::judge(&logs, slice, false),
            Report::Own,
            "{name}: {logs}"
        );
    }
    println!(
        "{label}: {} pods placed during the roll, {} refused at admission and created again{}",
        slices.len(),
        refused.len(),
        refused
            .iter()
            .map(|r| format!("\n  {r}"))
            .collect::<String>()
    );
    no_gpu_overbooked(c, label).await?;
    for (name, _) in &slices {
        c.delete_pod(TENANT, name).await?;
    }
    scheduler_rolled_out(c).await
}

fn sha256_of(path: &std::path::Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let bytes =
        std::fs::read(path).map_err(|e| Error::msg(format!("reading {}: {e}", path.display())))?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

/// Hashes the node's `libvgpu.so` every 20 ms until stopped: every version of the file a
/// container starting at that moment could have been given, with how often it was seen.
struct ShimWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<BTreeMap<String, u32>>,
}

impl ShimWatch {
    fn start(path: std::path::PathBuf) -> ShimWatch {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = BTreeMap::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let h = sha256_of(&path).unwrap_or_else(|e| format!("unreadable: {e}"));
                *seen.entry(h).or_insert(0) += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        });
        ShimWatch { stop, thread }
    }

    fn finish(self) -> BTreeMap<String, u32> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The device-plugin pod on `node`, if any.
async fn plugin_pod_on(c: &RealCluster, node: &str) -> Result<Option<Pod>> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/component=device-plugin");
    Ok(pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)))
}

/// Waits until the tenant's pod `name` is Running.
async fn running(c: &RealCluster, name: &str) -> Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    eventually(
        &format!("{name} running"),
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            pods.get_opt(name)
                .await
                .ok()
                .flatten()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        },
    )
    .await
}

/// Waits until the device-plugin pod on `node` is Ready (its readiness probe passes only once it
/// is registered with the kubelet) and is not the pod `replaced` (a UID).
async fn plugin_ready_on(c: &RealCluster, node: &str, replaced: Option<&str>) -> Result<()> {
    eventually(
        &format!("a Ready device-plugin pod on {node}"),
        Duration::from_secs(120),
        Duration::from_millis(250),
        || async {
            let p = plugin_pod_on(c, node).await.ok().flatten()?;
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let ready = p
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            (ready && Some(uid.as_str()) != replaced && p.metadata.deletion_timestamp.is_none())
                .then_some(())
        },
    )
    .await
}

/// Deletes the device-plugin pod on `node` and waits for its replacement to be Ready.
async fn replace_plugin_pod_on(c: &RealCluster, node: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let old = plugin_pod_on(c, node)
        .await?
        .ok_or_else(|| Error::msg(format!("no device-plugin pod on {node}")))?;
    pods.delete(
        old.metadata.name.as_deref().unwrap_or_default(),
        &DeleteParams::default(),
    )
    .await?;
    plugin_ready_on(c, node, old.metadata.uid.as_deref()).await
}

/// The previous release's install: the recommended values, its own images.
fn previous_values(previous: &PreviousInstall) -> ChartValues {
    ChartValues::Recommended(vec![("global.imageTag".into(), previous.tag.clone())])
}

/// This version's install: the recommended values.
fn current_values() -> ChartValues {
    ChartValues::Recommended(Vec::new())
}

#[test]
fn real_nodes_running_jobs_survive_faults_and_nothing_is_overbooked() -> Result<()> {
    real::run(2, |net| async move {
        let mut c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-faults".into(),
                nodes: vec![
                    RealNodeSpec::gpu(NodeSpec::uniform(
                        A100,
                        2,
                        "NVIDIA A100-SXM4-40GB",
                        A100_MIB,
                    )),
                    RealNodeSpec::gpu(NodeSpec::uniform(T4, 1, "Tesla T4", T4_MIB)),
                ],
                chart: ChartValues::None,
            },
        )
        .await?;
        let previous = c.import_previous_release().await?;
        c.helm_install_chart(&previous.chart, &previous_values(&previous))
            .await?;
        c.tenant_namespace(TENANT).await?;
        let r = faults(&mut c, &previous).await;
        if let Err(e) = r {
            panic!("{e}\n{}", c.describe_pods(TENANT).await);
        }
        Ok(())
    })
}

/// `helm upgrade` of the whole release to `chart` (this version's when `None`) during a burst of
/// GPU pods, until every daemon rolled and both nodes serve GPUs again; meanwhile the A100
/// node's `libvgpu.so` is only ever the file of version `from` or `to` (SHA-256), and `to`'s
/// afterwards, on both nodes.
async fn roll_release(
    c: &RealCluster,
    label: &str,
    chart: Option<&std::path::Path>,
    values: &ChartValues,
    from: &str,
    to: &str,
) -> Result<()> {
    let node = |n: &str| c.node(n).ok_or_else(|| Error::msg(format!("no node {n}")));
    let watch = ShimWatch::start(node(A100)?.vgpu_file("libvgpu.so"));
    let rolled = async {
        burst_during(c, label, c.helm_upgrade_chart(chart, values)).await?;
        c.wait_plugin_rolled_out().await?;
        for n in [A100, T4] {
            plugin_ready_on(c, n, None).await?;
            node_serves_gpus(c, n).await?;
        }
        Ok::<(), Error>(())
    }
    .await;
    let seen = watch.finish();
    rolled?;
    let count = |h: &str| seen.get(h).copied().unwrap_or(0);
    println!(
        "{label}: the host's libvgpu.so read {} times as the old version's file, {} as the new one's",
        count(from),
        count(to)
    );
    let partial: Vec<_> = seen.keys().filter(|h| *h != from && *h != to).collect();
    assert!(
        partial.is_empty(),
        "during the {label}, the host's libvgpu.so was neither version's file: {partial:?} \
         (seen: {seen:?}; from {from}, to {to})"
    );
    for n in [A100, T4] {
        assert_eq!(
            sha256_of(&node(n)?.vgpu_file("libvgpu.so"))?,
            to,
            "{n}'s libvgpu.so after the {label}"
        );
    }
    Ok(())
}

/// Issue 34 item 2: a real Prometheus scrapes the daemons as the Prometheus Operator would for
/// the chart's ServiceMonitors (honorLabels) and loads the chart's PrometheusRule. Every query of
/// the Grafana dashboard returns series carrying the labels its legend and grouping name (the
/// refusals panel may be empty: nothing here is refused but for lack of room), every alert
/// evaluates without error, and every series an alert reads exists with the labels it groups by
/// (an application XID is injected for the XID counter).
async fn monitoring_works_as_shipped(c: &RealCluster) -> Result<()> {
    use k8s_openapi::api::core::v1::ResourceQuota;
    use tessera_e2e::prometheus::{self, Prometheus};
    let a = tessera_e2e::artifacts::artifacts().map_err(|e| Error::msg(e.to_string()))?;
    if !a.prometheus.is_file() {
        return Err(Error::msg(format!(
            "{} not found: run e2e/tools.sh (make e2e does)",
            a.prometheus.display()
        )));
    }
    // What the panels show: a namespace budget, a pod that fits nowhere.
    let quotas: Api<ResourceQuota> = Api::namespaced(c.admin().clone(), TENANT);
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "gpu-budget", "namespace": TENANT},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "1000000"}},
    }))?;
    quotas.create(&Default::default(), &quota).await?;
    c.create_pod_as_user(&pod("fits-nowhere", None, &TOO_BIG, false))
        .await?;
    // An application XID (13: the GPU stays healthy, the alert ignores it, the counter counts it).
    c.node(T4)
        .ok_or_else(|| Error::msg("no node"))?
        .nvml_event(&json!({"device": 0, "kind": "xid", "xid": 13}))?;
    // A container that launches kernels (the last-kernel and utilisation panels).
    let mut kernels = probe::container("main", &Slice::mib(1, 500), false);
    kernels["command"] = json!(["/usr/bin/cuda_probe", "busy", "90", "1"]);
    c.create_pod_as_user(&probe::pod(
        TENANT,
        "kernels",
        Some(T4),
        Vec::new(),
        vec![kernels],
    ))
    .await?;
    running(c, "kernels").await?;
    // The chart as installed, with its ServiceMonitors and PrometheusRule rendered.
    let out = std::process::Command::new(&a.helm)
        .arg("template")
        .arg(real::RELEASE)
        .arg(a.root.join("charts/tessera"))
        .args(["--namespace", NAMESPACE])
        .args(
            real::RECOMMENDED_SETS
                .iter()
                .flat_map(|(k, v)| ["--set".to_owned(), format!("{k}={v}")]),
        )
        .args([
            "--set",
            "serviceMonitor.enabled=true",
            "--set",
            "prometheusRule.enabled=true",
        ])
        .output()?;
    if !out.status.success() {
        return Err(Error::msg(format!(
            "helm template: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let objects = tessera_e2e::yaml_documents(&String::from_utf8_lossy(&out.stdout))?;
    let dir = c.dir.join("prometheus");
    std::fs::create_dir_all(&dir)?;
    let token_file = dir.join("token");
    std::fs::write(&token_file, c.scrape_token().await?)?;
    let scrape = prometheus::scrape_configs(&objects, &c.kubeconfig_admin(), &token_file, "2s");
    let p = Prometheus::start(
        &a.prometheus,
        &dir,
        &c.dir.join("logs"),
        scrape,
        &prometheus::rule_groups(&objects),
        "2s",
    )?;
    // The scheduler and both nodes' device plugins, then enough scrapes for 5-minute rates.
    p.wait_targets_up(3, Duration::from_secs(90)).await?;
    tokio::time::sleep(Duration::from_secs(12)).await;

    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        a.root.join("charts/tessera/files/grafana-dashboard.json"),
    )?)?;
    let mut problems = Vec::new();
    for panel in dashboard["panels"].as_array().cloned().unwrap_or_default() {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        for t in panel["targets"].as_array().cloned().unwrap_or_default() {
            // Every dashboard variable set to "All".
            let expr = ["pod_namespace", "namespace", "node"]
                .iter()
                .fold(t["expr"].as_str().unwrap_or_default().to_owned(), |e, v| {
                    e.replace(&format!("${v}"), ".*")
                });
            let series = match p.query(&expr).await {
                Ok(s) => s,
                Err(e) => {
                    problems.push(format!("{title}: {expr}: {e}"));
                    continue;
                }
            };
            let legend = t["legendFormat"].as_str().unwrap_or_default();
            // `le` is consumed by histogram_quantile.
            let mut wanted: Vec<String> = prometheus::grouped_by(&expr)
                .into_iter()
                .filter(|l| l != "le")
                .collect();
            for part in legend.split("{{").skip(1) {
                if let Some((label, _)) = part.split_once("}}") {
                    let label = label.trim().to_owned();
                    if !wanted.contains(&label) {
                        wanted.push(label);
                    }
                }
            }
            let refusals = expr.contains("tessera_scheduler_decisions_total");
            if series.is_empty() && !refusals {
                problems.push(format!("{title}: {expr}: no series"));
            }
            for s in &series {
                let missing: Vec<_> = wanted.iter().filter(|l| !s.contains_key(*l)).collect();
                if !missing.is_empty() {
                    problems.push(format!(
                        "{title}: {expr}: a series without {missing:?}: {s:?}"
                    ));
                }
            }
            // Per-container series name the tenant's pod, not the plugin's (honorLabels).
            if wanted.iter().any(|l| l == "container") {
                let own = series
                    .iter()
                    .any(|s| s.get("namespace").and_then(|v| v.as_str()) == Some(TENANT));
                if !own {
                    problems.push(format!(
                        "{title}: {expr}: no series of namespace {TENANT}: {series:?}"
                    ));
                }
            }
        }
    }
    for rule in p.rules().await? {
        let name = rule["name"].as_str().unwrap_or_default();
        if rule["health"] == "err" {
            problems.push(format!("alert {name}: {}", rule["lastError"]));
        }
        let expr = rule["query"].as_str().unwrap_or_default();
        let metrics = prometheus::metric_names(expr);
        // An alert over several exporters (`A or B`) needs one of them here: the DRA plugin's
        // series exist only with DRA nodes.
        let mut present = Vec::new();
        for m in &metrics {
            let by = prometheus::grouped_by(expr);
            let series = p.query(m).await.unwrap_or_default();
            if !series.is_empty() {
                let missing: Vec<_> = by
                    .iter()
                    .filter(|l| *l != "le" && series.iter().all(|s| !s.contains_key(*l)))
                    .collect();
                if !missing.is_empty() && !m.ends_with("_bucket") {
                    problems.push(format!("alert {name}: {m} has no {missing:?}"));
                }
                present.push(m.clone());
            }
        }
        // A series that exists only while its event lasts: a second device plugin.
        let event_only = metrics.iter().all(|m| m.ends_with("_plugin_conflict"));
        if present.is_empty() && !event_only {
            problems.push(format!("alert {name}: none of {metrics:?} is exported"));
        }
        println!("alert {name}: health {}, reads {present:?}", rule["health"]);
    }
    assert!(
        problems.is_empty(),
        "the dashboard and alerts on the real daemons:\n{}",
        problems.join("\n")
    );
    c.delete_pod(TENANT, "fits-nowhere").await?;
    c.delete_pod(TENANT, "kernels").await?;
    quotas.delete("gpu-budget", &Default::default()).await?;
    Ok(())
}

async fn faults(c: &mut RealCluster, previous: &PreviousInstall) -> Result<()> {
    let old_shim = sha256_of(&previous.shim)?;
    let new_shim = sha256_of(
        &tessera_e2e::artifacts::artifacts()
            .map_err(|e| Error::msg(e.to_string()))?
            .shim,
    )?;
    assert_ne!(
        old_shim, new_shim,
        "the previous release's shim is byte for byte this one: the upgrade could not be told apart"
    );
    let steady = STEADY_JOB.container("main");
    c.create_pod_as_user(&probe::pod(
        TENANT,
        STEADY,
        Some(A100),
        Vec::new(),
        vec![steady],
    ))
    .await?;
    for (name, node, slice) in JOBS {
        c.create_pod_as_user(&pod(name, Some(node), &slice, true))
            .await?;
    }
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let mut uids = BTreeMap::new();
    for name in JOBS.iter().map(|(n, _, _)| *n).chain([STEADY]) {
        let p = running(c, name).await?;
        uids.insert(name.to_owned(), p.metadata.uid.unwrap_or_default());
    }
    let steady_uid = uids.get(STEADY).cloned().unwrap_or_default();
    assert_eq!(
        sha256_of(
            &c.node(A100)
                .ok_or_else(|| Error::msg("no node"))?
                .vgpu_file("libvgpu.so")
        )?,
        old_shim,
        "the previous release's shim on the host"
    );
    jobs_keep_their_limits(c, "start", &uids).await;
    let mut steady_n = STEADY_JOB
        .keeps_enforcing(c, TENANT, STEADY, &steady_uid, 0, "start")
        .await;
    STEADY_JOB.usage_is_read(c, A100, STEADY, "start").await?;
    new_pods_are_placed_and_nothing_overbooked(c, "start", A100, &old_shim).await?;

    println!(
        "upgrade: helm upgrade from the previous release ({}) to this version during a burst",
        previous.rev
    );
    roll_release(c, "upgrade", None, &current_values(), &old_shim, &new_shim).await?;
    jobs_keep_their_limits(c, "upgrade", &uids).await;
    steady_n = STEADY_JOB
        .keeps_enforcing(c, TENANT, STEADY, &steady_uid, steady_n, "upgrade")
        .await;
    STEADY_JOB.usage_is_read(c, A100, STEADY, "upgrade").await?;
    new_pods_are_placed_and_nothing_overbooked(c, "upgrade", A100, &new_shim).await?;

    println!("monitoring: a real Prometheus on the daemons, the dashboard and the alerts");
    monitoring_works_as_shipped(c).await?;

    println!("fault: kubelet restart");
    c.node(A100)
        .ok_or_else(|| Error::msg("no node"))?
        .restart_kubelet()?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "kubelet restart", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "kubelet", A100, &new_shim).await?;

    println!("fault: containerd restart");
    c.node(A100)
        .ok_or_else(|| Error::msg("no node"))?
        .restart_containerd()?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "containerd restart", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "containerd", A100, &new_shim).await?;

    println!("fault: device-plugin pod deleted");
    replace_plugin_pod_on(c, A100).await?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "plugin pod deleted", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "plugin", A100, &new_shim).await?;

    println!("downgrade: helm upgrade back to the previous release during a burst");
    roll_release(
        c,
        "downgrade",
        Some(&previous.chart),
        &previous_values(previous),
        &new_shim,
        &old_shim,
    )
    .await?;
    jobs_keep_their_limits(c, "downgrade", &uids).await;
    steady_n = STEADY_JOB
        .keeps_enforcing(c, TENANT, STEADY, &steady_uid, steady_n, "downgrade")
        .await;
    STEADY_JOB
        .usage_is_read(c, A100, STEADY, "downgrade")
        .await?;
    new_pods_are_placed_and_nothing_overbooked(c, "downgrade", T4, &old_shim).await?;

    println!("upgrade again: to this version during a burst");
    roll_release(
        c,
        "reupgrade",
        None,
        &current_values(),
        &old_shim,
        &new_shim,
    )
    .await?;
    jobs_keep_their_limits(c, "second upgrade", &uids).await;
    STEADY_JOB
        .keeps_enforcing(c, TENANT, STEADY, &steady_uid, steady_n, "second upgrade")
        .await;
    new_pods_are_placed_and_nothing_overbooked(c, "reupgrade", A100, &new_shim).await?;

    println!("fault: tessera-scheduler rollout during a burst");
    burst_during(c, "rollout", restart_deployments(c)).await?;
    jobs_keep_their_limits(c, "scheduler rollout", &uids).await;

    println!("fault: kube-apiserver restart");
    c.restart_apiserver(Duration::from_secs(3)).await?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "apiserver restart", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "apiserver", A100, &new_shim).await?;

    // The Node object of the T4 node is deleted under its running job. Kubernetes' pod garbage
    // collector deletes pods bound to a node that no longer exists; the kubelet, restarted by
    // the operator, registers the node again and the plugin publishes its GPUs again. The job's
    // booking must not survive it, and nothing may be placed on the node while it is gone.
    println!("fault: node object deleted under a running GPU job");
    let nodes: Api<Node> = Api::all(c.admin().clone());
    nodes.delete(T4, &DeleteParams::default()).await?;
    eventually(
        "the pod garbage collector to delete job-t4",
        Duration::from_secs(120),
        Duration::from_secs(1),
        || async {
            pods.get_opt("job-t4")
                .await
                .ok()
                .and_then(|p| p.is_none().then_some(()))
        },
    )
    .await?;
    c.node(T4)
        .ok_or_else(|| Error::msg("no node"))?
        .restart_kubelet()?;
    node_serves_gpus(c, T4).await?;
    // 12000 MiB fit on the T4 again only if the deleted job's booking is gone.
    let again = Slice::mib(1, 12000).with_cores(40);
    c.create_pod_as_user(&pod("t4-again", Some(T4), &again, false))
        .await?;
    let done = c
        .wait_finished(TENANT, "t4-again", Duration::from_secs(120))
        .await?;
    assert_eq!(
        done.status.and_then(|s| s.phase).as_deref(),
        Some("Succeeded")
    );
    let logs = c.logs(TENANT, "t4-again", "main").await?;
    assert_eq!(
        probe::judge(&logs, &again, false),
        Report::Own,
        "t4-again: {logs}"
    );
    uids.remove("job-t4");
    jobs_keep_their_limits(c, "node deletion", &uids).await;
    no_gpu_overbooked(c, "node deletion").await?;
    Ok(())
}
