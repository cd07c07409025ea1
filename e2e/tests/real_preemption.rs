//! GPU-aware preemption (issue 30) on a real node: kubelet v1.34 and containerd run every pod,
//! the chart is installed with `helm install` and its kube-scheduler runs in a pod, first the
//! cluster's own release (v1.34, with the `scheduler.preemption.countSlots` opt-in), then, after
//! a `helm upgrade`, v1.38.0-beta.0 with the chart's default configuration. What is checked is
//! what a user sees: which pods are evicted, where the preemptor runs, the Events, and that
//! nothing is overbooked.
//!
//! One cluster for every case: a node with two A100s, each split in three (six slots).
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::probe::{self, Slice};
use tessera_e2e::real::{
    self, ChartValues, NAMESPACE, RealCluster, RealClusterOptions, RealNodeSpec,
};
use tessera_e2e::{Error, Result, eventually};

const TENANT: &str = "team-a";
const NODE: &str = "gpu-node";
const A100_MIB: u64 = 40960;
/// How long a victim takes to go: the probe's shell is its container's PID 1 and ignores
/// SIGTERM, so each eviction lasts the whole grace period, as a job that checkpoints would.
const GRACE_SECONDS: i64 = 10;

/// The priority classes of every case.
const CLASSES: [(&str, i32); 6] = [
    ("lowest", 5),
    ("low", 10),
    ("lowish", 20),
    ("fair", 30),
    ("mid", 100),
    ("top", 1000),
];

/// A pod of the tenant that keeps running: priority class `class`, one GPU of `mib` MiB, on GPU
/// `uuid` when given (HAMi's `nvidia.com/use-gpuuuid`), labelled `app: <name>`.
fn pod(name: &str, class: &str, mib: u64, uuid: Option<&str>) -> Pod {
    let main = probe::container("main", &Slice::mib(1, mib), true);
    let mut p = probe::pod(TENANT, name, None, Vec::new(), vec![main]);
    p.metadata.labels = Some(BTreeMap::from([("app".to_owned(), name.to_owned())]));
    if let Some(uuid) = uuid {
        p.metadata.annotations = Some(BTreeMap::from([(
            "nvidia.com/use-gpuuuid".to_owned(),
            uuid.to_owned(),
        )]));
    }
    let spec = p.spec.as_mut().expect("a probe pod has a spec");
    spec.priority_class_name = Some(class.to_owned());
    spec.termination_grace_period_seconds = Some(GRACE_SECONDS);
    p
}

/// Creates each pod as the tenant and waits until it runs before the next, so every placement
/// is known when the next pod is decided.
async fn run_in_order(c: &RealCluster, pods: Vec<Pod>) -> Result<()> {
    for p in pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        c.create_pod_as_user(&p).await?;
        running(c, &name, Duration::from_secs(120)).await?;
    }
    Ok(())
}

/// Waits until pod `name` runs; returns it.
async fn running(c: &RealCluster, name: &str, within: Duration) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let found = eventually(
        &format!("{name} Running"),
        within,
        Duration::from_millis(500),
        || async {
            let p = api.get_opt(name).await.ok().flatten()?;
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            (phase == Some("Running")).then_some(p)
        },
    )
    .await;
    match found {
        Ok(p) => Ok(p),
        Err(e) => Err(Error::msg(format!(
            "{e}\n{}\n{}",
            c.describe_pods(TENANT).await,
            c.logs_tail(20)
        ))),
    }
}

/// UID of every pod of the tenant not being deleted, by name.
async fn alive(c: &RealCluster) -> Result<BTreeMap<String, String>> {
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            (
                p.metadata.name.unwrap_or_default(),
                p.metadata.uid.unwrap_or_default(),
            )
        })
        .collect())
}

/// The pods of the tenant that are gone or going, among `names`, once `expected` are.
async fn wait_evicted(c: &RealCluster, expected: &[&str]) -> Result<()> {
    eventually(
        &format!("{expected:?} evicted"),
        Duration::from_secs(90),
        Duration::from_millis(500),
        || async {
            let alive = alive(c).await.ok()?;
            expected
                .iter()
                .all(|n| !alive.contains_key(*n))
                .then_some(())
        },
    )
    .await
}

