//! Scenarios on real nodes: kubelet v1.34 and containerd run every pod, Tessera is installed with
//! `helm install`, and results are what a user sees: pod phases, exit codes and `kubectl logs`.
//! Each test builds its own cluster in its own network namespace (root needed, as CI has).
//! docs/e2e.md lists what is real here and what is still played.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::probe::{self, Report, Slice, Steady};
use tessera_e2e::real::{
    self, ChartValues, NAMESPACE, NodeRuntime, PROBE_IMAGE, RealCluster, RealClusterOptions,
    RealNodeSpec,
};
use tessera_e2e::{Result, eventually};

const MIB: u64 = 1024 * 1024;
const A100_MIB: u64 = 40960;
const T4_MIB: u64 = 15360;
const TENANT: &str = "team-a";

/// One GPU container: the resources it asks for and the shell it runs (`$LIMIT` is the memory
/// limit in bytes the test expects it to get).
struct GpuContainer {
    name: &'static str,
    resources: serde_json::Value,
    script: String,
}

/// The check every GPU container makes from inside: what CUDA and NVML report, exactly its
/// limit allocatable, one byte more refused (`cuda_probe limit`), and NVML showing the limit.
fn limit_check(limit_bytes: u64) -> String {
    format!(
        "LIMIT={limit_bytes}; cuda_probe info && cuda_probe limit $LIMIT && cuda_probe nvml $LIMIT \
         && echo \"SM_LIMIT=${{CUDA_DEVICE_SM_LIMIT:-none}} MEM_LIMIT_0=${{CUDA_DEVICE_MEMORY_LIMIT_0:-none}} MEM_LIMIT_1=${{CUDA_DEVICE_MEMORY_LIMIT_1:-none}}\""
    )
}

fn gpu_pod(name: &str, node: Option<&str>, containers: &[GpuContainer]) -> Pod {
    let containers: Vec<_> = containers
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "image": PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", c.script],
                "resources": {"limits": c.resources},
            })
        })
        .collect();
    probe::pod(TENANT, name, node, Vec::new(), containers)
}

/// Waits for the pod to finish and returns (exit codes by container, logs by container).
async fn outcome(
    c: &RealCluster,
    name: &str,
) -> Result<(BTreeMap<String, i32>, BTreeMap<String, String>)> {
    let pod = c
        .wait_finished(TENANT, name, Duration::from_secs(120))
        .await?;
    let mut codes = BTreeMap::new();
    let mut logs = BTreeMap::new();
    for cs in pod
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default()
    {
        let code = cs
            .state
            .and_then(|s| s.terminated)
            .map_or(-1, |t| t.exit_code);
        logs.insert(cs.name.clone(), c.logs(TENANT, name, &cs.name).await?);
        codes.insert(cs.name, code);
    }
    Ok((codes, logs))
}

fn two_nodes() -> Vec<RealNodeSpec> {
    vec![
        RealNodeSpec::gpu(NodeSpec::uniform(
            "a100-node",
            2,
            "NVIDIA A100-SXM4-40GB",
            A100_MIB,
        )),
        RealNodeSpec::gpu(NodeSpec::uniform("t4-node", 1, "Tesla T4", T4_MIB)),
    ]
}

/// Every pod of the release namespace Ready, none restarted.
async fn assert_release_healthy(c: &RealCluster) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    for p in pods.list(&ListParams::default()).await?.items {
        let st = p.status.clone().unwrap_or_default();
        if st.phase.as_deref() == Some("Succeeded") {
            continue;
        }
        for cs in st.container_statuses.unwrap_or_default() {
            assert!(
                cs.ready && cs.restart_count == 0,
                "{} / {}: ready={} restarts={}\n{}",
                p.metadata.name.clone().unwrap_or_default(),
                cs.name,
                cs.ready,
                cs.restart_count,
                c.describe_pods(NAMESPACE).await
            );
        }
    }
    Ok(())
}

/// The chart's `global.gpuHookPath` in the pipeline test.
const HOOK_PATH: &str = "/opt/hamihook";

/// The full pipeline with mixed requests, as real containers, then a Deployment of GPU pods
/// scaled 0 → 20 → 0, with the chart installed as docs/helm.md recommends and a hook path
/// other than the default.
#[test]
fn real_nodes_chart_install_pipeline_and_scaling() -> Result<()> {
    real::run(2, |net| async move {
        let c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-pipeline".into(),
                nodes: two_nodes(),
                // Not HAMi's default hook path (Cozystack sets /opt/hamihook): host paths
                // follow it, paths inside containers do not (deviation V6).
                chart: ChartValues::Recommended(vec![(
                    "global.gpuHookPath".into(),
                    HOOK_PATH.into(),
                )]),
            },
        )
        .await?;
        if let Err(e) = pipeline_and_scaling(&c).await {
            panic!("{e}\n{}", c.describe_pods(TENANT).await);
        }
        Ok(())
    })
}

