//! AdmissionReview golden tests: HAMi's mutations and every denial, forged annotations on create
//! and update.

use serde_json::{Value, json};
use tessera_scheduler_core::facts::ClusterFacts;
use tessera_scheduler_core::fixtures::gpu_node;
use tessera_scheduler_core::quota::{QuotaKeys, QuotaRecord};
use tessera_scheduler_core::state::NodeRecord;
use tessera_scheduler_core::webhook::{self, WebhookAnswer, WebhookConfig, base64_encode};

/// The webhook of a replica that has not seen any node or quota yet.
fn handle(body: &[u8], cfg: &WebhookConfig) -> WebhookAnswer {
    webhook::handle(body, cfg, &ClusterFacts::new())
}

fn cfg() -> WebhookConfig {
    WebhookConfig {
        scheduler_name: "hami-scheduler".to_owned(),
        force_overwrite_default_scheduler: true,
        trusted_users: ["system:serviceaccount:gpu:tessera-scheduler".to_owned()]
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

fn review(op: &str, user: &str, object: Value, old: Option<Value>) -> Vec<u8> {
    let mut req =
        json!({"uid": "req-1", "operation": op, "userInfo": {"username": user}, "object": object});
    if let Some(o) = old {
        req["oldObject"] = o;
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req})
        .to_string()
        .into_bytes()
}

fn pod(limits: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
           "spec": {"containers": [{"name": "main", "image": "app", "resources": {"limits": limits}}]}})
}

fn expect_patch(answer: &Value, ops: Value) {
    let encoded = base64_encode(serde_json::to_string(&ops).unwrap().as_bytes());
    assert_eq!(answer["response"]["patchType"], "JSONPatch", "{answer}");
    assert_eq!(answer["response"]["patch"], json!(encoded), "want {ops}");
}

#[test]
fn a_whole_card_request_gets_exclusive_cores_and_the_scheduler_name() {
    let a = handle(
        &review("CREATE", "alice", pod(json!({"nvidia.com/gpu": "1"})), None),
        &cfg(),
    );
    assert_eq!(a.status, 200);
    assert_eq!(a.body["response"]["allowed"], true);
    assert_eq!(a.body["response"]["uid"], "req-1");
    expect_patch(
        &a.body,
        json!([
            {"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpucores", "value": "100"},
            {"op": "add", "path": "/spec/schedulerName", "value": "hami-scheduler"}
        ]),
    );
}

