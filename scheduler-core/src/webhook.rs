//! The mutating admission webhook (contract §7), as a pure function from an AdmissionReview to
//! the answer, both typed by kube-core's `admission` module. HAMi's mutations come from
//! `hami_contract::request::webhook_mutation`.
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
use kube_core::admission::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, ConvertAdmissionReviewError,
    META_API_VERSION_V1, META_KIND, Operation, SerializePatchError,
};
use kube_core::{DynamicObject, Status};
use serde_json::{Value, json};

use crate::facts::ClusterFacts;
use crate::podspec::container_resources;
use crate::quota::Limit;

/// HAMi's denial of a privileged GPU container, kept as the start of Tessera's (scripts match
/// it), then why and what to do: `container <name>` goes between.
const PRIVILEGED_PREFIX: &str = "container ";
const PRIVILEGED_REASON: &str = " is privileged: a privileged container sees every GPU of the node, \
    so its GPU share could not be held; remove securityContext.privileged from it, or its GPU \
    request";
/// HAMi's denial of a GPU pod with `spec.nodeName` set, then why and what to do.
const NODE_ASSIGNED: &str = "pod has node assigned: a pod with spec.nodeName set is never seen \
    by the GPU scheduler, which must choose its GPU; remove spec.nodeName and choose the node \
    with a nodeSelector or node affinity";

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

/// The AdmissionRequest of a review, as the API server sends it (`object` and `oldObject` kept
/// as they came).
pub type Request = AdmissionRequest<DynamicObject>;