async fn pipeline_and_scaling(c: &RealCluster) -> Result<()> {
    {
        assert_release_healthy(c).await?;
        c.tenant_namespace(TENANT).await?;

        // Each pod: its containers, and what each must see.
        let pods = vec![
            gpu_pod(
                "mem-3000",
                None,
                &[GpuContainer {
                    name: "main",
                    resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}),
                    script: limit_check(3000 * MIB),
                }],
            ),
            gpu_pod(
                "pct-25",
                Some("t4-node"),
                &[GpuContainer {
                    name: "main",
                    resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 25}),
                    script: limit_check(T4_MIB / 4 * MIB),
                }],
            ),
            gpu_pod(
                "cores-30",
                None,
                &[GpuContainer {
                    name: "main",
                    resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 2000, "nvidia.com/gpucores": 30}),
                    script: format!("{} && test \"$CUDA_DEVICE_SM_LIMIT\" = 30", limit_check(2000 * MIB)),
                }],
            ),
            gpu_pod(
                "two-gpus",
                Some("a100-node"),
                &[GpuContainer {
                    name: "main",
                    resources: json!({"nvidia.com/gpu": 2, "nvidia.com/gpumem": 1000}),
                    script: format!(
                        "{} && test \"$CUDA_DEVICE_MEMORY_LIMIT_1\" = 1000m",
                        limit_check(1000 * MIB)
                    ),
                }],
            ),
            gpu_pod(
                "whole-t4",
                Some("t4-node"),
                &[GpuContainer {
                    name: "main",
                    resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpucores": 100}),
                    script: limit_check(T4_MIB * MIB),
                }],
            ),
            // Two processes of one container share its limit: 64 MiB chunks, 16 in all.
            gpu_pod(
                "shared-1024",
                None,
                &[GpuContainer {
                    name: "main",
                    resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1024}),
                    script: "cuda_probe hold 67108864 /tmp/go /tmp/a & cuda_probe hold 67108864 /tmp/go /tmp/b & \
                             sleep 0.5; touch /tmp/go; \
                             for i in $(seq 100); do [ -s /tmp/a ] && [ -s /tmp/b ] && break; sleep 0.1; done; \
                             echo chunks=$(( $(cat /tmp/a) + $(cat /tmp/b) )); \
                             test $(( $(cat /tmp/a) + $(cat /tmp/b) )) = 16"
                        .to_owned(),
                }],
            ),
            // Two GPU containers of one pod: each gets its own slice.
            gpu_pod(
                "two-containers",
                None,
                &[
                    GpuContainer {
                        name: "first",
                        resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1500}),
                        script: limit_check(1500 * MIB),
                    },
                    GpuContainer {
                        name: "second",
                        resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 2500}),
                        script: limit_check(2500 * MIB),
                    },
                ],
            ),
        ];
        for p in &pods {
            c.create_pod_as_user(p).await?;
        }
        for p in &pods {
            let name = p.metadata.name.clone().unwrap_or_default();
            let (codes, logs) = outcome(c, &name).await?;
            for (ctr, code) in &codes {
                assert_eq!(
                    *code, 0,
                    "{name}/{ctr} exited {code}; its logs:\n{}",
                    logs[ctr]
                );
                // The shim was loaded from the /etc/ld.so.preload mount (nothing set LD_PRELOAD):
                // without it cuMemGetInfo would report the whole card.
                assert!(
                    logs[ctr].contains("OK") || logs[ctr].contains("chunks=16"),
                    "{name}/{ctr}: {}",
                    logs[ctr]
                );
            }
            println!("{name}: {logs:?}");
        }
        // Finished pods are deleted, as a user cleans up: their directories must go too.
        for p in &pods {
            c.delete_pod(TENANT, p.metadata.name.as_deref().unwrap_or_default())
                .await?;
        }

        scale_deployment_up_and_down(c).await?;
        kueue_queues_gpu_jobs(c).await?;
        Ok(())
    }
}

