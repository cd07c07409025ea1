//! Dynamic MIG placement (contract §6.4), each behaviour against the HAMi v2.10 source it
//! follows.

use hami_contract::mig::{MigAllocation, decode_allocations};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::{Placement, Verdict, filter_pod, reservation_for};
use tessera_scheduler_core::patch::binding_metadata;
use tessera_scheduler_core::state::ClusterState;

/// A node registering one GPU per entry of `modes` (`mig` GPUs with A100-40GB's profiles).
fn node(name: &str, modes: &[&str]) -> Node {
    let devices: Vec<serde_json::Value> = modes
        .iter()
        .enumerate()
        .map(|(i, mode)| {
            let mut d = json!({"id": format!("GPU-{name}-{i}"), "index": i, "count": if *mode == "mig" { 7 } else { 10 },
                "devmem": 40960, "devcore": 100, "type": "NVIDIA-A100-SXM4-40GB", "mode": mode, "health": true});
            if *mode == "mig" {
                d["migProfiles"] = serde_json::to_value(tessera_scheduler_core::fixtures::a100_mig_profiles()).unwrap_or_default();
            }
            d
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {
            "hami.io/node-nvidia-register": serde_json::to_string(&devices).unwrap_or_default()}},
    }))
    .unwrap_or_default()
}

fn pod(name: &str, nums: u32, mem: u32, annotations: serde_json::Value, init: bool) -> Pod {
    let limits = json!({"nvidia.com/gpu": nums.to_string(), "nvidia.com/gpumem": mem.to_string()});
    let mut spec =
        json!({"containers": [{"name": "main", "image": "app", "resources": {"limits": limits}}]});
    if init {
        spec["initContainers"] = json!([{"name": "setup", "image": "app", "resources": {"limits": {
            "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000"}}}]);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "annotations": annotations},
        "spec": spec,
    }))
    .unwrap_or_default()
}

/// A pod running on `node` with devices `allocated` and, if any, MIG reservations `mig`.
fn running(name: &str, node: &str, allocated: &str, mig: Option<&str>) -> Pod {
    let mut a = json!({"hami.io/vgpu-node": node, "hami.io/vgpu-devices-allocated": allocated,
        "hami.io/bind-phase": "success"});
    if let Some(m) = mig {
        a["hami.io/vgpu-mig-allocations"] = json!(m);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "annotations": a},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "app"}]},
        "status": {"phase": "Running"},
    }))
    .unwrap_or_default()
}

fn state(nodes: &[Node], pods: &[Pod]) -> ClusterState {
    tessera_scheduler_core::fixtures::cluster_state(nodes, pods)
}

