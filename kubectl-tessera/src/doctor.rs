//! `kubectl tessera doctor`: is the installation whole, and if not, what to do. The checks are
//! pure functions of the objects read ([`Facts`]); each failure names its fix.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::state::NodeRecord;

/// The label every chart object carries with its part.
pub const COMPONENT: &str = "app.kubernetes.io/component";
const NAME: &str = "app.kubernetes.io/name";

/// What the checks read.
#[derive(Debug, Default)]
pub struct Facts {
    /// Deployments labelled `app.kubernetes.io/component=scheduler`, every namespace.
    pub schedulers: Vec<Deployment>,
    /// Every DaemonSet (the release's device plugin and any other GPU plugin).
    pub daemonsets: Vec<DaemonSet>,
    /// MutatingWebhookConfigurations labelled `app.kubernetes.io/component=webhook`.
    pub webhooks: Vec<MutatingWebhookConfiguration>,
    /// EndpointSlices of the webhooks' services.
    pub endpoints: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    /// The release's device-plugin pods.
    pub plugin_pods: Vec<Pod>,
    /// The device plugins' `UnsafeGPUDeviceList` Events on Nodes (their runtime check at start).
    pub runtime_events: Vec<Event>,
    /// This program's version (the decision code it answers with).
    pub own_version: String,
}

/// The Event reason a device plugin gives when the node's NVIDIA runtime would hand GPUs to any
/// container that names them.
pub use hami_contract::annotations::EVENT_UNSAFE_GPU_DEVICE_LIST as UNSAFE_RUNTIME_REASON;
/// The init container that installs the shim on the host (the chart's `tessera.installVgpuHook`).
const SHIM_INIT_CONTAINER: &str = "install-vgpu-hook";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

/// One finding: what was checked, what was found, and (when it is not right) what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub level: Level,
    pub check: &'static str,
    pub detail: String,
    pub fix: Option<String>,
}

pub(crate) fn finding(
    level: Level,
    check: &'static str,
    detail: String,
    fix: Option<String>,
) -> Finding {
    Finding {
        level,
        check,
        detail,
        fix,
    }
}

pub(crate) fn key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or("")
    )
    .trim_start_matches('/')
    .to_owned()
}

fn labelled(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    k: &str,
    v: &str,
) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(k))
        .is_some_and(|x| x == v)
}

/// Images of a pod template's containers, `container=image`.
pub(crate) fn images(spec: Option<&k8s_openapi::api::core::v1::PodSpec>) -> Vec<String> {
    spec.map(|s| {
        s.containers
            .iter()
            .map(|c| format!("{}={}", c.name, c.image.as_deref().unwrap_or("?")))
            .collect()
    })
    .unwrap_or_default()
}

/// Every check, in the order an operator would work through them.
pub fn check(f: &Facts, cfg: &DecisionConfig) -> Vec<Finding> {
    let mut out = Vec::new();
    schedulers(f, &mut out);
    webhooks(f, &mut out);
    let plugins: Vec<&DaemonSet> = f
        .daemonsets
        .iter()
        .filter(|d| {
            labelled(&d.metadata, COMPONENT, "device-plugin")
                && labelled(&d.metadata, NAME, "tessera")
        })
        .collect();
    device_plugins(f, &plugins, cfg, &mut out);
    shims(f, &mut out);
    runtimes(f, &mut out);
    other_plugins(f, &plugins, &mut out);
    versions(f, &plugins, &mut out);
    out
}