/// Why a request body gets no AdmissionReview answer (HTTP 400), or the answer could not be
/// written (HTTP 500).
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("request body is not a JSON AdmissionReview")]
    NotJson(#[source] serde_json::Error),
    #[error("request body is not an AdmissionReview: {0}")]
    NotAReview(#[source] serde_json::Error),
    #[error("AdmissionReview has no request.uid")]
    NoRequest(#[source] ConvertAdmissionReviewError),
    #[error("request.object is not a Pod: {0}")]
    NotAPod(#[source] serde_json::Error),
    #[error("encoding the answer: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("encoding the patch: {0}")]
    EncodePatch(#[source] SerializePatchError),
}

impl WebhookError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> u16 {
        match self {
            WebhookError::Encode(_) | WebhookError::EncodePatch(_) => 500,
            _ => 400,
        }
    }
}

/// HTTP status and JSON body of the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookAnswer {
    pub status: u16,
    /// The AdmissionReview answer ([`encode_review`]), or `{"error": …}` when there is none.
    pub body: Value,
}

impl WebhookAnswer {
    /// The answer to a body that gets no AdmissionReview back.
    pub fn error(e: &WebhookError) -> Self {
        /// The body of an error answer.
        #[derive(serde::Serialize)]
        struct ErrorBody {
            error: String,
        }
        WebhookAnswer {
            status: e.status(),
            body: serde_json::to_value(ErrorBody {
                error: e.to_string(),
            })
            .unwrap_or(Value::Null),
        }
    }
}

/// Standard base64 with padding (the encoding of `[]byte` in Kubernetes JSON).
pub fn base64_encode(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// The JSON of an answer as the API server reads it. kube-core serializes `response.patch` (a Go
/// `[]byte`) as an array of numbers (kube-rs#1781); Kubernetes JSON has `[]byte` as base64, as
/// Go's `encoding/json` writes it. And as Go leaves out a nil `*Status` (`omitempty`), an
/// allowed answer carries no empty `status`.
pub fn encode_review(review: &AdmissionReview<DynamicObject>) -> Result<Value, WebhookError> {
    let mut body = serde_json::to_value(review).map_err(WebhookError::Encode)?;
    if let Some(response) = body.get_mut("response").and_then(Value::as_object_mut) {
        if let Some(bytes) = review.response.as_ref().and_then(|r| r.patch.as_deref()) {
            response.insert("patch".to_owned(), Value::String(base64_encode(bytes)));
        }
        if response
            .get("status")
            .and_then(Value::as_object)
            .is_some_and(serde_json::Map::is_empty)
        {
            response.remove("status");
        }
    }
    Ok(body)
}

/// The answer to one review.
fn answer(response: AdmissionResponse) -> WebhookAnswer {
    match encode_review(&response.into_review()) {
        Ok(body) => WebhookAnswer { status: 200, body },
        Err(e) => WebhookAnswer::error(&e),
    }
}

/// What the webhook decided for one request.
#[derive(Debug)]
enum Decision {
    /// Admit as it is.
    Allow,
    /// Admit with these changes (none: as it is).
    Mutate(json_patch::Patch),
    /// Refuse, saying why.
    Deny(String),
}

/// Builds the AdmissionResponse of `decision` for `req`.
fn respond(req: &Request, decision: Decision) -> Result<AdmissionResponse, WebhookError> {
    let response = AdmissionResponse::from(req);
    match decision {
        Decision::Allow => Ok(response),
        Decision::Mutate(patch) if patch.0.is_empty() => Ok(response),
        Decision::Mutate(patch) => response
            .with_patch(patch)
            .map_err(WebhookError::EncodePatch),
        Decision::Deny(message) => {
            let mut response = response.deny(&message);
            response.result = Status {
                metadata: Some(Default::default()),
                ..Status::failure(&message, "Forbidden").with_code(403)
            };
            Ok(response)
        }
    }
}

fn owned_annotations(obj: &DynamicObject) -> Vec<(&String, &String)> {
    obj.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| is_scheduler_owned(k))
        .collect()
}

/// Scheduler-owned keys added, changed or removed between `old` and `new`.
fn forged_keys(old: Option<&DynamicObject>, new: &DynamicObject) -> Vec<String> {
    let before = old.map(owned_annotations).unwrap_or_default();
    let after = owned_annotations(new);
    let mut keys = BTreeSet::new();
    for (k, v) in &after {
        if !before.iter().any(|(bk, bv)| bk == k && bv == v) {
            keys.insert((*k).clone());
        }
    }
    for (k, _) in &before {
        if !after.iter().any(|(ak, _)| ak == k) {
            keys.insert((*k).clone());
        }
    }
    keys.into_iter().collect()
}

/// The request fields the API server always sends that a review may leave out: the group,
/// version and kind of a Pod review, its resource, and an anonymous caller.
const REQUEST_DEFAULTS: [(&str, &str); 3] = [
    ("kind", r#"{"group": "", "version": "v1", "kind": "Pod"}"#),
    (
        "resource",
        r#"{"group": "", "version": "v1", "resource": "pods"}"#,
    ),
    ("userInfo", "{}"),
];

/// Reads a request body as an AdmissionReview. The API server always sends the review's
/// `apiVersion` and `kind` and the request's `kind`, `resource` and `userInfo`; the webhook reads
/// only the last (it is registered for pods), so a review that leaves them out is read as a Pod
/// review of `admission.k8s.io/v1` by an anonymous caller (trusted by no one).
pub fn parse(body: &[u8]) -> Result<Request, WebhookError> {
    let mut review: Value = serde_json::from_slice(body).map_err(WebhookError::NotJson)?;
    if let Some(top) = review.as_object_mut() {
        top.entry("apiVersion")
            .or_insert_with(|| Value::from(META_API_VERSION_V1));
        top.entry("kind").or_insert_with(|| Value::from(META_KIND));
        if let Some(req) = top.get_mut("request").and_then(Value::as_object_mut) {
            for (key, default) in REQUEST_DEFAULTS {
                if !req.contains_key(key) {
                    let v = serde_json::from_str(default).map_err(WebhookError::NotAReview)?;
                    req.insert(key.to_owned(), v);
                }
            }
        }
    }
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(review).map_err(WebhookError::NotAReview)?;
    review.try_into().map_err(WebhookError::NoRequest)
}

/// Answers one AdmissionReview request body, with what this replica knows of the cluster.
pub fn handle(body: &[u8], cfg: &WebhookConfig, facts: &ClusterFacts) -> WebhookAnswer {
    match parse(body) {
        Ok(req) => review(&req, cfg, facts),
        Err(e) => WebhookAnswer::error(&e),
    }
}

/// Answers one parsed request ([`parse`]).
pub fn review(req: &Request, cfg: &WebhookConfig, facts: &ClusterFacts) -> WebhookAnswer {
    match decide(req, cfg, facts).and_then(|d| respond(req, d)) {
        Ok(response) => answer(response),
        Err(e) => WebhookAnswer::error(&e),
    }
}

/// The decision for one request.
fn decide(
    req: &Request,
    cfg: &WebhookConfig,
    facts: &ClusterFacts,
) -> Result<Decision, WebhookError> {
    let Some(object) = req.object.as_ref() else {
        return Ok(Decision::Allow);
    };
    let user = req.user_info.username.as_deref().unwrap_or("");
    // Scheduler-owned annotations: only the trusted service accounts may write them.
    let checked = matches!(req.operation, Operation::Create | Operation::Update);
    if checked && !cfg.trusted_users.contains(user) {
        let old = match req.operation {
            Operation::Update => req.old_object.as_ref(),
            _ => None,
        };
        let forged = forged_keys(old, object);
        if !forged.is_empty() {
            return Ok(Decision::Deny(format!(
                "annotation(s) {} are written only by the GPU scheduler and device plugin; remove them from the pod",
                forged.join(", ")
            )));
        }
    }
    if req.operation != Operation::Create {
        return Ok(Decision::Allow);
    }
    let pod: Pod = serde_json::to_value(object)
        .and_then(serde_json::from_value)
        .map_err(WebhookError::NotAPod)?;
    // `request.namespace` is always set; the object's may not be on CREATE.
    let namespace = req
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .or(pod.metadata.namespace.as_deref())
        .unwrap_or("default");
    Ok(mutate(&object.data, &pod, namespace, cfg, facts))
}

/// HAMi's mutation of a pod on CREATE (limits and env per container, `runtimeClassName`,
/// `schedulerName`) as a JSON patch of `original` (the object as it came), or why the pod is
/// denied.
fn mutate(
    original: &Value,
    pod: &Pod,
    namespace: &str,
    cfg: &WebhookConfig,
    facts: &ClusterFacts,
) -> Decision {
    let Some(spec) = pod.spec.as_ref() else {
        return Decision::Deny("pod has no containers".to_owned());
    };
    if spec.containers.is_empty() {
        return Decision::Deny("pod has no containers".to_owned());
    }
    if !cfg.allow_control_env_namespaces.contains(namespace)
        && let Some(why) = control_env_denial(spec, namespace, cfg)
    {
        return Decision::Deny(why);
    }
    let current_scheduler = spec.scheduler_name.as_deref().unwrap_or("");
    if !current_scheduler.is_empty()
        && (current_scheduler != "default-scheduler" || !cfg.force_overwrite_default_scheduler)
        && current_scheduler != cfg.scheduler_name
    {
        return Decision::Allow;
    }
    let mut mutated = original.clone();
    let containers = match mutate_containers(spec, &mut mutated, cfg) {
        Ok(c) => c,
        Err(why) => return Decision::Deny(why.to_string()),
    };
    if containers.has_resource {
        if let Some(name) = containers.privileged {
            return Decision::Deny(format!("{PRIVILEGED_PREFIX}{name}{PRIVILEGED_REASON}"));
        }
        if let Err(why) = hami_contract::annotations::memory_oversubscription(
            pod.metadata
                .annotations
                .iter()
                .flatten()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        ) {
            return Decision::Deny(why);
        }
        if !cfg.nvidia.runtime_class_name.is_empty() && spec.runtime_class_name.is_none() {
            mutated["spec"]["runtimeClassName"] = json!(cfg.nvidia.runtime_class_name);
        }
        if !cfg.scheduler_name.is_empty() {
            if spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
                return Decision::Deny(NODE_ASSIGNED.to_owned());
            }
            mutated["spec"]["schedulerName"] = json!(cfg.scheduler_name);
        }
        let [init, app] = &containers.resources;
        let requests = resolve_pod(init, app, &cfg.nvidia);
        if let Some(why) = never_fits(&requests, init, app, namespace, cfg, facts) {
            return Decision::Deny(why);
        }
    }
    Decision::Mutate(json_patch::diff(original, &mutated))
}

/// What [`mutate_containers`] found.
struct MutatedContainers {
    /// Some container asks for a GPU resource.
    has_resource: bool,
    /// The first privileged container.
    privileged: Option<String>,
    /// The init and app containers as mutated (limits added), for the checks against cluster
    /// facts.
    resources: [Vec<ContainerResources>; 2],
}

/// Adds HAMi's limits and env to every container of `mutated` (the pod's JSON); `Err`: a
/// request HAMi would refuse (the denial says why).
fn mutate_containers(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    mutated: &mut Value,
    cfg: &WebhookConfig,
) -> Result<MutatedContainers, hami_contract::request::RequestError> {
    let lists: [(&str, Vec<&k8s_openapi::api::core::v1::Container>); 2] = [
        (
            "initContainers",
            spec.init_containers.iter().flatten().collect(),
        ),
        ("containers", spec.containers.iter().collect()),
    ];
    let mut out = MutatedContainers {
        has_resource: false,
        privileged: None,
        resources: [Vec::new(), Vec::new()],
    };
    for (list, (field, containers)) in lists.iter().enumerate() {
        for (i, c) in containers.iter().enumerate() {
            let mut res = container_resources(c);
            let m = webhook_mutation(&res, &cfg.nvidia)?;
            for (k, v) in &m.add_limits {
                res.limits.insert(k.clone(), v.clone());
            }
            if let Some(out) = out.resources.get_mut(list) {
                out.push(res);
            }
            apply_mutation(&mut mutated["spec"][*field][i], &m);
            out.has_resource |= m.has_resource;
            if out.privileged.is_none()
                && c.security_context
                    .as_ref()
                    .and_then(|s| s.privileged)
                    .unwrap_or(false)
            {
                out.privileged = Some(c.name.clone());
            }
        }
    }
    Ok(out)
}

/// One container's limits and env (`target`: the container's JSON).
fn apply_mutation(target: &mut Value, m: &hami_contract::request::ContainerMutation) {
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