/// The message of the newest Event with `reason` on pod `name` of the tenant.
async fn event(c: &RealCluster, name: &str, reason: &str) -> Result<String> {
    let evs: Api<Event> = Api::namespaced(c.admin().clone(), TENANT);
    let found = eventually(
        &format!("a {reason} Event on {name}"),
        Duration::from_secs(60),
        Duration::from_millis(500),
        || async {
            let list = evs.list(&ListParams::default()).await.ok()?;
            list.items.into_iter().rev().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.involved_object.name.as_deref() == Some(name)
            })
        },
    )
    .await?;
    let message = found.message.unwrap_or_default();
    eprintln!("{reason} on {name}: {message}");
    Ok(message)
}

/// The GPU UUIDs pod `name` was given (`hami.io/vgpu-devices-allocated`, HAMi's encoding).
async fn gpus_of(c: &RealCluster, name: &str) -> Result<String> {
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let p = api.get(name).await?;
    Ok(p.metadata
        .annotations
        .unwrap_or_default()
        .get("hami.io/vgpu-devices-allocated")
        .cloned()
        .unwrap_or_default())
}

/// No GPU booked beyond its registered memory or slots, by the pods' own annotations.
async fn assert_not_overbooked(c: &RealCluster) -> Result<()> {
    let nodes: Api<Node> = Api::all(c.admin().clone());
    let pods: Api<Pod> = Api::all(c.admin().clone());
    let nodes = nodes.list(&ListParams::default()).await?.items;
    let pods = pods.list(&ListParams::default()).await?.items;
    let violations = tessera_e2e::booking::violations(&nodes, &pods);
    assert!(violations.is_empty(), "overbooked: {violations:?}");
    Ok(())
}

/// The whole of issue 30's "done when" on real nodes, on both kube-scheduler releases.
#[test]
fn real_nodes_preemption_frees_exactly_the_slice_it_needs_on_both_kube_scheduler_releases()
-> Result<()> {
    real::run(1, |net| async move {
        let node = NodeSpec::uniform(NODE, 2, "NVIDIA A100-SXM4-40GB", A100_MIB);
        let gpu0 = node.gpus[0].uuid.clone();
        let gpu1 = node.gpus[1].uuid.clone();
        let set = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        let c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-preempt".into(),
                nodes: vec![RealNodeSpec::gpu(node)],
                chart: ChartValues::Recommended(vec![
                    set("devicePlugin.deviceSplitCount", "3"),
                    // v1.34's opt-in: kube-scheduler counts the slots (deviation L6).
                    set("scheduler.preemption.countSlots", "true"),
                ]),
            },
        )
        .await?;
        c.tenant_namespace(TENANT).await?;
        // kube-scheduler counts the slots only once the kubelet reports them (its next node
        // status after the plugin registers); a pod tried before that waits for kube-scheduler's
        // periodic retry of unschedulable pods (five minutes).
        let nodes: Api<Node> = Api::all(c.admin().clone());
        eventually(
            "the node's six slots in its allocatable",
            Duration::from_secs(60),
            Duration::from_millis(500),
            || async {
                let n = nodes.get(NODE).await.ok()?;
                let slots = n.status?.allocatable?.get("nvidia.com/gpu")?.0.clone();
                (slots == "6").then_some(())
            },
        )
        .await?;
        let classes: Api<PriorityClass> = Api::all(c.admin().clone());
        for (name, value) in CLASSES {
            let pc: PriorityClass = serde_json::from_value(json!({
                "metadata": {"name": name}, "value": value}))?;
            classes.create(&PostParams::default(), &pc).await?;
        }

        counted_slots_on_v1_34(&c, &gpu0, &gpu1).await?;
        operator_answers(&c, &gpu0, &gpu1).await?;

        // The newer kube-scheduler, with the chart's default configuration (no slot counting):
        // GPU memory pressure alone now reaches the extender. It emulates kube 1.35, the oldest
        // it can, so it asks nothing of the v1.34 API server that it lacks (v1.38 lists
        // DeviceTaintRules, and would wait for them forever); what it runs, preemption's code
        // included, is still its own.
        let api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
        tessera_e2e::pods::delete_all(&api, Duration::from_secs(90)).await?;
        let tag = c.import_kube_scheduler_next().await?;
        c.helm_upgrade_set(&[
            ("scheduler.kubeScheduler.image.tag", &tag),
            (
                "scheduler.kubeScheduler.extraNewArgs",
                "{-v=2,--emulated-version=kube=1.35}",
            ),
            ("scheduler.preemption.countSlots", "false"),
        ])
        .await?;
        kube_scheduler_runs(&c, &tag).await?;
        c.wait_release_serving().await?;

        budget_on_newer_kube_scheduler(&c, &gpu0, &gpu1).await?;
        Ok(())
    })
}

