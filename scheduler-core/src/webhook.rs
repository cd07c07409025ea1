//! The mutating admission webhook (contract §7), as a pure function from an AdmissionReview to
//! the answer. HAMi's mutations come from `hami_contract::request::webhook_mutation`.
//!
//! Tessera additions: any scheduler-owned annotation (`hami.io/vgpu-*`, `hami.io/bind-phase`, …)
//! set or changed by anyone but the trusted service accounts is denied, on CREATE and UPDATE,
//! whatever the pod's scheduler (HAMi #3076, #3041); requests HAMi would silently ignore or
//! never fit are denied with the reason; so are GPU pods that set the shim's control variables
//! ([`is_control_env`]) outside the namespaces allowed to. Denials say nothing about objects
//! outside the pod's namespace (node names, GPU sizes, other namespaces' quotas): `/webhook` may
//! be called by anyone who reaches the port.
//!
//! Two denials need cluster facts, which every replica keeps ([`ClusterFacts`]): a GPU memory
//! request above the largest GPU of any registered node, and (HAMi's quota pre-check, contract
//! §5.7) a pod whose request alone exceeds its namespace's GPU ResourceQuota. A view that has not
//! seen any registered GPU refuses nothing for memory: the filter still refuses such a pod and
//! says why, per node.

use std::collections::BTreeSet;

use hami_contract::NvidiaConfig;
use hami_contract::annotations::is_scheduler_owned;
use hami_contract::request::{ContainerResources, PodRequests, resolve_pod, webhook_mutation};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use crate::facts::ClusterFacts;
use crate::podspec::container_resources;
use crate::quota::Limit;

/// Webhook settings.
#[derive(Debug, Clone, Default)]
pub struct WebhookConfig {
    pub nvidia: NvidiaConfig,
    /// `--scheduler-name` (chart: `hami-scheduler`); empty ⇒ never set `schedulerName`.
    pub scheduler_name: String,
    /// HAMi `--force-overwrite-default-scheduler` (default true).
    pub force_overwrite_default_scheduler: bool,
    /// Users allowed to write scheduler-owned annotations (the extender's and the device
    /// plugin's service accounts).
    pub trusted_users: BTreeSet<String>,
    /// Namespaces whose GPU pods may set the shim's control variables ([`is_control_env`]);
    /// `--webhook-allow-control-env-namespaces`. Empty: no namespace may.
    pub allow_control_env_namespaces: BTreeSet<String>,
}

/// Environment variables that switch the shim off or set its limits: `CUDA_DISABLE_CONTROL`
/// (the device plugin then skips the preload mount), the limits Allocate writes
/// (`CUDA_DEVICE_MEMORY_LIMIT_<n>`, `CUDA_DEVICE_SM_LIMIT`, `CUDA_DEVICE_MEMORY_SHARED_CACHE`,
/// `CUDA_OVERSUBSCRIBE`, `GPU_CORE_UTILIZATION_POLICY`) and the ones the shim also reads
/// (`CUDA_DEVICE_MEMORY_LIMIT`, `CUDA_DEVICE_SM_LIMIT_<n>`): the shim's own list of limit
/// variables (`libvgpu-shim/src/config.rs`). Set in a pod spec they would override or disable
/// what the scheduler granted (`GPU_CORE_UTILIZATION_POLICY=disable` lifts the SM limit).
const CONTROL_ENV: [&str; 6] = [
    "CUDA_DISABLE_CONTROL",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_OVERSUBSCRIBE",
    "GPU_CORE_UTILIZATION_POLICY",
];