/// The shim on each GPU node: the plugin pod's init container installed it there (it exits 0
/// only once `libvgpu.so` and `ld.so.preload` are in place).
fn shims(f: &Facts, out: &mut Vec<Finding>) {
    for p in &f.plugin_pods {
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_else(|| "?".into());
        let ns = p.metadata.namespace.as_deref().unwrap_or("default");
        let name = p.metadata.name.as_deref().unwrap_or("");
        let status = p
            .status
            .as_ref()
            .and_then(|s| s.init_container_statuses.as_ref())
            .and_then(|st| st.iter().find(|c| c.name == SHIM_INIT_CONTAINER));
        let Some(status) = status else {
            out.push(finding(
                Level::Warn,
                "shim",
                format!("{node}: the plugin pod {ns}/{name} has no {SHIM_INIT_CONTAINER} init container status yet"),
                None,
            ));
            continue;
        };
        let done = status
            .state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .is_some_and(|t| t.exit_code == 0);
        if done {
            out.push(finding(
                Level::Ok,
                "shim",
                format!("{node}: libvgpu.so installed on the host by {ns}/{name}"),
                None,
            ));
        } else {
            out.push(finding(
                Level::Fail,
                "shim",
                format!("{node}: {SHIM_INIT_CONTAINER} of {ns}/{name} has not installed the shim"),
                Some(format!(
                    "kubectl -n {ns} logs {name} -c {SHIM_INIT_CONTAINER} (the host directory global.gpuHookPath must be writable)"
                )),
            ));
        }
    }
}

/// The node's NVIDIA runtime, as the plugins judged it at start (their Warning Events).
fn runtimes(f: &Facts, out: &mut Vec<Finding>) {
    let unsafe_nodes: BTreeMap<String, String> = f
        .runtime_events
        .iter()
        .filter(|e| e.reason.as_deref() == Some(UNSAFE_RUNTIME_REASON))
        .filter_map(|e| {
            Some((
                e.involved_object.name.clone()?,
                e.message.clone().unwrap_or_default(),
            ))
        })
        .collect();
    if unsafe_nodes.is_empty() {
        out.push(finding(
            Level::Ok,
            "runtime",
            "no device plugin reported an unsafe NVIDIA runtime configuration (they check at start; Events last about an hour)".into(),
            None,
        ));
    }
    for (node, message) in unsafe_nodes {
        out.push(finding(
            Level::Warn,
            "runtime",
            format!("{node}: {message}"),
            Some(
                "set accept-nvidia-visible-devices-as-volume-mounts = true and accept-nvidia-visible-devices-envvar-when-unprivileged = false in the toolkit's config.toml, and devicePlugin.deviceListStrategy=volume-mounts (docs/install.md)".into(),
            ),
        ));
    }
}

/// The tag of the first image of `spec` whose repository ends with `repository`; `None` for an
/// image pinned by digest only.
fn image_tag(
    spec: Option<&k8s_openapi::api::core::v1::PodSpec>,
    repository: &str,
) -> Option<String> {
    let image = spec?
        .containers
        .iter()
        .filter_map(|c| c.image.as_deref())
        .find(|i| {
            i.split(['@', ':'])
                .next()
                .is_some_and(|r| r.ends_with(repository))
        })?;
    let without_digest = image.split('@').next()?;
    let (_, tag) = without_digest
        .rsplit_once(':')
        .filter(|(r, _)| !r.ends_with('/') && !r.is_empty())?;
    (!tag.contains('/')).then(|| tag.to_owned())
}

/// The versions of the parts: the scheduler's and the plugin's images agree with each other and
/// with this program's decision code.
fn versions(f: &Facts, plugins: &[&DaemonSet], out: &mut Vec<Finding>) {
    let mut tags: BTreeMap<String, String> = BTreeMap::new();
    for d in &f.schedulers {
        if let Some(t) = image_tag(
            d.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
            "tessera-scheduler",
        ) {
            tags.insert(format!("scheduler {}", key(&d.metadata)), t);
        }
    }
    for d in plugins {
        if let Some(t) = image_tag(
            d.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
            "tessera-device-plugin",
        ) {
            tags.insert(format!("device plugin {}", key(&d.metadata)), t);
        }
    }
    let distinct: BTreeSet<&String> = tags.values().collect();
    let list = tags
        .iter()
        .map(|(part, t)| format!("{part} {t}"))
        .collect::<Vec<_>>()
        .join(", ");
    if distinct.len() > 1 {
        out.push(finding(
            Level::Warn,
            "versions",
            format!("the parts run different versions: {list}"),
            Some("finish the upgrade (helm upgrade with one chart version; kubectl -n <ns> rollout status)".into()),
        ));
    } else if let Some(running) = distinct.first() {
        let own = &f.own_version;
        if running.trim_start_matches('v') == own.trim_start_matches('v') {
            out.push(finding(
                Level::Ok,
                "versions",
                format!("{list}; kubectl-tessera {own}"),
                None,
            ));
        } else {
            out.push(finding(
                Level::Warn,
                "versions",
                format!("{list}, but this kubectl-tessera is {own}: its answers use {own}'s decision code"),
                Some(format!("install kubectl-tessera {running}")),
            ));
        }
    } else if !tags.is_empty() || !f.schedulers.is_empty() {
        out.push(finding(
            Level::Ok,
            "versions",
            "the images are pinned by digest: versions not compared".into(),
            None,
        ));
    }
}