/// v1.34 with counted slots. GPU 0: `a-low` (10), `a-lowish` (20), `a-top` (1000); GPU 1:
/// `b-top` (1000) and two `fair` (30) pods: every slot taken. `urgent` (100) needs 30,000 MiB.
/// kube-scheduler's dry run frees one slot with the least important pod (`a-low`); the extender
/// adds `a-lowish`, whose memory is needed too, rather than GPU 1's two more important pods; the
/// GPUs' other tenants stay. While the victims take their grace period, a lower-priority pod that
/// fits only in the slice being freed does not take it. A pod no eviction can help evicts
/// nothing and is told so.
async fn counted_slots_on_v1_34(c: &RealCluster, gpu0: &str, gpu1: &str) -> Result<()> {
    run_in_order(
        c,
        vec![
            pod("a-low", "low", 12000, Some(gpu0)),
            pod("a-lowish", "lowish", 12000, Some(gpu0)),
            pod("a-top", "top", 8000, Some(gpu0)),
            pod("b-top", "top", 8000, Some(gpu1)),
            pod("b-fair-1", "fair", 16000, Some(gpu1)),
            pod("b-fair-2", "fair", 16000, Some(gpu1)),
        ],
    )
    .await?;
    let before = alive(c).await?;
    c.create_pod_as_user(&pod("urgent", "mid", 30000, None))
        .await?;
    let message = event(c, "urgent", "PreemptionCandidates").await?;
    assert!(
        message.contains("evicting team-a/a-lowish (priority 20) frees GPU-")
            && message.contains("with 1 pod(s) kube-scheduler chose"),
        "{message}"
    );
    // In the victims' grace period: 20,000 MiB fits only where they are leaving.
    c.create_pod_as_user(&pod("sneak", "low", 20000, None))
        .await?;
    wait_evicted(c, &["a-low", "a-lowish"]).await?;
    running(c, "urgent", Duration::from_secs(120)).await?;
    assert!(
        gpus_of(c, "urgent").await?.contains(gpu0),
        "urgent runs on the GPU its victims freed"
    );
    let after = alive(c).await?;
    for name in ["a-top", "b-top", "b-fair-1", "b-fair-2"] {
        assert_eq!(
            after.get(name),
            before.get(name),
            "{name} untouched (same UID, not terminating)"
        );
    }
    for (victim, mib) in [("a-low", 12000), ("a-lowish", 12000)] {
        let message = event(c, victim, "GPUSlicePreempted").await?;
        assert!(
            message.contains(&format!(" {mib} MiB ")) && message.contains(gpu0),
            "{victim}: {message}"
        );
    }
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let sneak = api.get("sneak").await?;
    assert!(
        tessera_e2e::pods::node_of(&sneak).is_none(),
        "the lower-priority pod did not take the freed slice"
    );

    // Two cards of 36,000 MiB: each A100 keeps a priority-1000 tenant's 8,000 MiB, so no
    // eviction can make room; nothing is evicted and the pod is told why.
    let mut pair = pod("pair", "top", 36000, None);
    let limits = pair.spec.as_mut().expect("spec").containers[0]
        .resources
        .as_mut()
        .and_then(|r| r.limits.as_mut())
        .expect("limits");
    limits.insert(
        "nvidia.com/gpu".into(),
        k8s_openapi::apimachinery::pkg::api::resource::Quantity("2".into()),
    );
    c.create_pod_as_user(&pair).await?;
    let message = event(c, "pair", "PreemptionNotHelpful").await?;
    assert!(message.contains(NODE), "{message}");
    let now = alive(c).await?;
    for name in ["urgent", "a-top", "b-top", "b-fair-1", "b-fair-2"] {
        assert_eq!(now.get(name), after.get(name), "{name} evicted for nothing");
    }
    assert!(tessera_e2e::pods::node_of(&api.get("pair").await?).is_none());
    assert_not_overbooked(c).await
}