/// Kueue in front of Tessera (docs/kueue.md), with the files the docs give: Kueue's own chart
/// with `examples/kueue/kueue-values.yaml` (quotas on GPU memory and SMs in all, by Kueue's
/// `multiplyBy` transformations), `examples/kueue/queues.yaml`, and Jobs made from
/// `examples/kueue/job.yaml` by the tenant. Four Jobs of 3000 MiB each against an 8192 MiB quota:
/// Kueue never lets more than two run at once, and each runs with exactly its slice (Tessera's
/// limits, seen from inside). A Job larger than the whole quota is held, and Kueue says which
/// quota.
async fn kueue_queues_gpu_jobs(c: &RealCluster) -> Result<()> {
    use k8s_openapi::api::batch::v1::Job;
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};

    let examples = tessera_e2e::artifacts::workspace_root().join("examples/kueue");
    c.install_kueue(&examples.join("kueue-values.yaml")).await?;
    // The namespace opts in to queueing (the values' managedJobsNamespaceSelector).
    Api::<Namespace>::all(c.admin().clone())
        .patch(
            TENANT,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"kueue.x-k8s.io/managed": "true"}}})),
        )
        .await?;
    c.apply_yaml(&std::fs::read_to_string(examples.join("queues.yaml"))?)
        .await?;

    // The example as written (its image is the release's probe, imported under that name);
    // the test gives each Job its name, size and check.
    let template: Job = tessera_e2e::read_yaml_object(&examples.join("job.yaml"))?;
    let job = |name: &str, gpumem: u64, script: String| -> Result<Job> {
        let mut j = serde_json::to_value(&template)?;
        j["metadata"]["name"] = json!(name);
        j["metadata"]["namespace"] = json!(TENANT);
        let ctr = &mut j["spec"]["template"]["spec"]["containers"][0];
        ctr["command"] = json!(["/bin/sh", "-c", script]);
        ctr["resources"]["limits"]["nvidia.com/gpumem"] = json!(gpumem);
        Ok(serde_json::from_value(j)?)
    };
    let jobs: Api<Job> = Api::namespaced(c.user().clone(), TENANT);
    let names: Vec<String> = (1..=4).map(|i| format!("train-{i}")).collect();
    for name in &names {
        // Long enough that two admitted Jobs overlap where the test can see them.
        let script = format!(
            "{} && test \"$CUDA_DEVICE_SM_LIMIT\" = 50 && sleep 4",
            limit_check(3000 * MIB)
        );
        let created = jobs
            .create(&PostParams::default(), &job(name, 3000, script)?)
            .await?;
        // Kueue's webhook, called by the API server, suspended it on creation.
        assert_eq!(
            created.spec.as_ref().and_then(|s| s.suspend),
            Some(true),
            "{name} was not suspended by Kueue's webhook"
        );
    }
    // 9000 MiB in all is more than the ClusterQueue's 8192: never admitted.
    jobs.create(
        &PostParams::default(),
        &job("too-big", 9000, "true".to_owned())?,
    )
    .await?;

    let workloads: Api<DynamicObject> = Api::namespaced_with(
        c.admin().clone(),
        TENANT,
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "kueue.x-k8s.io",
            "v1beta2",
            "Workload",
        )),
    );
    let admin_jobs: Api<Job> = Api::namespaced(c.admin().clone(), TENANT);
    let condition = |w: &DynamicObject, type_: &str| -> Option<serde_json::Value> {
        w.data["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == type_)
            .cloned()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    let mut most_running = 0;
    loop {
        // Running at once: admitted and not finished (Kueue unsuspends exactly those).
        let items = workloads.list(&ListParams::default()).await?.items;
        let running = items
            .iter()
            .filter(|w| {
                condition(w, "Admitted").is_some_and(|c| c["status"] == "True")
                    && !condition(w, "Finished").is_some_and(|c| c["status"] == "True")
            })
            .count();
        most_running = most_running.max(running);
        let done = admin_jobs
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|j| names.contains(j.metadata.name.as_ref().unwrap_or(&String::new())))
            .filter(|j| {
                let st = j.status.clone().unwrap_or_default();
                st.succeeded.unwrap_or(0) + st.failed.unwrap_or(0) > 0
            })
            .count();
        if done == names.len() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "{done} of {} queued GPU Jobs finished in 240 s\n{}",
                names.len(),
                c.describe_pods(TENANT).await
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        most_running <= 2,
        "{most_running} Jobs of 3000 MiB ran at once under an 8192 MiB quota"
    );
    assert_eq!(
        most_running, 2,
        "the quota has room for two 3000 MiB Jobs, yet Kueue never ran two at once"
    );
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    for name in &names {
        let j = admin_jobs.get(name).await?;
        let lp = ListParams::default().labels(&format!("batch.kubernetes.io/job-name={name}"));
        let pod = pods.list(&lp).await?.items.into_iter().next();
        let pod_name = pod.and_then(|p| p.metadata.name).unwrap_or_default();
        let logs = c.logs(TENANT, &pod_name, "main").await.unwrap_or_default();
        assert_eq!(
            j.status.and_then(|s| s.succeeded),
            Some(1),
            "queued Job {name} failed; its pod's logs:\n{logs}"
        );
        assert!(logs.contains("OK"), "{name}: {logs}");
    }
    // The Job over the quota: still suspended, no pod, and Kueue names the quota it exceeds.
    let held = eventually(
        "Kueue to explain why too-big waits",
        Duration::from_secs(30),
        Duration::from_millis(250),
        || async {
            workloads
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|w| {
                    w.metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .any(|o| o.name == "too-big")
                })
                .and_then(|w| condition(&w, "QuotaReserved"))
                .filter(|c| c["status"] == "False")
                .and_then(|c| c["message"].as_str().map(str::to_owned))
                .filter(|m| m.contains("nvidia.com/total-gpumem"))
        },
    )
    .await?;
    println!("too-big waits: {held}");
    let too_big = admin_jobs.get("too-big").await?;
    assert_eq!(too_big.spec.and_then(|s| s.suspend), Some(true));
    let lp = ListParams::default().labels("batch.kubernetes.io/job-name=too-big");
    assert!(pods.list(&lp).await?.items.is_empty());
    Ok(())
}

