//! AdmissionReview golden tests: HAMi's mutations and every denial, forged annotations on create
//! and update.

use serde_json::{Value, json};
use tessera_scheduler::webhook::{WebhookConfig, base64_encode, handle};

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

fn denied(a: &tessera_scheduler::webhook::WebhookAnswer) -> String {
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
    assert_eq!(
        denied(&handle(&review("CREATE", "u", privileged, None), &c)),
        "container main is privileged"
    );
    let mut assigned = pod(json!({"nvidia.com/gpu": "1"}));
    assigned["spec"]["nodeName"] = json!("node1");
    assert_eq!(
        denied(&handle(&review("CREATE", "u", assigned, None), &c)),
        "pod has node assigned"
    );
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
