//! `simulate` for pods that use ResourceClaims: claims allocated on Tessera's DRA devices as
//! kube-scheduler would, from slices and the claims already allocated.

use proptest::prelude::*;
use serde_json::{Value, json};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::simulate::{Input, PodResult, input_warnings, run};

/// A node's slice with `gpus` devices of `gib` GiB each; `multiple`: consumable capacity.
fn slice(node: &str, gpus: u32, gib: u32, multiple: bool) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| {
            json!({
                "name": format!("gpu-{i}"),
                "allowMultipleAllocations": multiple,
                "attributes": {
                    "uuid": {"string": format!("GPU-{node}-{i}")},
                    "nvlinkDomain": {"int": i / 2 * 2},
                },
                "capacity": {
                    "memory": {"value": format!("{gib}Gi"), "requestPolicy": {"default": format!("{gib}Gi"), "validRange": {"min": "1Mi", "step": "1Mi"}}},
                    "cores": {"value": "100", "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
                },
            })
        })
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-slice")},
        "spec": {"driver": "gpu.tessera.dev", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices},
    })
}

/// A template with one request for `memory` and `cores` (either may be absent).
fn template(name: &str, request: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"spec": {"devices": request}},
    })
}

fn share(name: &str, memory: &str, cores: &str) -> Value {
    template(
        name,
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev",
            "capacity": {"requests": {"memory": memory, "cores": cores}}}}]}),
    )
}

/// A pending pod using `claims` (`(pod claim name, "template:<t>" or "claim:<c>")`).
fn pod(name: &str, claims: &[(&str, &str)]) -> Value {
    let refs: Vec<Value> = claims
        .iter()
        .map(|(n, r)| match r.split_once(':') {
            Some(("claim", c)) => json!({"name": n, "resourceClaimName": c}),
            Some((_, t)) => json!({"name": n, "resourceClaimTemplateName": t}),
            None => unreachable!("fixture"),
        })
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"resourceClaims": refs, "containers": [{"name": "app", "image": "cuda"}]},
    })
}

fn simulate(objects: &[Value]) -> Vec<PodResult> {
    let text: String = objects
        .iter()
        .map(|o| format!("---\n{}\n", serde_json::to_string(o).unwrap()))
        .collect();
    run(&Input::parse(&text).unwrap(), &DecisionConfig::default())
}

fn result<'a>(results: &'a [PodResult], pod: &str) -> &'a PodResult {
    results
        .iter()
        .find(|r| r.pod == format!("ml/{pod}"))
        .unwrap_or_else(|| panic!("no result for {pod}: {results:?}"))
}

#[test]
fn shares_fill_a_gpu_and_the_next_goes_elsewhere_with_the_reason() {
    let r = simulate(&[
        slice("a-node", 1, 40, true),
        slice("b-node", 1, 40, true),
        share("big", "30Gi", "10"),
        pod("p1", &[("gpu", "template:big")]),
        pod("p2", &[("gpu", "template:big")]),
        pod("p3", &[("gpu", "template:big")]),
    ]);
    assert_eq!(result(&r, "p1").node.as_deref(), Some("a-node"));
    assert_eq!(
        result(&r, "p1").devices,
        "claim gpu, request gpu: a-node/gpu-0 memory=30Gi cores=10"
    );
    let p2 = result(&r, "p2");
    assert_eq!(p2.node.as_deref(), Some("b-node"));
    assert_eq!(
        p2.reasons["a-node"],
        "claim gpu: request gpu: a-node/gpu-0 has 10Gi memory free, needs 30Gi"
    );
    let p3 = result(&r, "p3");
    assert_eq!(p3.node, None, "no over-booking");
    assert_eq!(p3.reasons.len(), 2);
}

#[test]
fn requests_are_rounded_up_by_the_request_policy_and_unnamed_capacity_takes_the_default() {
    let mut s = slice("a-node", 1, 40, true);
    s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] =
        json!("1Gi");
    s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"]["min"] =
        json!("1Gi");
    let r = simulate(&[
        s,
        share("odd", "1500Mi", "1"),
        template(
            "memory-only",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev",
                "capacity": {"requests": {"memory": "1Gi"}}}}]}),
        ),
        pod("odd", &[("gpu", "template:odd")]),
        pod("memory-only", &[("gpu", "template:memory-only")]),
    ]);
    assert_eq!(
        result(&r, "odd").devices,
        "claim gpu, request gpu: a-node/gpu-0 memory=2Gi cores=1"
    );
    // No cores asked: the policy's default, all 100, which 99 free cannot give.
    let m = result(&r, "memory-only");
    assert_eq!(m.node, None);
    assert_eq!(
        m.reasons["a-node"],
        "claim gpu: request gpu: a-node/gpu-0 has 99 cores free, needs 100"
    );
}