/// A Deployment of GPU pods scaled 0 → 20 → 0: all 20 run, and afterwards every GPU is free in
/// the extender's books, the register annotations list every GPU, and no container directory
/// (region files) is left on any node.
async fn scale_deployment_up_and_down(c: &RealCluster) -> Result<()> {
    let deploys: Api<Deployment> = Api::namespaced(c.user().clone(), TENANT);
    let d: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "holders", "namespace": TENANT},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "holders"}},
            "template": {
                "metadata": {"labels": {"app": "holders"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "main",
                        "image": PROBE_IMAGE,
                        "imagePullPolicy": "Never",
                        // Fills its slice in 1 MiB pieces, then holds it.
                        "command": ["cuda_probe", "hold", "1048576", "/", "/tmp/held"],
                        "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}},
                    }]
                }
            }
        }
    }))?;
    deploys.create(&PostParams::default(), &d).await?;
    let scale = |n: i32| {
        let deploys = deploys.clone();
        async move {
            deploys
                .patch(
                    "holders",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": n}})),
                )
                .await
        }
    };
    scale(20).await?;
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let lp = ListParams::default().labels("app=holders");
    let running = eventually(
        "20 holder pods Running",
        Duration::from_secs(240),
        Duration::from_millis(500),
        || async {
            let items = pods.list(&lp).await.ok()?.items;
            let n = items
                .iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            (n == 20).then_some(items)
        },
    )
    .await;
    let running = match running {
        Ok(items) => items,
        Err(e) => panic!("{e}\n{}", c.describe_pods(TENANT).await),
    };
    // Each holder's shim opened the shared region Allocate named (a file under the container's
    // host directory, which the plugin's monitor reads), rather than accounting privately
    // because the path did not exist inside the container.
    for p in &running {
        let (Some(uid), Some(node)) = (
            p.metadata.uid.as_deref(),
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        ) else {
            panic!(
                "a running holder without UID or node: {:?}",
                p.metadata.name
            );
        };
        let n = c
            .nodes
            .iter()
            .find(|n| n.name() == node)
            .unwrap_or_else(|| panic!("holder on unknown node {node}"));
        let dir = n.containers_dir().join(format!("{uid}_main"));
        eventually(
            &format!("a shared region in {}", dir.display()),
            Duration::from_secs(30),
            Duration::from_millis(500),
            || async {
                std::fs::read_dir(&dir).ok()?.flatten().find(|e| {
                    e.path().extension().is_some_and(|x| x == "cache")
                        && e.metadata().is_ok_and(|m| m.len() > 0)
                })
            },
        )
        .await?;
    }
    scale(0).await?;
    eventually(
        "every holder pod gone",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async { pods.list(&lp).await.ok()?.items.is_empty().then_some(()) },
    )
    .await?;

    // The register annotation still lists every GPU, healthy.
    let nodes: Api<Node> = Api::all(c.admin().clone());
    for n in &c.nodes {
        let node = nodes.get(n.name()).await?;
        let reg = node
            .metadata
            .annotations
            .unwrap_or_default()
            .get(hami_contract::annotations::NODE_REGISTER)
            .cloned()
            .unwrap_or_default();
        for g in &n.spec.node.gpus {
            assert!(reg.contains(&g.uuid), "{}: {reg}", n.name());
        }
    }
    // The extender's books: nothing allocated on any GPU.
    let books = eventually(
        "the extender's books to show every GPU free",
        Duration::from_secs(60),
        Duration::from_secs(1),
        || async {
            let m = c.scheduler_metrics().await?;
            let used: Vec<&str> = m
                .lines()
                .filter(|l| {
                    (l.starts_with("hami_gpu_shared_count")
                        || l.starts_with("hami_gpu_memory_allocated_bytes"))
                        && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) != Some(0.0)
                })
                .collect();
            used.is_empty().then(|| m.clone())
        },
    )
    .await?;
    let gpus: usize = c.nodes.iter().map(|n| n.spec.node.gpus.len()).sum();
    assert_eq!(
        books
            .lines()
            .filter(|l| l.starts_with("hami_gpu_shared_count"))
            .count(),
        gpus,
        "{books}"
    );
    // No container directory left behind on any node.
    for n in &c.nodes {
        let dir = n.containers_dir();
        eventually(
            &format!("{}: no container directory left", n.name()),
            Duration::from_secs(90),
            Duration::from_secs(1),
            || async { std::fs::read_dir(&dir).ok()?.next().is_none().then_some(()) },
        )
        .await?;
    }
    Ok(())
}