#[test]
fn memory_without_a_count_gets_the_default_count() {
    let a = handle(
        &review(
            "CREATE",
            "alice",
            pod(json!({"nvidia.com/gpumem": "3000"})),
            None,
        ),
        &cfg(),
    );
    expect_patch(
        &a.body,
        json!([
            {"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "1"},
            {"op": "add", "path": "/spec/schedulerName", "value": "hami-scheduler"}
        ]),
    );
}

#[test]
fn pods_without_gpus_and_pods_of_other_schedulers_are_left_alone() {
    let a = handle(
        &review("CREATE", "alice", pod(json!({"cpu": "1"})), None),
        &cfg(),
    );
    assert_eq!(a.body["response"], json!({"uid": "req-1", "allowed": true}));
    let mut other = pod(json!({"nvidia.com/gpu": "1"}));
    other["spec"]["schedulerName"] = json!("volcano");
    let a = handle(&review("CREATE", "alice", other, None), &cfg());
    assert_eq!(a.body["response"], json!({"uid": "req-1", "allowed": true}));
}

fn denied(a: &WebhookAnswer) -> String {
    assert_eq!(a.status, 200);
    assert_eq!(a.body["response"]["allowed"], false, "{}", a.body);
    assert_eq!(a.body["response"]["status"]["code"], 403);
    a.body["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn denials_name_the_problem() {
    let c = cfg();
    let m = denied(&handle(
        &review(
            "CREATE",
            "u",
            pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "150"})),
            None,
        ),
        &c,
    ));
    assert_eq!(
        m,
        "invalid nvidia.com/gpumem-percentage value 150 in container main: must be an integer between 0 and 100"
    );
    let m = denied(&handle(
        &review(
            "CREATE",
            "u",
            pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "120"})),
            None,
        ),
        &c,
    ));
    assert!(
        m.starts_with("invalid nvidia.com/gpucores value 120 in container main"),
        "{m}"
    );
    let m = denied(&handle(
        &review(
            "CREATE",
            "u",
            pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "16Gi"})),
            None,
        ),
        &c,
    ));
    assert!(
        m.contains("16Gi") && m.contains("plain integer number of MiB"),
        "{m}"
    );
    let mut privileged = pod(json!({"nvidia.com/gpu": "1"}));
    privileged["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
    // HAMi's text first (scripts match it), then why and what to do.
    let m = denied(&handle(&review("CREATE", "u", privileged, None), &c));
    assert!(m.starts_with("container main is privileged: "), "{m}");
    assert!(m.contains("remove securityContext.privileged"), "{m}");
    // Tessera's oversubscription opt-in takes one value; a typo is refused, not ignored.
    let mut typo = pod(json!({"nvidia.com/gpu": "1"}));
    typo["metadata"]["annotations"] = json!({"tessera.io/memory-oversubscription": "Host"});
    let m = denied(&handle(&review("CREATE", "u", typo, None), &c));
    assert!(m.contains("\"Host\" is not a known value"), "{m}");
    let mut opted = pod(json!({"nvidia.com/gpu": "1"}));
    opted["metadata"]["annotations"] = json!({"tessera.io/memory-oversubscription": "host"});
    let a = handle(&review("CREATE", "u", opted, None), &c);
    assert!(
        a.body["response"]["allowed"].as_bool().unwrap_or(false),
        "{:?}",
        a.body
    );
    let mut assigned = pod(json!({"nvidia.com/gpu": "1"}));
    assigned["spec"]["nodeName"] = json!("node1");
    let m = denied(&handle(&review("CREATE", "u", assigned, None), &c));
    assert!(m.starts_with("pod has node assigned: "), "{m}");
    assert!(m.contains("nodeSelector"), "{m}");
    let empty = json!({"metadata": {"name": "p"}, "spec": {"containers": []}});
    assert_eq!(
        denied(&handle(&review("CREATE", "u", empty, None), &c)),
        "pod has no containers"
    );
}

#[test]
fn forged_scheduler_annotations_are_denied_on_create_whatever_the_scheduler() {
    let mut forged = pod(json!({"cpu": "1"}));
    forged["metadata"]["annotations"] =
        json!({"hami.io/vgpu-devices-allocated": "GPU-x,NVIDIA,1,1:;"});
    forged["spec"]["schedulerName"] = json!("default-scheduler");
    let m = denied(&handle(
        &review("CREATE", "mallory", forged.clone(), None),
        &cfg(),
    ));
    assert_eq!(
        m,
        "annotation(s) hami.io/vgpu-devices-allocated are written only by the GPU scheduler and device plugin; remove them from the pod"
    );
    let mut other = forged.clone();
    other["spec"]["schedulerName"] = json!("volcano");
    denied(&handle(&review("CREATE", "mallory", other, None), &cfg()));
}