/// `kubectl tessera` (issue 34) on the cluster the v1.34 case leaves: GPU 0 holds `a-top`
/// (8,000 MiB) and `urgent` (30,000), two of its three slots; GPU 1 is full (three pods, 40,000
/// MiB); `sneak` and `pair` are pending. What an operator and a tenant read.
async fn operator_answers(c: &RealCluster, gpu0: &str, gpu1: &str) -> Result<()> {
    let run = |as_tenant: bool, args: &'static [&'static str]| async move {
        let (ok, text) = c.kubectl_tessera(as_tenant, args).await?;
        eprintln!(
            "kubectl tessera {} ({}):\n{text}",
            args.join(" "),
            if as_tenant { "tenant" } else { "admin" }
        );
        Ok::<_, Error>((ok, text))
    };
    // Who uses which GPU, for the administrator: totals, bookings and each pod's slice.
    let (ok, gpus) = run(false, &["gpus"]).await?;
    assert!(ok, "{gpus}");
    for want in [
        gpu0,
        gpu1,
        "38000/40960 MiB",
        "40000/40960 MiB",
        "2/3",
        "3/3",
        "team-a/urgent",
        "30000 MiB",
        "team-a/b-fair-2",
    ] {
        assert!(gpus.contains(want), "gpus lacks {want:?}:\n{gpus}");
    }
    assert!(
        !gpus.contains("team-a/sneak"),
        "a pending pod books nothing:\n{gpus}"
    );
    // The tenant may list only its namespace's pods: it sees its own slices, totals unknown,
    // and is told what it does not see.
    let (ok, mine) = run(true, &["gpus", "-n", TENANT]).await?;
    assert!(ok, "{mine}");
    assert!(
        mine.contains("team-a/urgent")
            && mine.contains("38000 MiB/?")
            && mine.contains("you may not list Nodes")
            && mine.contains("only in namespace team-a"),
        "{mine}"
    );
    // Live usage from the device plugin's metrics, through a port-forward, with the
    // administrator's token (the chart's default metricsAuthorization asks for one): every
    // running pod's container on its GPU with its limit, the GPUs with their containers' sum.
    // The plugin's monitor reads the containers' regions every 15 s: the pods preemption
    // evicted leave, the ones placed since come, within a pass or two.
    let current = |top: &str| {
        let urgent = top
            .lines()
            .find(|l| l.starts_with("team-a/urgent "))
            .unwrap_or_default();
        urgent.contains(gpu0)
            && urgent.contains("/30000 MiB (")
            && [
                "team-a/a-top",
                "team-a/b-fair-2",
                "CONTAINERS USED/LIMIT",
                "SM UTIL",
            ]
            .iter()
            .all(|want| top.contains(want))
            && !top.contains("team-a/a-low ")
            && !top.contains("could not be read")
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (ok, top) = c.kubectl_tessera(false, &["top"]).await?;
        assert!(ok, "{top}");
        if current(&top) {
            eprintln!("kubectl tessera top (admin):\n{top}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "top never showed the running pods (urgent on {gpu0} with 30000 MiB, a-top, \
             b-fair-2) without the evicted a-low:\n{top}"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // The tenant may not reach the plugins: told what it takes, nothing shown.
    let (ok, denied) = run(true, &["top"]).await?;
    assert!(!ok && denied.contains("port-forwards to them"), "{denied}");
    // Why a pending pod waits: the node's reason, and the largest slice free (GPU 0's 2,960 MiB;
    // GPU 1 has no free slot).
    let (ok, sneak) = run(false, &["why", "sneak", "-n", TENANT]).await?;
    assert!(ok, "{sneak}");
    assert!(
        sneak.contains("team-a/sneak fits no node now")
            && sneak.contains("gpu-node: ")
            && sneak.contains(&format!("gpu-node: {gpu0} 2960 MiB")),
        "{sneak}"
    );
    let (ok, bound) = run(false, &["why", "urgent", "-n", TENANT]).await?;
    assert!(
        ok && bound.contains("is bound to node gpu-node: GPU-") && bound.contains("30000 MiB"),
        "{bound}"
    );
    // The tenant cannot list Nodes: `why` says what it needs instead of guessing.
    let (ok, denied) = run(true, &["why", "sneak", "-n", TENANT]).await?;
    assert!(!ok && denied.contains("may not list"), "{denied}");
    // Where pods of a file would go now, nothing created: 2,000 MiB fits GPU 0's last slot;
    // 30,000 MiB fits nowhere.
    let plan = c.dir.join("plan.yaml");
    let manifest = |name: &str, mib: u64| {
        serde_json::to_string(&probe::pod(
            TENANT,
            name,
            None,
            Vec::new(),
            vec![probe::container("main", &Slice::mib(1, mib), false)],
        ))
    };
    std::fs::write(
        &plan,
        format!(
            "{}\n---\n{}\n",
            manifest("small", 2000)?,
            manifest("big", 30000)?
        ),
    )?;
    let plan = plan.display().to_string();
    let (ok, planned) = c
        .kubectl_tessera(false, &["plan", "-f", &plan, "-n", TENANT])
        .await?;
    eprintln!("kubectl tessera plan:\n{planned}");
    assert!(ok, "{planned}");
    let line = |name: &str| {
        planned
            .lines()
            .find(|l| l.starts_with(&format!("{TENANT}/{name} ")))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        line("small").contains("gpu-node") && line("small").contains(gpu0),
        "{planned}"
    );
    assert!(line("big").contains("pending"), "{planned}");
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    assert!(
        api.get_opt("small").await?.is_none(),
        "plan created nothing"
    );

    // The installation checked: whole as the chart installed it.
    let (ok, healthy) = run(false, &["doctor"]).await?;
    assert!(ok, "{healthy}");
    for want in [
        "ok    scheduler     tessera-system/tessera-scheduler: 1/1 ready",
        "service tessera-system/tessera-scheduler has a ready endpoint",
        "ok    node          gpu-node: 2 GPU(s) registered, 6 nvidia.com/gpu allocatable",
        "ok    shim          gpu-node: libvgpu.so installed on the host by tessera-system/",
        "ok    runtime       no device plugin reported an unsafe NVIDIA runtime configuration",
        "ok    versions      device plugin tessera-system/tessera-device-plugin 0.1.0, scheduler tessera-system/tessera-scheduler 0.1.0; kubectl-tessera 0.1.0",
        "0 failure(s), 0 warning(s)",
    ] {
        assert!(healthy.contains(want), "doctor lacks {want:?}:\n{healthy}");
    }
    // NVIDIA's device plugin deployed beside it (as the GPU Operator would; on no node here):
    // a warning naming it and the fix, not a failure.
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": "gpu-operator"}}))?;
    Api::all(c.admin().clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let nvidia: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": "gpu-operator"},
        "spec": {"selector": {"matchLabels": {"app": "nvidia-device-plugin"}},
                 "template": {"metadata": {"labels": {"app": "nvidia-device-plugin"}},
                    "spec": {"nodeSelector": {"nvidia.com/gpu.deploy.device-plugin": "true"},
                             "containers": [{"name": "nvidia-device-plugin",
                                             "image": "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"}]}}}}))?;
    let daemonsets: Api<k8s_openapi::api::apps::v1::DaemonSet> =
        Api::namespaced(c.admin().clone(), "gpu-operator");
    daemonsets.create(&PostParams::default(), &nvidia).await?;
    let (ok, warned) = run(false, &["doctor"]).await?;
    assert!(
        ok && warned.contains(
            "WARN  other plugin  gpu-operator/nvidia-device-plugin-daemonset: NVIDIA's device plugin"
        ) && warned.contains("devicePlugin.enabled=false")
            && warned.contains("0 failure(s), 1 warning(s)"),
        "{warned}"
    );
    daemonsets
        .delete("nvidia-device-plugin-daemonset", &Default::default())
        .await?;
    // A tenant cannot read what doctor needs, and is told so.
    let (ok, denied) = run(true, &["doctor"]).await?;
    assert!(
        !ok && denied.contains("an administrator's read access"),
        "{denied}"
    );
    Ok(())
}