/// HAMi v2.10's own default values file, unchanged: every Tessera pod becomes Ready and none
/// restarts, a GPU pod gets its slice, and a node without a usable driver does not crash-loop
/// its device plugin (`devicePlugin.failOnInitError`, default false) until the operator asks for
/// NVIDIA's behaviour (true), which then fails the container with NVML's error.
#[test]
fn real_nodes_hami_default_values_and_a_node_without_driver() -> Result<()> {
    real::run(2, |net| async move {
        let fixture =
            tessera_e2e::artifacts::workspace_root().join("e2e/fixtures/hami-v2.10-values.yaml");
        let mut no_driver = RealNodeSpec::gpu(NodeSpec::uniform("cpu-node", 1, "none", 0));
        no_driver.driver = false;
        // HAMi's `deviceListStrategy: envvar` needs a runtime that takes the device list from the
        // environment: the toolkit's defaults (no configuration file), which the plugin reports.
        let mut t4 = RealNodeSpec::gpu(NodeSpec::uniform("t4-node", 1, "Tesla T4", T4_MIB));
        t4.runtime = NodeRuntime::ToolkitDefaults;
        let c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-hami-values".into(),
                nodes: vec![t4, no_driver],
                chart: ChartValues::File(fixture.clone()),
            },
        )
        .await?;
        // Restarts show up late: give every container time to fail if it would.
        tokio::time::sleep(Duration::from_secs(15)).await;
        assert_release_healthy(&c).await?;
        c.tenant_namespace(TENANT).await?;
        let pod = gpu_pod(
            "mem-2000",
            Some("t4-node"),
            &[GpuContainer {
                name: "main",
                resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 2000}),
                script: limit_check(2000 * MIB),
            }],
        );
        c.create_pod_as_user(&pod).await?;
        let (codes, logs) = outcome(&c, "mem-2000").await?;
        assert_eq!(codes.get("main"), Some(&0), "{logs:?}");

        // The plugin says, on its Node, that this runtime hands GPUs to any container that names
        // them in its environment.
        let events: Api<Event> = Api::namespaced(c.admin().clone(), "default");
        let warning = eventually(
            "an UnsafeGPUDeviceList Event on t4-node",
            Duration::from_secs(60),
            Duration::from_millis(500),
            || async {
                events
                    .list(&ListParams::default().fields("involvedObject.name=t4-node"))
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .find(|e| e.reason.as_deref() == Some("UnsafeGPUDeviceList"))
            },
        )
        .await?;
        let message = warning.message.unwrap_or_default();
        assert!(
            message.contains("accepts NVIDIA_VISIBLE_DEVICES from unprivileged containers"),
            "{message}"
        );

        // The driverless node: its plugin runs, registers nothing, and says why.
        let nodes: Api<Node> = Api::all(c.admin().clone());
        let cpu = nodes.get("cpu-node").await?;
        assert!(
            !cpu.metadata
                .annotations
                .unwrap_or_default()
                .contains_key(hami_contract::annotations::NODE_REGISTER),
            "a node without a driver published GPUs"
        );
        let plugin_pod = |c: &RealCluster| {
            let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
            async move {
                pods.list(
                    &ListParams::default().labels("app.kubernetes.io/component=device-plugin"),
                )
                .await
                .ok()?
                .items
                .into_iter()
                .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("cpu-node"))
            }
        };
        let p = plugin_pod(&c).await.expect("a plugin pod on cpu-node");
        let name = p.metadata.name.clone().unwrap_or_default();
        let log = c.logs(NAMESPACE, &name, "tessera-device-plugin").await?;
        assert!(log.to_lowercase().contains("nvml"), "{log}");

        // NVIDIA's behaviour on request: the container fails with the error, and restarts.
        c.helm_upgrade(&fixture, &[("devicePlugin.failOnInitError", "true")])
            .await?;
        let failed = eventually(
            "the plugin on cpu-node to fail and restart",
            Duration::from_secs(120),
            Duration::from_secs(1),
            || async {
                let p = plugin_pod(&c).await?;
                let cs = p.status?.container_statuses?.into_iter().next()?;
                let t = cs.last_state?.terminated?;
                (cs.restart_count >= 1 && t.exit_code != 0).then_some(t)
            },
        )
        .await?;
        println!("failOnInitError=true: {failed:?}");

        hami_takeover_and_rollback(&c, &fixture).await
    })
}

/// The HAMi cluster's jobs on the T4: one process that holds 2000 MiB of its 4000 MiB through the
/// shim it loaded, and a reporting job with an SM limit.
const HAMI_STEADY: Steady = Steady {
    slice: Slice::mib(1, 4000),
    held_mib: 2000,
};
const HAMI_REPORTER: Slice = Slice::mib(1, 3000).with_cores(30);
/// Placed by Tessera after the takeover.
const TAKEOVER_POD: Slice = Slice::mib(1, 2000);
/// Fits on the T4 (15360 MiB) only if a booking HAMi made were forgotten: 15360 - 4000 - 3000 =
/// 8360 MiB are free.
const FORGOTTEN_ONLY: Slice = Slice::mib(1, 9000);

/// Strips what only Tessera writes, leaving what HAMi v2.10's scheduler and device plugin leave
/// (docs/contract/hami.md): no `tessera.io/` annotation on the pods and the Node, no limits file
/// beside the containers' regions (HAMi-core reads its environment), and HAMi's node lock naming a
/// pod it already allocated (its plugin stopped before releasing it), 30 s old.
async fn leave_only_hamis_state(
    c: &RealCluster,
    node: &str,
    pods: &[(&str, String)],
) -> Result<()> {
    use hami_contract::annotations::NODE_LOCK;
    let without_tessera = |ann: Option<BTreeMap<String, String>>| -> serde_json::Value {
        let removed: serde_json::Map<String, serde_json::Value> = ann
            .unwrap_or_default()
            .into_keys()
            .filter(|k| k.starts_with("tessera.io/"))
            .map(|k| (k, serde_json::Value::Null))
            .collect();
        serde_json::Value::Object(removed)
    };
    let pod_api: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    for (name, _) in pods {
        let p = pod_api.get(name).await?;
        let patch = json!({"metadata": {"annotations": without_tessera(p.metadata.annotations)}});
        pod_api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    let nodes: Api<Node> = Api::all(c.admin().clone());
    let n = nodes.get(node).await?;
    let mut ann = without_tessera(n.metadata.annotations);
    let lock_time =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(30);
    ann[NODE_LOCK] = json!(format!(
        "{},{TENANT},{}",
        lock_time.strftime("%Y-%m-%dT%H:%M:%SZ"),
        pods[0].0
    ));
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": ann}})),
        )
        .await?;
    let containers = c
        .node(node)
        .ok_or_else(|| tessera_e2e::Error::msg("no node"))?
        .containers_dir();
    for (_, uid) in pods {
        let limits = containers
            .join(format!("{uid}_main"))
            .join(vgpu_region::protocol::LIMITS_FILE_NAME);
        std::fs::remove_file(&limits)
            .map_err(|e| tessera_e2e::Error::msg(format!("{}: {e}", limits.display())))?;
    }
    Ok(())
}