#[test]
fn forged_scheduler_annotations_are_denied_on_update_but_trusted_writers_pass() {
    let mut old = pod(json!({"nvidia.com/gpu": "1"}));
    old["metadata"]["annotations"] = json!({"hami.io/bind-phase": "allocating"});
    let mut new = old.clone();
    new["metadata"]["annotations"]["hami.io/bind-phase"] = json!("success");
    let m = denied(&handle(
        &review("UPDATE", "mallory", new.clone(), Some(old.clone())),
        &cfg(),
    ));
    assert!(m.starts_with("annotation(s) hami.io/bind-phase"), "{m}");
    let a = handle(
        &review(
            "UPDATE",
            "system:serviceaccount:gpu:tessera-scheduler",
            new,
            Some(old.clone()),
        ),
        &cfg(),
    );
    assert_eq!(a.body["response"]["allowed"], true);
    // Removing a scheduler-owned annotation is also a forgery (it frees booked capacity).
    let mut removed = old.clone();
    removed["metadata"]["annotations"] = json!({});
    denied(&handle(
        &review("UPDATE", "mallory", removed, Some(old.clone())),
        &cfg(),
    ));
    // Unrelated updates pass.
    let mut labelled = old.clone();
    labelled["metadata"]["labels"] = json!({"team": "a"});
    let a = handle(&review("UPDATE", "mallory", labelled, Some(old)), &cfg());
    assert_eq!(a.body["response"]["allowed"], true);
}

#[test]
fn undecodable_reviews_are_400() {
    assert_eq!(handle(b"not json", &cfg()).status, 400);
    assert_eq!(handle(br#"{"request": {}}"#, &cfg()).status, 400);
}

// --- Denials on cluster facts (largest GPU, namespace quota) ------------------------------------

fn node_facts(nodes: &[k8s_openapi::api::core::v1::Node]) -> ClusterFacts {
    let cfg = tessera_scheduler_core::config::DecisionConfig::default();
    let mut f = ClusterFacts::new();
    let recs: Vec<NodeRecord> = nodes
        .iter()
        .filter_map(|n| NodeRecord::from_node(n, &cfg))
        .collect();
    f.replace_nodes(&recs);
    f
}

fn with_quotas(mut f: ClusterFacts, quotas: &[(&str, &str, Value)]) -> ClusterFacts {
    let keys = QuotaKeys::new(&Default::default(), 1);
    let recs = quotas.iter().filter_map(|(ns, name, hard)| {
        let q: k8s_openapi::api::core::v1::ResourceQuota = serde_json::from_value(
            json!({"metadata": {"namespace": ns, "name": name}, "spec": {"hard": hard}}),
        )
        .unwrap();
        QuotaRecord::from_quota(&q, &keys)
    });
    f.replace_quotas(recs);
    f
}

fn review_in(namespace: &str, object: Value) -> Vec<u8> {
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "req-1", "operation": "CREATE", "namespace": namespace,
        "userInfo": {"username": "alice"}, "object": object}})
    .to_string()
    .into_bytes()
}

/// A cluster of a 16 GiB T4 node and an 80 GiB node.
fn t4_and_a100() -> ClusterFacts {
    node_facts(&[
        gpu_node("t4-node", 4, 15360, 10),
        gpu_node("a100-node", 8, 81920, 10),
    ])
}

#[test]
fn memory_above_the_largest_gpu_is_denied_naming_the_request_but_no_node() {
    let facts = t4_and_a100();
    let body = review_in(
        "default",
        pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "100000"})),
    );
    let a = webhook::handle(&body, &cfg(), &facts);
    assert_eq!(
        a.body,
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {
            "uid": "req-1", "allowed": false, "status": {"metadata": {}, "status": "Failure",
            "reason": "Forbidden", "code": 403, "message":
            "container main asks for 100000 MiB of GPU memory per GPU (nvidia.com/gpumem); no GPU in the cluster has that much: no node can ever run this pod; lower nvidia.com/gpumem or use nvidia.com/gpumem-percentage"}}})
    );
    // Exactly the largest card fits (on an empty a100 the filter will place it).
    let a = webhook::handle(
        &review_in(
            "default",
            pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "81920"})),
        ),
        &cfg(),
        &facts,
    );
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
    // A percentage always fits some card; an init container is checked like the others.
    let a = webhook::handle(
        &review_in(
            "default",
            pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "100"})),
        ),
        &cfg(),
        &facts,
    );
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
    let mut init = pod(json!({"cpu": "1"}));
    init["spec"]["initContainers"] = json!([{"name": "warmup", "image": "app",
        "resources": {"limits": {"nvidia.com/gpumem": "90000"}}}]);
    let m = denied(&webhook::handle(
        &review_in("default", init),
        &cfg(),
        &facts,
    ));
    assert!(
        m.starts_with("container warmup asks for 90000 MiB of GPU memory per GPU"),
        "{m}"
    );
}