/// Waits until the scheduler pods run kube-scheduler `tag` and nothing older.
async fn kube_scheduler_runs(c: &RealCluster, tag: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/component=scheduler");
    let found = eventually(
        &format!("the scheduler pods on kube-scheduler {tag}"),
        Duration::from_secs(180),
        Duration::from_secs(1),
        || async {
            let list = pods.list(&lp).await.ok()?.items;
            let images: Vec<(String, bool)> = list
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .flat_map(|p| {
                    p.status
                        .iter()
                        .flat_map(|s| s.container_statuses.iter().flatten())
                })
                .filter(|cs| cs.name == "kube-scheduler")
                .map(|cs| (cs.image.clone(), cs.ready))
                .collect();
            (!images.is_empty()
                && list.iter().all(|p| p.metadata.deletion_timestamp.is_none())
                && images.iter().all(|(i, ready)| i.ends_with(tag) && *ready))
            .then_some(())
        },
    )
    .await;
    match found {
        Ok(()) => Ok(()),
        Err(e) => Err(Error::msg(format!(
            "{e}\n{}",
            c.describe_pods(NAMESPACE).await
        ))),
    }
}

/// v1.38.0-beta.0, the chart's defaults: pure GPU memory pressure (every slot free enough, no
/// CPU or memory pressure). GPU 0: `guarded` (5) under a budget that allows no disruption; GPU 1:
/// `free` (10) and `keep` (1000). Without the budget `guarded`, the least important, would go;
/// with it `free` goes, as kube-scheduler's ranking puts fewer violations first, and `keep` stays.
async fn budget_on_newer_kube_scheduler(c: &RealCluster, gpu0: &str, gpu1: &str) -> Result<()> {
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded", "namespace": TENANT},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}}))?;
    Api::<PodDisruptionBudget>::namespaced(c.admin().clone(), TENANT)
        .create(&PostParams::default(), &pdb)
        .await?;
    run_in_order(
        c,
        vec![
            pod("guarded", "lowest", 30000, Some(gpu0)),
            pod("free", "low", 30000, Some(gpu1)),
            pod("keep", "top", 4000, Some(gpu1)),
        ],
    )
    .await?;
    let before = alive(c).await?;
    c.create_pod_as_user(&pod("urgent-2", "mid", 20000, None))
        .await?;
    let message = event(c, "urgent-2", "PreemptionCandidates").await?;
    assert!(
        message.contains("evicting team-a/free (priority 10) frees GPU-")
            && !message.contains("kube-scheduler chose"),
        "only the extender named victims, and the unguarded one: {message}"
    );
    wait_evicted(c, &["free"]).await?;
    running(c, "urgent-2", Duration::from_secs(120)).await?;
    assert!(gpus_of(c, "urgent-2").await?.contains(gpu1));
    let after = alive(c).await?;
    for name in ["guarded", "keep"] {
        assert_eq!(after.get(name), before.get(name), "{name} untouched");
    }
    assert_not_overbooked(c).await
}