/// Pod `name` in the tenant's namespace: Running with UID `uid`, never restarted, and its latest
/// report its own `slice`.
async fn runs_with_own_limits(
    c: &RealCluster,
    name: &str,
    uid: Option<&str>,
    slice: &Slice,
    after: &str,
) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    eventually(
        &format!("{name} running with its own limits after {after}"),
        Duration::from_secs(90),
        Duration::from_secs(1),
        || async {
            let p = pods.get_opt(name).await.ok().flatten()?;
            let cs = p.status.clone()?.container_statuses?.into_iter().next()?;
            let running = cs.state.as_ref().and_then(|s| s.running.as_ref()).is_some();
            let logs = c.logs(TENANT, name, "main").await.ok()?;
            let own = probe::judge(&logs, slice, true) == Report::Own;
            let same = uid.is_none_or(|u| p.metadata.uid.as_deref() == Some(u));
            (running && own && same && cs.restart_count == 0)
                .then(|| p.metadata.uid.unwrap_or_default())
        },
    )
    .await
}

/// Creates the tenant's one-container pod `name` on `node`.
async fn pod_on(
    c: &RealCluster,
    name: &str,
    node: &str,
    container: serde_json::Value,
) -> Result<()> {
    c.create_pod_as_user(&probe::pod(
        TENANT,
        name,
        Some(node),
        Vec::new(),
        vec![container],
    ))
    .await
    .map(drop)
}