#[test]
fn memory_is_compared_after_memory_factor_as_the_filter_does() {
    let mut c = cfg();
    c.nvidia.memory_factor = 2;
    // 50000 asked × factor 2 = 100000 MiB booked, more than 81920.
    let m = denied(&webhook::handle(
        &review_in(
            "default",
            pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "50000"})),
        ),
        &c,
        &t4_and_a100(),
    ));
    assert!(
        m.starts_with(
            "container main asks for 100000 MiB of GPU memory per GPU (nvidia.com/gpumem) (after memoryFactor 2); no GPU in the cluster has that much"
        ),
        "{m}"
    );
}

#[test]
fn a_request_alone_over_the_namespace_quota_is_denied_naming_the_key_only() {
    let facts = with_quotas(
        t4_and_a100(),
        &[
            (
                "team-a",
                "gpu-wide",
                json!({"limits.nvidia.com/gpumem": "60000"}),
            ),
            (
                "team-a",
                "gpu-tight",
                json!({"limits.nvidia.com/gpumem": "30000", "limits.nvidia.com/gpucores": "150", "limits.nvidia.com/gpu": "3"}),
            ),
            ("team-b", "gpu", json!({"limits.nvidia.com/gpumem": "1000"})),
        ],
    );
    // 2 GPUs × 20000 MiB = 40000 MiB > the 30000 of the tighter of the two quotas.
    let two_halves = pod(
        json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "20000", "nvidia.com/gpucores": "50"}),
    );
    let a = webhook::handle(&review_in("team-a", two_halves.clone()), &cfg(), &facts);
    assert_eq!(
        a.body["response"],
        json!({"uid": "req-1", "allowed": false, "status": {"metadata": {}, "status": "Failure",
            "reason": "Forbidden", "code": 403, "message":
            "pod asks for 40000 MiB of GPU memory in total (nvidia.com/gpumem × nvidia.com/gpu, over its containers), more than the GPU ResourceQuota of namespace team-a allows for limits.nvidia.com/gpumem; the pod could never be scheduled in this namespace (exceeding resource quota; `kubectl describe resourcequota -n team-a` shows the limits)"}})
    );
    // Cores: 2 × 100 = 200 > 150.
    let m = denied(&webhook::handle(
        &review_in(
            "team-a",
            pod(
                json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1000", "nvidia.com/gpucores": "100"}),
            ),
        ),
        &cfg(),
        &facts,
    ));
    assert!(m.contains("pod asks for 200 GPU cores in total (nvidia.com/gpucores × nvidia.com/gpu, over its containers)"), "{m}");
    // Count: 4 GPUs > 3.
    let m = denied(&webhook::handle(
        &review_in(
            "team-a",
            pod(
                json!({"nvidia.com/gpu": "4", "nvidia.com/gpumem": "1000", "nvidia.com/gpucores": "10"}),
            ),
        ),
        &cfg(),
        &facts,
    ));
    assert!(
        m.starts_with("pod asks for 4 GPUs in total (nvidia.com/gpu, over its containers), more than the GPU ResourceQuota of namespace team-a allows for nvidia.com/gpu;"),
        "{m}"
    );
    // Within the budget: admitted (current usage is the filter's business). Another namespace's
    // quota does not apply, and a namespace without a quota has no limit.
    let within = pod(
        json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000", "nvidia.com/gpucores": "50"}),
    );
    let a = webhook::handle(&review_in("team-a", within), &cfg(), &facts);
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
    let a = webhook::handle(&review_in("team-c", two_halves), &cfg(), &facts);
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
}