#[test]
fn allocated_claims_count_and_a_named_claim_is_allocated_once_for_every_pod_using_it() {
    let allocated = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "old", "namespace": "ml"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
        "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.tessera.dev",
            "pool": "a-node", "device": "gpu-0", "consumedCapacity": {"memory": "39Gi", "cores": "50"}}]}}},
    });
    let shared = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "team-gpu", "namespace": "ml"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev",
            "capacity": {"requests": {"memory": "20Gi", "cores": "20"}}}}]}},
    });
    let r = simulate(&[
        slice("a-node", 1, 40, true),
        slice("b-node", 1, 40, true),
        allocated,
        shared,
        pod("first", &[("gpu", "claim:team-gpu")]),
        pod("second", &[("gpu", "claim:team-gpu")]),
        pod(
            "third",
            &[("gpu", "claim:team-gpu"), ("more", "template:more")],
        ),
        pod("fourth", &[("gpu", "claim:team-gpu"), ("old", "claim:old")]),
        share("more", "30Gi", "10"),
    ]);
    let first = result(&r, "first");
    assert_eq!(first.node.as_deref(), Some("b-node"), "{first:?}");
    assert!(first.reasons["a-node"].contains("has 1Gi memory free"));
    // The second pod shares the allocated claim: same node, nothing booked again.
    let second = result(&r, "second");
    assert_eq!(second.node.as_deref(), Some("b-node"));
    assert_eq!(second.devices, "");
    // The third must go where the claim is, and b-node has 20 GiB left.
    // Two claims allocated on different nodes: nowhere.
    assert_eq!(
        result(&r, "fourth").error.as_deref(),
        Some(
            "claim ml/old is allocated on a-node and claim ml/team-gpu on b-node: no node has both"
        )
    );
    let third = result(&r, "third");
    assert_eq!(third.node, None);
    assert_eq!(
        third.reasons["b-node"],
        "claim more: request gpu: b-node/gpu-0 has 20Gi memory free, needs 30Gi (claim ml/team-gpu is allocated on this node)"
    );
}

#[test]
fn constraints_first_available_and_whole_devices() {
    let nvlinked_pair = template(
        "pair",
        json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.tessera.dev", "count": 2,
                "capacity": {"requests": {"memory": "10Gi", "cores": "50"}}}}],
               "constraints": [{"requests": ["gpus"], "distinctAttribute": "gpu.tessera.dev/uuid"},
                               {"requests": ["gpus"], "matchAttribute": "gpu.tessera.dev/nvlinkDomain"}]}),
    );
    let fallback = template(
        "fallback",
        json!({"requests": [{"name": "gpu", "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu.tessera.dev", "capacity": {"requests": {"memory": "35Gi"}}},
            {"name": "small", "deviceClassName": "gpu.tessera.dev", "capacity": {"requests": {"memory": "1Gi", "cores": "1"}}},
        ]}]}),
    );
    let r = simulate(&[
        // gpu-0, gpu-1 in domain 0; gpu-2 in domain 2.
        slice("a-node", 3, 40, true),
        slice("x-whole", 1, 40, false),
        share("fill", "35Gi", "10"),
        nvlinked_pair,
        fallback,
        template(
            "whole",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}),
        ),
        pod("fill-0", &[("gpu", "template:fill")]),
        pod("pair", &[("gpus", "template:pair")]),
        pod("fallback", &[("gpu", "template:fallback")]),
        pod("whole-1", &[("gpu", "template:whole")]),
        pod("whole-2", &[("gpu", "template:whole")]),
    ]);
    // gpu-0 has 5 GiB left, so the pair cannot use domain 0 (gpu-0 and gpu-1), nor gpu-2
    // alone (twice on gpu-1 is not two distinct GPUs); x-whole has one device. Refused, with
    // each reason.
    let pair = result(&r, "pair");
    assert_eq!(pair.node, None, "{pair:?}");
    assert_eq!(
        pair.reasons["a-node"],
        "claim gpus: request gpus: a-node/gpu-0 has 5Gi memory free, needs 10Gi; \
         request gpus: not enough devices with distinct gpu.tessera.dev/uuid have room (distinctAttribute); \
         request gpus: no devices with the same gpu.tessera.dev/nvlinkDomain have room (matchAttribute)"
    );
    // gpu-1 has 35 GiB (and all its cores) free: the first alternative.
    assert_eq!(
        result(&r, "fallback").devices,
        "claim gpu, request gpu/big: a-node/gpu-1 memory=35Gi cores=100"
    );
    // A device without consumable capacity goes whole, to one claim. a-node has gpu-2 free.
    assert_eq!(result(&r, "whole-1").node.as_deref(), Some("a-node"));
    assert_eq!(
        result(&r, "whole-1").devices,
        "claim gpu, request gpu: a-node/gpu-2 memory=40Gi cores=100"
    );
    let w2 = result(&r, "whole-2");
    assert_eq!(w2.node.as_deref(), Some("x-whole"));
    assert_eq!(
        w2.devices,
        "claim gpu, request gpu: x-whole/gpu-0 (the whole device)"
    );
}