/// Issue 32 item 5 on the HAMi-values cluster. HAMi's binaries are not on the Go module proxy, so
/// the release installed with HAMi's values file plays HAMi, and its state is then reduced to
/// exactly what HAMi leaves ([`leave_only_hamis_state`]). Take over: HAMi uninstalled, Tessera
/// installed with the same values file; HAMi's jobs run on with their limits, their bookings
/// count from the first decision (a pod that fits only if one were forgotten stays pending, one
/// that fits is placed at once, HAMi's leftover lock notwithstanding), the plugin reads their
/// regions, and the lock is released. Roll back: Tessera uninstalled; what it leaves is what
/// HAMi reads (every GPU pod's booking in HAMi's encoding, the node's GPUs in HAMi's register
/// annotation, no lock, each container's region in HAMi-core's layout), and the jobs run on.
async fn hami_takeover_and_rollback(c: &RealCluster, fixture: &std::path::Path) -> Result<()> {
    const NODE: &str = "t4-node";
    // A clean start for the scenario: the release as HAMi's values install it.
    c.helm_upgrade(fixture, &[]).await?;
    c.wait_release_serving().await?;
    pod_on(c, "hami-steady", NODE, HAMI_STEADY.container("main")).await?;
    pod_on(
        c,
        "hami-reporter",
        NODE,
        probe::container("main", &HAMI_REPORTER, true),
    )
    .await?;
    let reporter_uid =
        runs_with_own_limits(c, "hami-reporter", None, &HAMI_REPORTER, "start").await?;
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let steady_uid = pods
        .get("hami-steady")
        .await?
        .metadata
        .uid
        .unwrap_or_default();
    let mut steady_n = HAMI_STEADY
        .keeps_enforcing(c, TENANT, "hami-steady", &steady_uid, 0, "start")
        .await;

    println!(
        "takeover: HAMi uninstalled, its state as HAMi leaves it, Tessera installed with the same values"
    );
    c.helm_uninstall().await?;
    let hami_pods = [
        ("hami-steady", steady_uid.clone()),
        ("hami-reporter", reporter_uid.clone()),
    ];
    leave_only_hamis_state(c, NODE, &hami_pods).await?;
    // The dry run on the cluster as HAMi leaves it: nothing blocks, and it says what will happen.
    let fixture_arg = fixture.display().to_string();
    let (ok, plan) = c
        .kubectl_tessera(false, &["migrate-from-hami", "-f", &fixture_arg])
        .await?;
    println!("kubectl tessera migrate-from-hami:\n{plan}");
    for says in [
        "t4-node: 1 GPU(s) registered by HAMi",
        &format!("naming {TENANT}/hami-steady, which is not waiting"),
        "2 booking(s) on 1 GPU(s)",
        "Nothing blocks the switch",
    ] {
        assert!(
            ok && plan.contains(says),
            "the dry run does not say {says:?}:\n{plan}"
        );
    }
    c.helm_install(&ChartValues::File(fixture.to_owned()))
        .await?;
    // The first decisions: a pod that needs a forgotten booking, then one that fits.
    pod_on(
        c,
        "forgotten-only",
        NODE,
        probe::container("main", &FORGOTTEN_ONLY, true),
    )
    .await?;
    pod_on(
        c,
        "tessera-placed",
        NODE,
        probe::container("main", &TAKEOVER_POD, true),
    )
    .await?;
    let placed_uid =
        runs_with_own_limits(c, "tessera-placed", None, &TAKEOVER_POD, "takeover").await?;
    runs_with_own_limits(
        c,
        "hami-reporter",
        Some(&reporter_uid),
        &HAMI_REPORTER,
        "takeover",
    )
    .await?;
    steady_n = HAMI_STEADY
        .keeps_enforcing(c, TENANT, "hami-steady", &steady_uid, steady_n, "takeover")
        .await;
    HAMI_STEADY
        .usage_is_read(c, NODE, "hami-steady", "takeover")
        .await?;
    let forgotten = pods.get("forgotten-only").await?;
    assert_eq!(
        forgotten.spec.and_then(|s| s.node_name),
        None,
        "forgotten-only was placed: Tessera forgot a booking HAMi made\n{}",
        c.describe_pods(TENANT).await
    );
    let nodes: Api<Node> = Api::all(c.admin().clone());
    eventually(
        "Tessera's plugin to release the lock HAMi left",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || async {
            let n = nodes.get(NODE).await.ok()?;
            (!n.metadata
                .annotations
                .unwrap_or_default()
                .contains_key(hami_contract::annotations::NODE_LOCK))
            .then_some(())
        },
    )
    .await?;
    let all_pods = Api::<Pod>::all(c.admin().clone())
        .list(&ListParams::default())
        .await?
        .items;
    let all_nodes = nodes.list(&ListParams::default()).await?.items;
    let v = tessera_e2e::booking::violations(&all_nodes, &all_pods);
    assert!(
        v.is_empty(),
        "over-booked after the takeover:\n{}",
        v.join("\n")
    );
    pods.delete("forgotten-only", &Default::default()).await?;

    println!("rollback: Tessera uninstalled; what it leaves is HAMi's state");
    c.helm_uninstall().await?;
    let n = nodes.get(NODE).await?;
    let node_ann = n.metadata.annotations.unwrap_or_default();
    assert!(
        !node_ann.contains_key(hami_contract::annotations::NODE_LOCK),
        "a node lock left behind"
    );
    let registered = hami_contract::node::decode_node_devices(
        node_ann
            .get(hami_contract::annotations::NODE_REGISTER)
            .map(String::as_str)
            .unwrap_or_default(),
    )
    .map_err(|e| {
        tessera_e2e::Error::msg(format!("the node's GPUs are not in HAMi's encoding: {e}"))
    })?;
    assert_eq!(registered.len(), 1, "{registered:?}");
    let containers = c
        .node(NODE)
        .ok_or_else(|| tessera_e2e::Error::msg("no node"))?
        .containers_dir();
    for (name, uid, slice) in [
        ("hami-steady", &steady_uid, HAMI_STEADY.slice),
        ("hami-reporter", &reporter_uid, HAMI_REPORTER),
        ("tessera-placed", &placed_uid, TAKEOVER_POD),
    ] {
        let p = pods.get(name).await?;
        let ann = p.metadata.annotations.unwrap_or_default();
        let get = |k: &str| ann.get(k).map(String::as_str).unwrap_or_default();
        assert_eq!(
            get(hami_contract::annotations::VGPU_NODE),
            NODE,
            "{name}: {ann:?}"
        );
        assert_eq!(
            get(hami_contract::annotations::BIND_PHASE),
            "success",
            "{name}: {ann:?}"
        );
        let booked = hami_contract::devices::PodDevices::decode(get(
            hami_contract::annotations::DEVICES_ALLOCATED,
        ))
        .map_err(|e| {
            tessera_e2e::Error::msg(format!("{name}'s booking is not in HAMi's encoding: {e}"))
        })?;
        let devices: Vec<_> = booked.0.iter().flatten().collect();
        assert_eq!(devices.len(), 1, "{name}: {booked:?}");
        assert_eq!(
            (u64::from(devices[0].usedmem), devices[0].usedcores),
            (slice.mem_mib, slice.cores),
            "{name}: {booked:?}"
        );
        // HAMi's monitor reads `<podUID>_<container>/*.cache` in HAMi-core's layout.
        let dir = containers.join(format!("{uid}_main"));
        let region = std::fs::read_dir(&dir)?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "cache"))
            .ok_or_else(|| {
                tessera_e2e::Error::msg(format!("no region file in {}", dir.display()))
            })?;
        let snapshot = vgpu_region::RegionSnapshot::parse(&std::fs::read(&region)?)
            .map_err(|e| tessera_e2e::Error::msg(format!("{}: {e}", region.display())))?;
        assert_eq!(
            snapshot.limit[0],
            slice.mem_mib * MIB,
            "{name}'s region: {snapshot:?}"
        );
    }
    runs_with_own_limits(
        c,
        "hami-reporter",
        Some(&reporter_uid),
        &HAMI_REPORTER,
        "rollback",
    )
    .await?;
    runs_with_own_limits(
        c,
        "tessera-placed",
        Some(&placed_uid),
        &TAKEOVER_POD,
        "rollback",
    )
    .await?;
    HAMI_STEADY
        .keeps_enforcing(c, TENANT, "hami-steady", &steady_uid, steady_n, "rollback")
        .await;
    Ok(())
}