#[test]
fn the_quota_counts_the_larger_of_the_app_containers_sum_and_the_largest_init_container() {
    let facts = with_quotas(
        t4_and_a100(),
        &[(
            "team-a",
            "gpu",
            json!({"limits.nvidia.com/gpumem": "30000"}),
        )],
    );
    let mut p = pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10000"}));
    p["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "side", "image": "app",
            "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10000"}}}));
    // Init containers run before the app containers, not beside them: 25000 alone, not 45000.
    p["spec"]["initContainers"] = json!([{"name": "load", "image": "app",
        "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "25000"}}}]);
    let a = webhook::handle(&review_in("team-a", p.clone()), &cfg(), &facts);
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
    p["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = json!("31000");
    let m = denied(&webhook::handle(&review_in("team-a", p), &cfg(), &facts));
    assert!(
        m.starts_with("pod asks for 31000 MiB of GPU memory in total"),
        "{m}"
    );
}

#[test]
fn with_no_registered_gpu_seen_yet_the_webhook_admits_and_leaves_refusal_to_the_filter() {
    let huge = pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000000"}));
    let expected_patch = json!([
        {"op": "add", "path": "/spec/schedulerName", "value": "hami-scheduler"}
    ]);
    // A replica whose watch has not listed anything yet.
    let a = webhook::handle(
        &review_in("default", huge.clone()),
        &cfg(),
        &ClusterFacts::new(),
    );
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
    expect_patch(&a.body, expected_patch.clone());
    // Nodes seen, but none registered a GPU (device plugins not up yet): still no basis.
    let unregistered: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(json!({"metadata": {"name": "cpu-node"}})).unwrap();
    let a = webhook::handle(
        &review_in("default", huge),
        &cfg(),
        &node_facts(&[unregistered]),
    );
    assert_eq!(a.body["response"]["allowed"], true, "{}", a.body);
    expect_patch(&a.body, expected_patch);
}

#[test]
fn cluster_fact_checks_leave_other_schedulers_and_updates_alone() {
    let facts = t4_and_a100();
    let mut other = pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "100000"}));
    other["spec"]["schedulerName"] = json!("volcano");
    let a = webhook::handle(&review_in("default", other), &cfg(), &facts);
    assert_eq!(a.body["response"], json!({"uid": "req-1", "allowed": true}));
    let big = pod(json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "100000"}));
    let a = webhook::handle(
        &review("UPDATE", "alice", big.clone(), Some(big)),
        &cfg(),
        &facts,
    );
    assert_eq!(a.body["response"], json!({"uid": "req-1", "allowed": true}));
}

/// Every denial over cluster facts, whatever namespace the (possibly forged) review claims: no
/// node name, no GPU size, no quota name or value.
#[test]
fn denials_reveal_nothing_outside_the_pods_namespace() {
    let facts = with_quotas(
        t4_and_a100(),
        &[(
            "team-secret",
            "secret-quota-name",
            json!({"limits.nvidia.com/gpumem": "12345", "limits.nvidia.com/gpu": "3"}),
        )],
    );
    let probes = [
        (
            "default",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "90000"}),
        ),
        (
            "team-secret",
            json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000"}),
        ),
        (
            "team-secret",
            json!({"nvidia.com/gpu": "4", "nvidia.com/gpumem": "100"}),
        ),
    ];
    for (ns, limits) in probes {
        let m = denied(&webhook::handle(
            &review_in(ns, pod(limits)),
            &cfg(),
            &facts,
        ));
        for secret in [
            "a100-node",
            "t4-node",
            "81920",
            "15360",
            "secret-quota-name",
            "12345",
            " 3",
        ] {
            assert!(!m.contains(secret), "{ns}: {secret:?} leaked in {m}");
        }
    }
}

fn pod_with_env(limits: Value, env: Value) -> Value {
    let mut p = pod(limits);
    p["spec"]["containers"][0]["env"] = env;
    p
}