fn schedulers(f: &Facts, out: &mut Vec<Finding>) {
    if f.schedulers.is_empty() {
        out.push(finding(
            Level::Fail,
            "scheduler",
            "no Deployment labelled app.kubernetes.io/component=scheduler in any namespace".into(),
            Some("install the chart: helm install tessera charts/tessera -n tessera-system --create-namespace (docs/helm.md)".into()),
        ));
        return;
    }
    for d in &f.schedulers {
        let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        let ready = d
            .status
            .as_ref()
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
        let k = key(&d.metadata);
        let imgs = images(d.spec.as_ref().and_then(|s| s.template.spec.as_ref())).join(", ");
        if ready >= want.max(1) {
            out.push(finding(
                Level::Ok,
                "scheduler",
                format!("{k}: {ready}/{want} ready ({imgs})"),
                None,
            ));
        } else {
            let ns = d.metadata.namespace.as_deref().unwrap_or("default");
            let name = d.metadata.name.as_deref().unwrap_or("");
            out.push(finding(
                Level::Fail,
                "scheduler",
                format!(
                    "{k}: {ready}/{want} ready: GPU pods are not scheduled, and with the webhook's \
                     failurePolicy Fail new GPU pods are refused"
                ),
                Some(format!(
                    "kubectl -n {ns} describe deployment {name}; kubectl -n {ns} logs deployment/{name} --all-containers"
                )),
            ));
        }
    }
}

fn webhooks(f: &Facts, out: &mut Vec<Finding>) {
    if f.webhooks.is_empty() {
        out.push(finding(
            Level::Warn,
            "webhook",
            "no MutatingWebhookConfiguration labelled app.kubernetes.io/component=webhook: GPU \
             pods are not sent to hami-scheduler unless they name it themselves"
                .into(),
            Some("scheduler.admissionWebhook.enabled=true in the chart's values".into()),
        ));
    }
    for cfg in &f.webhooks {
        let name = cfg.metadata.name.clone().unwrap_or_default();
        for w in cfg.webhooks.iter().flatten() {
            let ca = w
                .client_config
                .ca_bundle
                .as_ref()
                .is_some_and(|b| !b.0.is_empty());
            if !ca {
                out.push(finding(
                    Level::Fail,
                    "webhook",
                    format!("{name} / {}: no caBundle: the API server cannot call it", w.name),
                    Some("with cert-manager, check its Certificate and the cainjector; otherwise helm upgrade the release to have the chart write the bundle".into()),
                ));
                continue;
            }
            let Some(svc) = &w.client_config.service else {
                out.push(finding(
                    Level::Ok,
                    "webhook",
                    format!("{name} / {}: called by URL", w.name),
                    None,
                ));
                continue;
            };
            let ready = f.endpoints.iter().any(|s| {
                s.metadata.namespace.as_deref() == Some(svc.namespace.as_str())
                    && labelled(&s.metadata, "kubernetes.io/service-name", &svc.name)
                    && s.endpoints
                        .iter()
                        .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
            });
            if ready {
                out.push(finding(
                    Level::Ok,
                    "webhook",
                    format!(
                        "{name} / {}: service {}/{} has a ready endpoint",
                        w.name, svc.namespace, svc.name
                    ),
                    None,
                ));
            } else {
                let policy = w.failure_policy.as_deref().unwrap_or("Fail");
                out.push(finding(
                    Level::Fail,
                    "webhook",
                    format!(
                        "{name} / {}: service {}/{} has no ready endpoint (failurePolicy {policy}: {})",
                        w.name,
                        svc.namespace,
                        svc.name,
                        if policy == "Ignore" {
                            "GPU pods go to default-scheduler, unlimited"
                        } else {
                            "new GPU pods are refused"
                        }
                    ),
                    Some(format!(
                        "kubectl -n {} get pods -l {COMPONENT}=scheduler; the scheduler pod must be Ready",
                        svc.namespace
                    )),
                ));
            }
        }
    }
}