/// The bare real-node cluster: two nodes without any NVIDIA runtime (containerd runs runc, as on
/// a kind or k3s node without GPUs) join with node credentials and become Ready, a plain pod runs
/// on each through containerd, its exit code and `kubectl logs` come back through the API server
/// from that node's kubelet, and pods reach each other and the API server's ClusterIP over the pod
/// network. Then the five-minute trial of docs/install.md on the same nodes: the chart with
/// simulated GPUs (`simulatedGpus`, the fake driver from its own image) places GPU pods that run
/// with their limits, and `kubectl tessera gpus` lists the simulated GPUs.
#[test]
fn real_nodes_run_plain_pods_then_simulated_gpus() -> Result<()> {
    real::run(2, |net| async move {
        let c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-plain".into(),
                nodes: two_nodes()
                    .into_iter()
                    .map(|mut n| {
                        n.driver = false;
                        n.runtime = NodeRuntime::None;
                        n
                    })
                    .collect(),
                chart: ChartValues::None,
            },
        )
        .await?;
        c.tenant_namespace(TENANT).await?;
        for n in ["a100-node", "t4-node"] {
            let pod: Pod = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("hello-{n}"), "namespace": TENANT},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": n},
                    "containers": [{
                        "name": "main", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                        // The API server's ClusterIP answers TLS on 443 from inside the pod.
                        "command": ["/bin/sh", "-c",
                            "echo hello from $(hostname) on $NODE; \
                             nc -w 3 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT </dev/null && echo apiserver reachable"],
                        "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                    }]
                }
            }))?;
            c.create_pod_as_user(&pod).await?;
        }
        for n in ["a100-node", "t4-node"] {
            let (codes, logs) = outcome(&c, &format!("hello-{n}")).await?;
            assert_eq!(codes.get("main"), Some(&0), "{logs:?}");
            let log = &logs["main"];
            assert!(log.contains(&format!("on {n}")), "{log}");
            assert!(log.contains("apiserver reachable"), "{log}");
        }
        simulated_gpus(&c).await
    })
}

/// docs/install.md's five-minute trial: `helm install` with `simulatedGpus.enabled=true` (two T4s
/// per node), a GPU pod on each node gets exactly its limit (one byte more refused, nvidia-smi's
/// view the limit), and `kubectl tessera gpus` lists every node's two simulated GPUs.
async fn simulated_gpus(c: &RealCluster) -> Result<()> {
    c.helm_install(&ChartValues::Recommended(
        [
            ("simulatedGpus.enabled", "true"),
            ("simulatedGpus.model", "Tesla T4"),
            ("simulatedGpus.count", "2"),
            ("simulatedGpus.memoryMiB", "15360"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .to_vec(),
    ))
    .await?;
    for (i, n) in ["a100-node", "t4-node"].into_iter().enumerate() {
        let mib = 3000 + 1000 * i as u64;
        let pod = gpu_pod(
            &format!("simulated-{n}"),
            Some(n),
            &[GpuContainer {
                name: "main",
                resources: json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem": mib}),
                script: limit_check(mib * MIB),
            }],
        );
        c.create_pod_as_user(&pod).await?;
    }
    for (i, n) in ["a100-node", "t4-node"].into_iter().enumerate() {
        let mib = 3000 + 1000 * i as u64;
        let (codes, logs) = outcome(c, &format!("simulated-{n}")).await?;
        assert_eq!(codes.get("main"), Some(&0), "{n}: {logs:?}");
        assert!(
            logs["main"].contains(&format!("MEM_LIMIT_0={mib}m")),
            "{n}: {logs:?}"
        );
    }
    // docs/install.md's example workload, as written (its image is imported under the name
    // `make release` publishes it by; pulled only if absent).
    let mut probe: Pod = tessera_e2e::read_yaml_object(
        &tessera_e2e::artifacts::workspace_root().join("examples/simulated-gpus/probe.yaml"),
    )?;
    probe.metadata.namespace = Some(TENANT.to_owned());
    let image = probe
        .spec
        .as_ref()
        .and_then(|s| s.containers[0].image.clone());
    assert_eq!(
        image.as_deref(),
        Some(
            tessera_e2e::images::tessera_image(tessera_e2e::images::GPU_PROBE_REPOSITORY).as_str()
        ),
        "the example names the release's probe image of this version"
    );
    c.create_pod_as_user(&probe).await?;
    let (codes, logs) = outcome(c, "gpu-probe").await?;
    assert_eq!(codes.get("probe"), Some(&0), "{logs:?}");
    assert!(
        logs["probe"].contains("the pod holds exactly 3000 MiB"),
        "{logs:?}"
    );
    let (ok, gpus) = c.kubectl_tessera(false, &["gpus"]).await?;
    println!("kubectl tessera gpus with simulated GPUs:\n{gpus}");
    assert!(ok, "{gpus}");
    for n in ["a100-node", "t4-node"] {
        let rows = gpus
            .lines()
            .filter(|l| l.starts_with(n) && l.contains("Tesla T4") && l.contains("/15360 MiB"))
            .count();
        assert_eq!(rows, 2, "{n}'s two simulated T4s:\n{gpus}");
    }
    Ok(())
}