#[test]
fn gpu_pods_may_not_set_the_shims_control_variables() {
    let gpu = json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"});
    for name in [
        "CUDA_DISABLE_CONTROL",
        "CUDA_DEVICE_MEMORY_LIMIT",
        "CUDA_DEVICE_MEMORY_LIMIT_0",
        "CUDA_DEVICE_MEMORY_LIMIT_15",
        "CUDA_DEVICE_SM_LIMIT",
        "CUDA_DEVICE_SM_LIMIT_1",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE",
        "CUDA_OVERSUBSCRIBE",
        "GPU_CORE_UTILIZATION_POLICY",
    ] {
        let a = handle(
            &review_in(
                "team-a",
                pod_with_env(gpu.clone(), json!([{"name": name, "value": "true"}])),
            ),
            &cfg(),
        );
        assert_eq!(
            denied(&a),
            format!(
                "container main sets {name}: it switches off or overrides the GPU limits the device plugin gives the container; remove it (only namespaces listed in the scheduler's --webhook-allow-control-env-namespaces may set it, and team-a is not one)"
            )
        );
    }
    // valueFrom is denied by name too; so is an init container's.
    let from = pod_with_env(
        gpu.clone(),
        json!([{"name": "CUDA_DISABLE_CONTROL", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]),
    );
    assert!(
        denied(&handle(&review_in("team-a", from), &cfg()))
            .starts_with("container main sets CUDA_DISABLE_CONTROL")
    );
    let mut init = pod(gpu.clone());
    init["spec"]["initContainers"] = json!([{"name": "prep", "image": "app",
        "env": [{"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"}]}]);
    assert!(
        denied(&handle(&review_in("team-a", init), &cfg()))
            .starts_with("container prep sets CUDA_DEVICE_SM_LIMIT:")
    );
    // Even when the pod names another scheduler: the device plugin would still serve it.
    let mut other = pod_with_env(
        gpu.clone(),
        json!([{"name": "CUDA_DISABLE_CONTROL", "value": "1"}]),
    );
    other["spec"]["schedulerName"] = json!("my-scheduler");
    assert_eq!(
        handle(&review_in("team-a", other), &cfg()).body["response"]["allowed"],
        false
    );

    // Not control variables, GPU-less pods and allowed namespaces pass.
    for name in [
        "CUDA_DEVICE_MEMORY_LIMIT_X",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_TASK_PRIORITY",
        "LIBCUDA_LOG_LEVEL",
    ] {
        let a = handle(
            &review_in(
                "team-a",
                pod_with_env(gpu.clone(), json!([{"name": name, "value": "1"}])),
            ),
            &cfg(),
        );
        assert_eq!(a.body["response"]["allowed"], true, "{name}: {}", a.body);
    }
    let plain = pod_with_env(
        json!({"cpu": "1"}),
        json!([{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]),
    );
    assert_eq!(
        handle(&review_in("team-a", plain), &cfg()).body["response"]["allowed"],
        true
    );
    let mut allowing = cfg();
    allowing.allow_control_env_namespaces = ["ml-admin".to_owned()].into_iter().collect();
    let p = pod_with_env(
        gpu.clone(),
        json!([{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]),
    );
    assert_eq!(
        handle(&review_in("ml-admin", p.clone()), &allowing).body["response"]["allowed"],
        true
    );
    assert_eq!(
        handle(&review_in("team-a", p), &allowing).body["response"]["allowed"],
        false
    );
}

#[test]
fn control_variable_names() {
    assert!(webhook::is_control_env("CUDA_DEVICE_MEMORY_LIMIT_7"));
    assert!(!webhook::is_control_env("CUDA_DEVICE_MEMORY_LIMIT_"));
    assert!(!webhook::is_control_env("cuda_disable_control"));
    assert!(!webhook::is_control_env("CUDA_DEVICE_SM_LIMIT_1a"));
}