/// Whether `node` carries every label of `selector`.
fn selects(selector: Option<&BTreeMap<String, String>>, node: &Node) -> bool {
    let labels = node.metadata.labels.clone().unwrap_or_default();
    selector
        .into_iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v))
}

fn device_plugins(f: &Facts, plugins: &[&DaemonSet], cfg: &DecisionConfig, out: &mut Vec<Finding>) {
    if plugins.is_empty() {
        out.push(finding(
            Level::Fail,
            "device plugin",
            "no Tessera device-plugin DaemonSet: no node registers GPUs".into(),
            Some("devicePlugin.enabled=true in the chart's values".into()),
        ));
        return;
    }
    let resource = cfg.nvidia.resources.count.clone();
    for ds in plugins {
        let k = key(&ds.metadata);
        let ns = ds.metadata.namespace.as_deref().unwrap_or("default");
        let st = ds.status.clone().unwrap_or_default();
        let imgs = images(ds.spec.as_ref().and_then(|s| s.template.spec.as_ref())).join(", ");
        let selector = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|s| s.node_selector.as_ref());
        let selected: Vec<&Node> = f.nodes.iter().filter(|n| selects(selector, n)).collect();
        if selected.is_empty() {
            let labels = selector
                .map(|s| {
                    s.iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            out.push(finding(
                Level::Warn,
                "device plugin",
                format!("{k}: no node is labelled {labels}: no GPU node runs the plugin"),
                Some(format!("kubectl label node <gpu-node> {labels}")),
            ));
            continue;
        }
        let level = if st.number_ready >= st.desired_number_scheduled {
            Level::Ok
        } else {
            Level::Fail
        };
        out.push(finding(
            level,
            "device plugin",
            format!(
                "{k}: {}/{} ready ({imgs})",
                st.number_ready, st.desired_number_scheduled
            ),
            (level == Level::Fail).then(|| {
                format!("kubectl -n {ns} get pods -l {COMPONENT}=device-plugin -o wide; kubectl -n {ns} logs <the pod on the node>")
            }),
        ));
        let ready_on: BTreeSet<&str> = f
            .plugin_pods
            .iter()
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .filter_map(|p| p.spec.as_ref()?.node_name.as_deref())
            .collect();
        for node in selected {
            let name = node.metadata.name.clone().unwrap_or_default();
            let fix_logs = format!(
                "kubectl -n {ns} logs $(kubectl -n {ns} get pods -l {COMPONENT}=device-plugin --field-selector spec.nodeName={name} -o name)"
            );
            if !ready_on.contains(name.as_str()) {
                out.push(finding(
                    Level::Fail,
                    "node",
                    format!("{name}: the device plugin is not Ready there"),
                    Some(fix_logs),
                ));
                continue;
            }
            let Some(rec) = NodeRecord::from_node(node, cfg) else {
                continue;
            };
            if let Some(why) = &rec.unregistered {
                out.push(finding(
                    Level::Fail,
                    "node",
                    format!("{name}: no GPU usable: {why}"),
                    Some(fix_logs),
                ));
                continue;
            }
            let registered: u32 = rec.devices.iter().map(|d| d.count).sum();
            let allocatable = node
                .status
                .as_ref()
                .and_then(|s| s.allocatable.as_ref())
                .and_then(|a| a.get(&resource))
                .and_then(|q| q.0.parse::<u32>().ok())
                .unwrap_or(0);
            if allocatable != registered {
                out.push(finding(
                    Level::Warn,
                    "node",
                    format!(
                        "{name}: the kubelet advertises {allocatable} {resource}, Tessera's plugin \
                         registered {registered} ({} GPUs): another device plugin may own {resource} \
                         there, or the kubelet has not caught up",
                        rec.devices.len()
                    ),
                    Some("run one device plugin per node: switch the other off (NVIDIA GPU Operator: devicePlugin.enabled=false)".into()),
                ));
            } else {
                out.push(finding(
                    Level::Ok,
                    "node",
                    format!(
                        "{name}: {} GPU(s) registered, {registered} {resource} allocatable",
                        rec.devices.len()
                    ),
                    None,
                ));
            }
        }
    }
}

/// Another GPU device plugin (NVIDIA's, HAMi's) running beside Tessera's: both would register
/// the same resource with the kubelet, and the last to register wins.
fn other_plugins(f: &Facts, ours: &[&DaemonSet], out: &mut Vec<Finding>) {
    const OTHERS: [(&str, &str); 3] = [
        ("k8s-device-plugin", "NVIDIA's device plugin"),
        ("projecthami/hami", "HAMi's device plugin"),
        ("nvidia-device-plugin", "NVIDIA's device plugin"),
    ];
    for ds in &f.daemonsets {
        if ours.iter().any(|o| o.metadata.uid == ds.metadata.uid) {
            continue;
        }
        let imgs = images(ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()));
        let Some((_, what)) = OTHERS
            .iter()
            .find(|(pattern, _)| imgs.iter().any(|i| i.contains(pattern)))
        else {
            continue;
        };
        let scheduled = ds.status.as_ref().map_or(0, |s| s.desired_number_scheduled);
        out.push(finding(
            Level::Warn,
            "other plugin",
            format!(
                "{}: {what} ({}), on {scheduled} node(s): where it runs beside Tessera's, both \
                 register GPUs with the kubelet and pods may get GPUs Tessera did not book",
                key(&ds.metadata),
                imgs.join(", ")
            ),
            Some("keep its node selector disjoint from Tessera's, or switch it off (GPU Operator: devicePlugin.enabled=false; HAMi: helm uninstall)".into()),
        ));
    }
}