#[test]
fn what_simulate_cannot_model_is_said_not_guessed() {
    let r = simulate(&[
        slice("a-node", 1, 40, true),
        template(
            "other",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}),
        ),
        template(
            "picky",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev",
                "selectors": [{"cel": {"expression": "device.attributes[\"gpu.tessera.dev\"].productName == \"X\""}}]}}]}),
        ),
        pod("other", &[("gpu", "template:other")]),
        pod("picky", &[("gpu", "template:picky")]),
        pod("missing", &[("gpu", "template:nope")]),
    ]);
    assert!(
        result(&r, "other")
            .error
            .as_deref()
            .unwrap()
            .contains("does not select gpu.tessera.dev devices")
    );
    let picky = result(&r, "picky");
    assert_eq!(picky.node.as_deref(), Some("a-node"));
    assert!(picky.notes[0].contains("CEL selectors are not evaluated"));
    assert_eq!(
        result(&r, "missing").error.as_deref(),
        Some("ResourceClaimTemplate ml/nope (claim gpu) is not in the input")
    );
}

#[test]
fn a_slice_without_a_node_or_with_a_bad_quantity_is_reported() {
    let mut s = slice("a-node", 1, 40, true);
    s["spec"]["devices"][0]["capacity"]["cores"]["value"] = json!("lots");
    let mut cluster_wide = slice("b-node", 1, 40, true);
    cluster_wide["spec"]
        .as_object_mut()
        .unwrap()
        .remove("nodeName");
    cluster_wide["spec"]["allNodes"] = json!(true);
    let text = [s, cluster_wide]
        .iter()
        .map(|o| format!("---\n{o}\n"))
        .collect::<String>();
    let warnings = input_warnings(&Input::parse(&text).unwrap());
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[0].contains("capacity cores \"lots\" is not a quantity"));
    assert!(warnings[1].contains("no nodeName"));
}

proptest! {
    /// Whatever shares are asked in whatever order, no device ever gives more memory or cores
    /// than it has, and a refused pod is refused on every node.
    #[test]
    fn no_device_is_ever_over_booked(
        asks in proptest::collection::vec((1u32..48, 1u32..101), 1..24),
    ) {
        let mut objects = vec![slice("a-node", 2, 40, true), slice("b-node", 1, 24, true)];
        for (i, (gib, cores)) in asks.iter().enumerate() {
            objects.push(share(&format!("t{i}"), &format!("{gib}Gi"), &cores.to_string()));
            objects.push(pod(&format!("p{i}"), &[("gpu", &format!("template:t{i}"))]));
        }
        let r = simulate(&objects);
        let mut used: std::collections::BTreeMap<String, (u32, u32)> = Default::default();
        for (i, (gib, cores)) in asks.iter().enumerate() {
            let res = result(&r, &format!("p{i}"));
            match &res.node {
                Some(_) => {
                    let device = res.devices.split(": ").nth(1).unwrap().split(' ').next().unwrap();
                    let u = used.entry(device.to_owned()).or_default();
                    u.0 += gib;
                    u.1 += cores;
                }
                None => prop_assert_eq!(res.reasons.len(), 2),
            }
        }
        for (device, (gib, cores)) in used {
            let total = if device.starts_with("b-node") { 24 } else { 40 };
            prop_assert!(gib <= total && cores <= 100, "{} booked {} GiB, {} cores", device, gib, cores);
        }
    }
}

#[test]
fn absurd_numbers_give_answers_not_panics() {
    let mut s = slice("a-node", 1, 40, true);
    let memory = &mut s["spec"]["devices"][0]["capacity"]["memory"];
    memory["value"] = json!("170141183460469231731687303715884105727");
    memory["requestPolicy"]["validRange"] =
        json!({"min": "-170141183460469231731687303715884105727", "step": "7"});
    let r = simulate(&[
        s,
        share("huge", "170141183460469231731687303715884105727", "100"),
        template(
            "many",
            json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev", "count": 9_000_000_000_000i64}}]}),
        ),
        pod("huge", &[("gpu", "template:huge")]),
        pod("many", &[("gpu", "template:many")]),
    ]);
    assert_eq!(result(&r, "huge").node, None);
    assert!(
        result(&r, "many")
            .error
            .as_deref()
            .unwrap()
            .contains("more than the 32 devices")
    );
}