fn place(s: &mut ClusterState, p: &Pod, nodes: &[&str]) -> Result<Placement, String> {
    let names: Vec<String> = nodes.iter().map(|n| (*n).to_owned()).collect();
    let uid = p.metadata.uid.clone().unwrap_or_default();
    match filter_pod(s, &DecisionConfig::default(), p, &uid, &names) {
        Verdict::Placed(pl) => Ok(pl),
        Verdict::NoFit { failed, .. } => Err(failed
            .values()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")),
        other => Err(format!("{other:?}")),
    }
}

fn picks(p: &Placement) -> Vec<(u32, u32, String, u32)> {
    p.mig
        .iter()
        .map(|a| {
            (
                a.container_index,
                a.device_index,
                a.profile.clone(),
                a.placement.start,
            )
        })
        .collect()
}

/// HAMi: pkg/device/nvidia/device.go `selectMigCandidate` (profiles by memoryMB then sliceCount,
/// the first with enough memory and a free placement) and mig_topology.go
/// `orderedMigPlacements` (1g./3g. from the highest start, others from the lowest);
/// `AddResourceUsage` books the profile's memory and core.
#[test]
fn the_smallest_profile_with_enough_memory_is_chosen_in_hamis_placement_order() {
    let n = node("n", &["mig"]);
    for (mem, profile, start, booked) in [
        (3000, "1g.5gb", 6, "GPU-n-0,NVIDIA,4864,15:;"),
        (8000, "2g.10gb", 0, "GPU-n-0,NVIDIA,9856,29:;"),
        (15000, "3g.20gb", 4, "GPU-n-0,NVIDIA,19968,43:;"),
        (30000, "7g.40gb", 0, "GPU-n-0,NVIDIA,40192,100:;"),
    ] {
        let mut s = state(std::slice::from_ref(&n), &[]);
        let p = place(&mut s, &pod("p", 1, mem, json!({}), false), &["n"]).expect("fits");
        assert_eq!(picks(&p), [(0, 0, profile.to_owned(), start)], "{mem} MiB");
        assert_eq!(p.devices.encode(), booked, "{mem} MiB");
    }
}

/// HAMi: device.go `Fit` (`CardMigTopologyInfeasible` when `CustomFilterRule` refuses a `mig`
/// GPU) and pkg/scheduler/scheduler.go `getNodesUsage` (a placed pod's reservations occupy
/// their placements).
#[test]
fn an_overlapping_placement_is_refused_with_hamis_reason() {
    let n = node("n", &["mig"]);
    let whole = r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-n-0","profile":"4g.20gb","placement":{"start":0,"size":4}}]"#;
    let mut s = state(
        std::slice::from_ref(&n),
        &[running(
            "old",
            "n",
            "GPU-n-0,NVIDIA,19968,58:;",
            Some(whole),
        )],
    );
    // 4g.20gb at 0 leaves slices 4..8: 20000 MiB passes the memory check (20992 MiB left) but
    // only 7g.40gb has that much, and it overlaps.
    assert_eq!(
        place(&mut s, &pod("b", 1, 20000, json!({}), false), &["n"]),
        Err("1/1 CardMigTopologyInfeasible".to_owned())
    );
    // A 3g.20gb (start 4) fits.
    let p = place(&mut s, &pod("a", 1, 15000, json!({}), false), &["n"]).expect("fits");
    assert_eq!(picks(&p), [(0, 0, "3g.20gb".to_owned(), 4)]);
}

/// HAMi: device.go `Fit` visits a `mig` GPU again (`if dev.Mode == "mig" { i++ }`) and
/// `CustomFilterRule` counts the container's earlier picks; score.go `isMIGRequest` lifts
/// `NodeInsufficientDevice`; mig_allocations.go `EncodeMigAllocations` numbers the devices.
#[test]
fn one_mig_gpu_serves_several_devices_of_one_container() {
    let n = node("n", &["mig"]);
    let mut s = state(std::slice::from_ref(&n), &[]);
    let p = place(&mut s, &pod("p", 3, 4000, json!({}), false), &["n"]).expect("fits");
    assert_eq!(
        picks(&p),
        [
            (0, 0, "1g.5gb".to_owned(), 6),
            (0, 1, "1g.5gb".to_owned(), 5),
            (0, 2, "1g.5gb".to_owned(), 4)
        ]
    );
    // Eight 1g instances do not fit in seven slices: the eighth visit is refused, and HAMi
    // counts the seven devices taken against the one card (`GenReason`, sorted as strings).
    assert_eq!(
        place(&mut s, &pod("q", 8, 4000, json!({}), false), &["n"]),
        Err("1/1 CardMigTopologyInfeasible, 7/1 AllocatedCardsInsufficientRequest".to_owned())
    );
}

/// HAMi: scheduler.go `getNodesUsage`: a `mig` GPU used by a pod without a reservation is
/// marked unhealthy, so is a `hami-core` GPU a reservation names.
#[test]
fn a_mig_gpu_used_without_a_reservation_is_unhealthy() {
    let n = node("n", &["mig", "hami-core"]);
    let mut s = state(
        std::slice::from_ref(&n),
        &[running("old", "n", "GPU-n-0,NVIDIA,4864,15:;", None)],
    );
    let p = place(
        &mut s,
        &pod("a", 1, 3000, json!({"nvidia.com/vgpu-mode": "mig"}), false),
        &["n"],
    );
    assert_eq!(p, Err("1/2 CardNotHealth, 1/2 CardTypeMismatch".to_owned()));
    let wrong = r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-n-1","profile":"1g.5gb","placement":{"start":6,"size":1}}]"#;
    let mut s = state(
        std::slice::from_ref(&n),
        &[running("old", "n", "GPU-n-1,NVIDIA,4864,15:;", Some(wrong))],
    );
    let p = place(
        &mut s,
        &pod(
            "a",
            1,
            3000,
            json!({"nvidia.com/vgpu-mode": "hami-core"}),
            false,
        ),
        &["n"],
    );
    assert_eq!(p, Err("1/2 CardNotHealth, 1/2 CardTypeMismatch".to_owned()));
}

/// In-flight reservations occupy their placements (the overlay extends HAMi's rebuild): a burst
/// of pods onto one MIG GPU never gets one placement twice.
#[test]
fn a_burst_of_reservations_never_double_books_a_placement() {
    let n = node("n", &["mig"]);
    let mut s = state(std::slice::from_ref(&n), &[]);
    let mut starts = Vec::new();
    for i in 0..8 {
        let p = pod(&format!("p{i}"), 1, 4000, json!({}), false);
        let uid = p.metadata.uid.clone().unwrap_or_default();
        match place(&mut s, &p, &["n"]) {
            Ok(pl) => {
                starts.push(pl.mig[0].placement.start);
                s.reserve(reservation_for(&p, &uid, &pl, 1));
            }
            Err(r) => {
                assert_eq!(i, 7, "{r}");
                assert_eq!(r, "1/1 CardTimeSlicingExhausted");
            }
        }
    }
    assert_eq!(starts, [6, 5, 4, 3, 2, 1, 0]);
    // A bigger profile after two 1g instances: 2g.10gb goes to the lowest free pair.
    let mut s = state(std::slice::from_ref(&n), &[]);
    for i in 0..2 {
        let p = pod(&format!("s{i}"), 1, 4000, json!({}), false);
        let pl = place(&mut s, &p, &["n"]).expect("fits");
        s.reserve(reservation_for(&p, &format!("uid-s{i}"), &pl, 1));
    }
    let pl = place(&mut s, &pod("big", 1, 8000, json!({}), false), &["n"]).expect("fits");
    assert_eq!(picks(&pl), [(0, 0, "2g.10gb".to_owned(), 0)]);
}

/// HAMi: device.go `checkType` (`nvidia.com/vgpu-mode` must contain the GPU's mode) on a node
/// with both kinds of GPU.
#[test]
fn the_vgpu_mode_annotation_steers_between_mig_and_hami_core_gpus() {
    let n = node("n", &["hami-core", "mig"]);
    let mut s = state(std::slice::from_ref(&n), &[]);
    let p = place(
        &mut s,
        &pod("m", 1, 3000, json!({"nvidia.com/vgpu-mode": "mig"}), false),
        &["n"],
    )
    .expect("fits");
    assert_eq!(p.devices.encode(), "GPU-n-1,NVIDIA,4864,15:;");
    assert_eq!(picks(&p), [(0, 0, "1g.5gb".to_owned(), 6)]);
    let p = place(
        &mut s,
        &pod(
            "h",
            1,
            3000,
            json!({"nvidia.com/vgpu-mode": "hami-core"}),
            false,
        ),
        &["n"],
    )
    .expect("fits");
    assert_eq!(p.devices.encode(), "GPU-n-0,NVIDIA,3000,0:;");
    assert!(p.mig.is_empty());
}

/// HAMi: score.go `scoreNode` puts init containers first in the device list, and
/// `EncodeMigAllocations` numbers containers in that list (the device plugin's
/// `GetContainerDeviceStrArray` index space); the Binding carries the reservation.
#[test]
fn container_indices_count_init_containers_first_and_the_binding_carries_them() {
    let n = node("n", &["mig"]);
    let mut s = state(std::slice::from_ref(&n), &[]);
    let p = place(&mut s, &pod("p", 1, 8000, json!({}), true), &["n"]).expect("fits");
    // The init container is fitted on its own copy: both start from an empty GPU.
    assert_eq!(
        picks(&p),
        [
            (0, 0, "1g.5gb".to_owned(), 6),
            (1, 0, "2g.10gb".to_owned(), 0)
        ]
    );
    let meta = binding_metadata(&p.node, &p.devices, &p.mig, 1);
    let raw = &meta.annotations["hami.io/vgpu-mig-allocations"];
    let decoded: Vec<MigAllocation> = decode_allocations(raw).expect("HAMi's decoder accepts it");
    assert_eq!(decoded, p.mig);
}

/// `simulate` places MIG requests and, when a MIG GPU refuses one, says per GPU what is free.
#[test]
fn simulate_explains_a_mig_refusal_per_gpu() {
    use tessera_scheduler_core::simulate::{Input, run};
    let n = node("n1", &["mig"]);
    // A 3g.20gb at slices 4..8 is in use: memory is left for 20000 MiB, but no placement of the
    // only profile that large (7g.40gb); 3g.20gb still can go at 0.
    let busy = running(
        "busy",
        "n1",
        "GPU-n1-0,NVIDIA,19968,43:;",
        Some(
            r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-n1-0","profile":"3g.20gb","placement":{"start":4,"size":4}}]"#,
        ),
    );
    let input = Input {
        nodes: vec![n],
        running: vec![busy],
        pending: vec![
            pod("big", 1, 20000, json!({}), false),
            pod("mid", 1, 19000, json!({}), false),
        ],
        ..Input::default()
    };
    let out = run(&input, &DecisionConfig::default());
    assert_eq!(out[0].node, None, "{:?}", out[0]);
    let lines = out[0]
        .mig
        .get("n1")
        .unwrap_or_else(|| panic!("{:?}", out[0]));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("GPU 0 (GPU-n1-0): no free placement for a profile with >= 20000 MiB"),
        "{}",
        lines[0]
    );
    assert!(
        lines[0].contains("3g.20gb (19968 MiB) at 0"),
        "{}",
        lines[0]
    );
    assert!(
        lines[0].contains("7g.40gb (40192 MiB): none"),
        "{}",
        lines[0]
    );
    assert_eq!(out[1].node.as_deref(), Some("n1"));
    assert!(out[1].mig.is_empty());
}