/// The findings for a terminal; the fix under each finding that needs one.
pub fn report(findings: &[Finding]) -> String {
    let mut out = String::new();
    for f in findings {
        let tag = match f.level {
            Level::Ok => "ok  ",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        out.push_str(&format!("{tag}  {:<13} {}\n", f.check, f.detail));
        if let Some(fix) = &f.fix {
            out.push_str(&format!("      {:<13} fix: {fix}\n", ""));
        }
    }
    let fails = findings.iter().filter(|f| f.level == Level::Fail).count();
    let warns = findings.iter().filter(|f| f.level == Level::Warn).count();
    out.push_str(&format!("{fails} failure(s), {warns} warning(s)\n"));
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tessera_scheduler_core::fixtures::gpu_node;

    use super::*;

    fn from<T: k8s_openapi::serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("object")
    }

    /// One release in `gpu`: a ready scheduler, its webhook with a ready endpoint, the plugin
    /// ready on the one GPU node, which registered 2 GPUs × 10 slots and advertises 20.
    fn healthy() -> Facts {
        let release = json!({"app.kubernetes.io/name": "tessera", "app.kubernetes.io/component": "device-plugin"});
        let mut node = gpu_node("n1", 2, 16384, 10);
        node.metadata.labels = Some([("gpu".to_owned(), "on".to_owned())].into());
        node.status = Some(from(json!({"allocatable": {"nvidia.com/gpu": "20"}})));
        Facts {
            schedulers: vec![from(json!({
                "metadata": {"name": "tessera-scheduler", "namespace": "gpu"},
                "spec": {"replicas": 1, "selector": {}, "template": {"spec": {"containers": [
                    {"name": "tessera-scheduler", "image": "ghcr.io/tessera-gpu/tessera-scheduler:0.1.0"}]}}},
                "status": {"readyReplicas": 1}}))],
            daemonsets: vec![from(json!({
                "metadata": {"name": "tessera-device-plugin", "namespace": "gpu", "uid": "ds1", "labels": release},
                "spec": {"selector": {}, "template": {"spec": {"nodeSelector": {"gpu": "on"}, "containers": [
                    {"name": "tessera-device-plugin", "image": "ghcr.io/tessera-gpu/tessera-device-plugin:0.1.0"}]}}},
                "status": {"desiredNumberScheduled": 1, "numberReady": 1, "currentNumberScheduled": 1, "numberMisscheduled": 0}}))],
            webhooks: vec![from(json!({
                "metadata": {"name": "tessera-webhook"},
                "webhooks": [{"name": "vgpu.hami.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                    "clientConfig": {"caBundle": "Y2E=", "service": {"name": "tessera-scheduler", "namespace": "gpu"}}}]}))],
            endpoints: vec![from(json!({
                "metadata": {"name": "tessera-scheduler-x", "namespace": "gpu",
                             "labels": {"kubernetes.io/service-name": "tessera-scheduler"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": true}}]}))],
            nodes: vec![node],
            plugin_pods: vec![from(json!({
                "metadata": {"name": "tessera-device-plugin-abc", "namespace": "gpu"},
                "spec": {"nodeName": "n1", "containers": []},
                "status": {"conditions": [{"type": "Ready", "status": "True"}],
                    "initContainerStatuses": [{"name": "install-vgpu-hook", "ready": true, "restartCount": 0,
                        "image": "x", "imageID": "", "state": {"terminated": {"exitCode": 0}}}]}}))],
            runtime_events: Vec::new(),
            own_version: "0.1.0".into(),
        }
    }

    fn levels(f: &Facts) -> Vec<(Level, &'static str, String)> {
        check(f, &DecisionConfig::default())
            .into_iter()
            .map(|x| (x.level, x.check, x.detail))
            .collect()
    }

    #[test]
    fn a_whole_installation_is_all_ok() {
        let found = levels(&healthy());
        assert!(found.iter().all(|(l, _, _)| *l == Level::Ok), "{found:?}");
        let checks: Vec<_> = found.iter().map(|(_, c, _)| *c).collect();
        assert_eq!(
            checks,
            [
                "scheduler",
                "webhook",
                "device plugin",
                "node",
                "shim",
                "runtime",
                "versions"
            ]
        );
        let report = report(&check(&healthy(), &DecisionConfig::default()));
        assert!(report.ends_with("0 failure(s), 0 warning(s)\n"), "{report}");
    }

    #[test]
    fn each_broken_part_is_named_with_its_fix() {
        // The scheduler down: not ready, and the webhook without an endpoint.
        let mut f = healthy();
        f.schedulers[0].status = Some(from(json!({"readyReplicas": 0})));
        f.endpoints.clear();
        let found = check(&f, &DecisionConfig::default());
        let fails: Vec<_> = found.iter().filter(|x| x.level == Level::Fail).collect();
        assert_eq!(fails.len(), 2, "{found:?}");
        assert!(fails[0].detail.contains("0/1 ready") && fails[0].fix.is_some());
        assert!(
            fails[1].detail.contains("no ready endpoint") && fails[1].detail.contains("refused")
        );

        // The plugin not Ready on the node.
        let mut f = healthy();
        f.plugin_pods.clear();
        let found = levels(&f);
        assert!(
            found.contains(&(
                Level::Fail,
                "node",
                "n1: the device plugin is not Ready there".into()
            )),
            "{found:?}"
        );

        // Another plugin owns the resource: the kubelet advertises whole GPUs, not slots.
        let mut f = healthy();
        f.nodes[0].status = Some(from(json!({"allocatable": {"nvidia.com/gpu": "2"}})));
        f.daemonsets.push(from(json!({
            "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": "gpu-operator", "uid": "ds2"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "nvidia-device-plugin", "image": "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"}]}}},
            "status": {"desiredNumberScheduled": 1, "numberReady": 1, "currentNumberScheduled": 1, "numberMisscheduled": 0}})));
        let found = check(&f, &DecisionConfig::default());
        let warns: Vec<_> = found.iter().filter(|x| x.level == Level::Warn).collect();
        assert_eq!(warns.len(), 2, "{found:?}");
        assert!(
            warns[0].detail.contains("advertises 2 nvidia.com/gpu")
                && warns[0].detail.contains("registered 20")
        );
        assert!(
            warns[1].detail.contains("NVIDIA's device plugin")
                && warns[1]
                    .fix
                    .as_deref()
                    .is_some_and(|f| f.contains("devicePlugin.enabled=false"))
        );

        // The shim not installed: its init container failed.
        let mut f = healthy();
        f.plugin_pods[0].status = Some(from(json!({"initContainerStatuses": [
            {"name": "install-vgpu-hook", "ready": false, "restartCount": 3, "image": "x", "imageID": "",
             "state": {"terminated": {"exitCode": 1}}}]})));
        let found = check(&f, &DecisionConfig::default());
        let shim = found
            .iter()
            .find(|x| x.check == "shim")
            .expect("a shim finding");
        assert_eq!(shim.level, Level::Fail, "{shim:?}");
        assert!(
            shim.fix
                .as_deref()
                .is_some_and(|f| f.contains("logs tessera-device-plugin-abc -c install-vgpu-hook"))
        );

        // A node whose runtime takes the device list from any container's environment.
        let mut f = healthy();
        f.runtime_events.push(from(json!({
            "metadata": {"name": "n1.1", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": "n1"},
            "reason": "UnsafeGPUDeviceList",
            "message": "the NVIDIA runtime accepts NVIDIA_VISIBLE_DEVICES from unprivileged containers"})));
        let found = check(&f, &DecisionConfig::default());
        let rt = found
            .iter()
            .find(|x| x.check == "runtime")
            .expect("a runtime finding");
        assert_eq!(rt.level, Level::Warn);
        assert!(
            rt.detail.starts_with("n1: the NVIDIA runtime accepts"),
            "{rt:?}"
        );

        // Versions: the parts disagree (an upgrade half done), or this program is another one.
        let mut f = healthy();
        f.daemonsets[0] = from(json!({
            "metadata": {"name": "tessera-device-plugin", "namespace": "gpu", "uid": "ds1",
                         "labels": {"app.kubernetes.io/name": "tessera", "app.kubernetes.io/component": "device-plugin"}},
            "spec": {"selector": {}, "template": {"spec": {"nodeSelector": {"gpu": "on"}, "containers": [
                {"name": "tessera-device-plugin", "image": "ghcr.io/tessera-gpu/tessera-device-plugin:0.2.0"}]}}},
            "status": {"desiredNumberScheduled": 1, "numberReady": 1, "currentNumberScheduled": 1, "numberMisscheduled": 0}}));
        let v = check(&f, &DecisionConfig::default())
            .into_iter()
            .find(|x| x.check == "versions")
            .expect("a versions finding");
        assert_eq!(v.level, Level::Warn);
        assert!(v.detail.contains("different versions"), "{v:?}");
        let mut f = healthy();
        f.own_version = "0.3.0".into();
        let v = check(&f, &DecisionConfig::default())
            .into_iter()
            .find(|x| x.check == "versions")
            .expect("a versions finding");
        assert!(
            v.fix.as_deref() == Some("install kubectl-tessera 0.1.0"),
            "{v:?}"
        );
        assert_eq!(
            image_tag(
                Some(&from(
                    json!({"containers": [{"name": "a", "image": "reg:5000/tessera-gpu/tessera-scheduler@sha256:abc"}]})
                )),
                "tessera-scheduler"
            ),
            None
        );

        // Nothing installed.
        let found = levels(&Facts::default());
        assert_eq!(found[0].0, Level::Fail);
        assert_eq!(found[0].1, "scheduler");
    }
}