/// Whether a pod may not set `name` (see `CONTROL_ENV`); the indexed forms are `_<digits>`.
pub fn is_control_env(name: &str) -> bool {
    if CONTROL_ENV.contains(&name) {
        return true;
    }
    ["CUDA_DEVICE_MEMORY_LIMIT_", "CUDA_DEVICE_SM_LIMIT_"]
        .iter()
        .filter_map(|p| name.strip_prefix(p))
        .any(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// HTTP status and JSON body of the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookAnswer {
    pub status: u16,
    pub body: Value,
}

/// Standard base64 with padding (the encoding of `[]byte` in Kubernetes JSON).
pub fn base64_encode(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn review(api_version: &str, response: Value) -> Value {
    json!({"apiVersion": api_version, "kind": "AdmissionReview", "response": response})
}

fn allow(api_version: &str, uid: &str, patch: Option<Value>, warnings: &[String]) -> WebhookAnswer {
    let mut r = json!({"uid": uid, "allowed": true});
    if let Some(p) = patch
        && p.as_array().is_some_and(|a| !a.is_empty())
    {
        let bytes = serde_json::to_vec(&p).unwrap_or_default();
        r["patchType"] = json!("JSONPatch");
        r["patch"] = json!(base64_encode(&bytes));
    }
    if !warnings.is_empty() {
        r["warnings"] = json!(warnings);
    }
    WebhookAnswer {
        status: 200,
        body: review(api_version, r),
    }
}

fn deny(api_version: &str, uid: &str, message: &str) -> WebhookAnswer {
    WebhookAnswer {
        status: 200,
        body: review(
            api_version,
            json!({"uid": uid, "allowed": false,
                   "status": {"metadata": {}, "status": "Failure", "message": message, "reason": "Forbidden", "code": 403}}),
        ),
    }
}

fn owned_annotations(obj: &Value) -> Vec<(String, Value)> {
    obj["metadata"]["annotations"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| is_scheduler_owned(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// Scheduler-owned keys added, changed or removed between `old` and `new`.
fn forged_keys(old: Option<&Value>, new: &Value) -> Vec<String> {
    let before = old.map(owned_annotations).unwrap_or_default();
    let after = owned_annotations(new);
    let mut keys = BTreeSet::new();
    for (k, v) in &after {
        if !before.iter().any(|(bk, bv)| bk == k && bv == v) {
            keys.insert(k.clone());
        }
    }
    for (k, _) in &before {
        if !after.iter().any(|(ak, _)| ak == k) {
            keys.insert(k.clone());
        }
    }
    keys.into_iter().collect()
}

/// Answers one AdmissionReview request body, with what this replica knows of the cluster.
pub fn handle(body: &[u8], cfg: &WebhookConfig, facts: &ClusterFacts) -> WebhookAnswer {
    let bad = |msg: String| WebhookAnswer {
        status: 400,
        body: json!({"error": msg}),
    };
    let Ok(review_in) = serde_json::from_slice::<Value>(body) else {
        return bad("request body is not a JSON AdmissionReview".to_owned());
    };
    let api_version = review_in["apiVersion"]
        .as_str()
        .unwrap_or("admission.k8s.io/v1")
        .to_owned();
    let req = &review_in["request"];
    let Some(uid) = req["uid"].as_str() else {
        return bad("AdmissionReview has no request.uid".to_owned());
    };
    let operation = req["operation"].as_str().unwrap_or("");
    let user = req["userInfo"]["username"].as_str().unwrap_or("");
    let object = &req["object"];
    if !object.is_object() {
        return allow(&api_version, uid, None, &[]);
    }
    let old = req["oldObject"].as_object().map(|_| &req["oldObject"]);

    // Scheduler-owned annotations: only the trusted service accounts may write them.
    if matches!(operation, "CREATE" | "UPDATE") && !cfg.trusted_users.contains(user) {
        let forged = forged_keys(if operation == "UPDATE" { old } else { None }, object);
        if !forged.is_empty() {
            return deny(
                &api_version,
                uid,
                &format!(
                    "annotation(s) {} are written only by the GPU scheduler and device plugin; remove them from the pod",
                    forged.join(", ")
                ),
            );
        }
    }
    if operation != "CREATE" {
        return allow(&api_version, uid, None, &[]);
    }
    let pod: Pod = match serde_json::from_value(object.clone()) {
        Ok(p) => p,
        Err(e) => return bad(format!("request.object is not a Pod: {e}")),
    };
    // `request.namespace` is always set; the object's may not be on CREATE.
    let namespace = req["namespace"]
        .as_str()
        .filter(|n| !n.is_empty())
        .or(pod.metadata.namespace.as_deref())
        .unwrap_or("default")
        .to_owned();
    mutate(&api_version, uid, object, &pod, &namespace, cfg, facts)
}

fn mutate(
    api_version: &str,
    uid: &str,
    original: &Value,
    pod: &Pod,
    namespace: &str,
    cfg: &WebhookConfig,
    facts: &ClusterFacts,
) -> WebhookAnswer {
    let Some(spec) = pod.spec.as_ref() else {
        return deny(api_version, uid, "pod has no containers");
    };
    if spec.containers.is_empty() {
        return deny(api_version, uid, "pod has no containers");
    }
    if !cfg.allow_control_env_namespaces.contains(namespace)
        && let Some(why) = control_env_denial(spec, namespace, cfg)
    {
        return deny(api_version, uid, &why);
    }
    let current_scheduler = spec.scheduler_name.as_deref().unwrap_or("");
    if !current_scheduler.is_empty()
        && (current_scheduler != "default-scheduler" || !cfg.force_overwrite_default_scheduler)
        && current_scheduler != cfg.scheduler_name
    {
        return allow(api_version, uid, None, &[]);
    }
    let mut mutated = original.clone();
    let mut has_resource = false;
    let warnings: Vec<String> = Vec::new();
    let lists: [(&str, Vec<&k8s_openapi::api::core::v1::Container>); 2] = [
        (
            "initContainers",
            spec.init_containers.iter().flatten().collect(),
        ),
        ("containers", spec.containers.iter().collect()),
    ];
    let mut privileged: Option<String> = None;
    // The containers as mutated (limits added), for the checks against cluster facts.
    let mut mutated_res: [Vec<ContainerResources>; 2] = [Vec::new(), Vec::new()];
    for (list, (field, containers)) in lists.iter().enumerate() {
        for (i, c) in containers.iter().enumerate() {
            let mut res = container_resources(c);
            let m = match webhook_mutation(&res, &cfg.nvidia) {
                Ok(m) => m,
                Err(e) => return deny(api_version, uid, &e.to_string()),
            };
            for (k, v) in &m.add_limits {
                res.limits.insert(k.clone(), v.clone());
            }
            if let Some(out) = mutated_res.get_mut(list) {
                out.push(res);
            }
            let target = &mut mutated["spec"][*field][i];
            for (k, v) in &m.add_limits {
                if !target["resources"].is_object() {
                    target["resources"] = json!({});
                }
                if !target["resources"]["limits"].is_object() {
                    target["resources"]["limits"] = json!({});
                }
                target["resources"]["limits"][k] = json!(v);
            }
            for (k, v) in &m.add_env {
                if !target["env"].is_array() {
                    target["env"] = json!([]);
                }
                if let Some(env) = target["env"].as_array_mut() {
                    env.retain(|e| e["name"].as_str() != Some(k.as_str()));
                    env.push(json!({"name": k, "value": v}));
                }
            }
            has_resource |= m.has_resource;
            if privileged.is_none()
                && c.security_context
                    .as_ref()
                    .and_then(|s| s.privileged)
                    .unwrap_or(false)
            {
                privileged = Some(c.name.clone());
            }
        }
    }
    if has_resource {
        if let Some(name) = privileged {
            return deny(api_version, uid, &format!("container {name} is privileged"));
        }
        if !cfg.nvidia.runtime_class_name.is_empty() && spec.runtime_class_name.is_none() {
            mutated["spec"]["runtimeClassName"] = json!(cfg.nvidia.runtime_class_name);
        }
        if !cfg.scheduler_name.is_empty() {
            if spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
                return deny(api_version, uid, "pod has node assigned");
            }
            mutated["spec"]["schedulerName"] = json!(cfg.scheduler_name);
        }
        let [init, app] = &mutated_res;
        let requests = resolve_pod(init, app, &cfg.nvidia);
        if let Some(why) = never_fits(&requests, init, app, namespace, cfg, facts) {
            return deny(api_version, uid, &why);
        }
    }
    let patch = json_patch::diff(original, &mutated);
    let patch = serde_json::to_value(&patch).unwrap_or(Value::Array(Vec::new()));
    allow(api_version, uid, Some(patch), &warnings)
}

/// Tessera: a GPU pod (one of its containers names a GPU resource) that sets a control
/// variable in `env` (literal or `valueFrom`) of a container or init container. `envFrom` of a
/// ConfigMap or Secret cannot be seen at admission (docs/scheduler.md).
fn control_env_denial(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    namespace: &str,
    cfg: &WebhookConfig,
) -> Option<String> {
    let names = &cfg.nvidia.resources;
    let gpu_names = [
        &names.count,
        &names.memory,
        &names.memory_percentage,
        &names.cores,
    ];
    let containers = || {
        spec.init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
    };
    let asks_gpu = containers().any(|c| {
        let res = container_resources(c);
        gpu_names.iter().any(|n| res.quantity(n).is_some())
    });
    if !asks_gpu {
        return None;
    }
    containers().find_map(|c| {
        let var = c
            .env
            .iter()
            .flatten()
            .find(|e| is_control_env(&e.name))?;
        Some(format!(
            "container {} sets {}: it switches off or overrides the GPU limits the device plugin gives the container; remove it (only namespaces listed in the scheduler's --webhook-allow-control-env-namespaces may set it, and {namespace} is not one)",
            c.name, var.name
        ))
    })
}

/// ` (after memoryFactor N)` when the factor changes the numbers the user wrote.
fn factor_note(cfg: &NvidiaConfig) -> String {
    let f = cfg.effective_memory_factor();
    if f > 1 {
        format!(" (after memoryFactor {f})")
    } else {
        String::new()
    }
}

/// Tessera: a pod that no node or no budget could ever take, judged on cluster facts.
fn never_fits(
    requests: &PodRequests,
    init: &[ContainerResources],
    app: &[ContainerResources],
    namespace: &str,
    cfg: &WebhookConfig,
    facts: &ClusterFacts,
) -> Option<String> {
    if requests.is_empty() {
        return None;
    }
    let names = &cfg.nvidia.resources;
    // Memory per GPU above the largest card. Only absolute requests: a percentage fits any
    // card, and an empty view (nothing registered yet) refuses nothing.
    if let Some(largest) = facts.largest_gpu() {
        let containers = init.iter().chain(app);
        for (c, r) in containers.zip(requests.in_annotation_order()) {
            if let Some(r) = r
                && r.memreq > largest.mem
            {
                // Nothing about other objects (which node, how large): the webhook answers
                // callers that may not see nodes (docs/scheduler.md, "Webhook").
                return Some(format!(
                    "container {} asks for {} MiB of GPU memory per GPU ({}){}; no GPU in the cluster has that much: no node can ever run this pod; lower {} or use {}",
                    c.name,
                    r.memreq,
                    names.memory,
                    factor_note(&cfg.nvidia),
                    names.memory,
                    names.memory_percentage,
                ));
            }
        }
    }
    // HAMi's quota pre-check: the request alone over the namespace's limit. Usage is not
    // considered here (it changes; the filter charges it, reservations included).
    let limits = facts.namespace_limits(namespace);
    if limits.is_empty() {
        return None;
    }
    let q = requests.quota_request();
    let count = {
        let (mut app_sum, mut init_max) = (0u64, 0u64);
        for r in requests.app.iter().flatten() {
            app_sum = app_sum.saturating_add(u64::from(r.nums));
        }
        for r in requests.init.iter().flatten() {
            init_max = init_max.max(u64::from(r.nums));
        }
        app_sum.max(init_max)
    };
    fn over(asked: u64, limit: Option<Limit<'_>>) -> Option<Limit<'_>> {
        limit.filter(|l| asked > l.value)
    }
    // Neither the quota's name nor its value: the namespace is the one the AdmissionReview
    // claims, and an unauthenticated caller can claim any (docs/scheduler.md, "Webhook").
    let deny_quota = |asked: String, how: String, key: &str, _l: Limit<'_>, unit: &str| {
        format!(
            "pod asks for {asked}{} in total ({how}, over its containers), more than the GPU ResourceQuota of namespace {namespace} allows for {key}; the pod could never be scheduled in this namespace (exceeding resource quota; `kubectl describe resourcequota -n {namespace}` shows the limits)",
            if unit == " MiB" {
                factor_note(&cfg.nvidia)
            } else {
                String::new()
            },
        )
    };
    let (mem_key, cores_key) = names.quota_keys();
    if let Some(l) = over(q.memory, limits.mem) {
        return Some(deny_quota(
            format!("{} MiB of GPU memory", q.memory),
            format!("{} × {}", names.memory, names.count),
            &mem_key,
            l,
            " MiB",
        ));
    }
    if let Some(l) = over(q.cores, limits.cores) {
        return Some(deny_quota(
            format!("{} GPU cores", q.cores),
            format!("{} × {}", names.cores, names.count),
            &cores_key,
            l,
            "",
        ));
    }
    if let Some(l) = over(count, limits.count) {
        return Some(deny_quota(
            format!("{count} GPUs"),
            names.count.clone(),
            &names.count,
            l,
            "",
        ));
    }
    None
}
