//! The chart's identities and a tenant attack the cluster; the API server must refuse every
//! attempt (the admission policies of `charts/tessera/templates/admission/policies.yaml` and
//! the chart's RBAC). Real nodes, the chart installed as docs/helm.md recommends. Writes that
//! would disturb the cluster if they went through are server-side dry runs (admission policies
//! run on dry runs too).
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tessera_e2e::node::NodeSpec;
use tessera_e2e::real::{
    self, ChartValues, NAMESPACE, PROBE_IMAGE, RealCluster, RealClusterOptions, RealNodeSpec,
};
use tessera_e2e::{Error, Result, eventually};

const TENANT: &str = "team-a";
const OTHER: &str = "team-b";
const POLICY: &str = "Tessera admission policy";
const GPU_NODE: &str = "a100-node";
const OTHER_NODE: &str = "t4-node";
/// The unaccounted-process watch's period on this cluster (the chart's default is 15 s).
const WATCH_PERIOD_SECS: u64 = 2;

fn dry() -> PatchParams {
    PatchParams {
        dry_run: true,
        ..PatchParams::default()
    }
}

/// The Events in the tenant's namespace about the object with `uid`.
async fn events_on(c: &RealCluster, uid: &str) -> Result<Vec<Event>> {
    Ok(Api::<Event>::namespaced(c.admin().clone(), TENANT)
        .list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
        .await?
        .items)
}

/// The tenant's pod `name` once it is in one of `phases` (within 120 s).
async fn tenant_pod_in(c: &RealCluster, name: &str, phases: &[&str]) -> Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    eventually(
        &format!("pod {name} {}", phases.join(" or ")),
        Duration::from_secs(120),
        Duration::from_millis(250),
        || async {
            pods.get_opt(name).await.ok().flatten().filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.phase.as_deref())
                    .is_some_and(|phase| phases.contains(&phase))
            })
        },
    )
    .await
}

/// The chart's webhook refusing a forged annotation (it runs before the policies).
const WEBHOOK: &str = "admission webhook \"vgpu.hami.io\" denied";

/// The outcome must be a refusal by the API server (403 or 422) whose message names one of `by`
/// (the chart's admission policies, its webhook); with `by` empty, RBAC's refusal too.
fn refused<T>(what: &str, r: std::result::Result<T, kube::Error>, by: &[&str]) -> Result<()> {
    match r {
        Ok(_) => Err(Error::msg(format!("{what}: ALLOWED"))),
        Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => {
            if !by.is_empty() && !by.iter().any(|m| e.message.contains(m)) {
                return Err(Error::msg(format!(
                    "{what}: refused, but not by the policy: {} {}",
                    e.code, e.message
                )));
            }
            eprintln!("refused as expected: {what}: {} {}", e.code, e.message);
            Ok(())
        }
        Err(e) => Err(Error::msg(format!("{what}: unexpected error {e}"))),
    }
}

#[test]
fn real_nodes_chart_identities_and_tenants_cannot_forge_or_escalate() -> Result<()> {
    real::run(2, |net| async move {
        let mut c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-security".into(),
                nodes: vec![
                    RealNodeSpec::gpu(NodeSpec::uniform(
                        GPU_NODE,
                        2,
                        "NVIDIA A100-SXM4-40GB",
                        40960,
                    )),
                    // One simulated GPU for the whole node, so its plugin's NVML lists every
                    // container's processes, as a real driver does (unaccounted_processes).
                    RealNodeSpec {
                        shared_gpu_state: true,
                        ..RealNodeSpec::gpu(NodeSpec::uniform(OTHER_NODE, 1, "Tesla T4", 15360))
                    },
                ],
                chart: ChartValues::Recommended(vec![
                    (
                        "devicePlugin.unaccountedProcesses.periodSeconds".into(),
                        WATCH_PERIOD_SECS.to_string(),
                    ),
                    // Debug lines: a failure here shows what each pass compared, and what the
                    // extender answered for each pod (its spans carry the pod's UID).
                    ("devicePlugin.extraArgs[0]".into(), "--v=4".into()),
                    ("scheduler.extender.extraArgs[0]".into(), "--v=4".into()),
                    // `/webhook` answers only the API server's client certificate
                    // (webhook_oracle; every GPU pod of this test is admitted through it).
                    (
                        "scheduler.admissionWebhook.clientAuth.enabled".into(),
                        "true".into(),
                    ),
                    (
                        "scheduler.admissionWebhook.clientAuth.caBundle".into(),
                        real::CLUSTER_WEBHOOK_CLIENT_CA.into(),
                    ),
                ]),
            },
        )
        .await?;
        let outcome: Result<()> = async {
            attacks(&c).await?;
            isolation_attacks(&c).await?;
            unaccounted_processes(&c).await?;
            nvml_view(&c).await?;
            over_booking(&c).await?;
            webhook_oracle(&c).await?;
            metrics_oracle(&c).await?;
            cache_dir_limit(&c).await?;
            listener_flood(&c).await?;
            unaccounted_evicted(&mut c).await
        }
        .await;
        if let Err(e) = outcome {
            panic!(
                "{e}\n{}\n{}",
                c.describe_pods(TENANT).await,
                c.describe_pods(NAMESPACE).await
            );
        }
        Ok(())
    })
}

async fn attacks(c: &RealCluster) -> Result<()> {
    c.tenant_namespace(TENANT).await?;
    c.tenant_namespace(OTHER).await?;

    // A running GPU pod with its booking: the victim of every attack.
    let victim: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "victim", "namespace": TENANT},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": GPU_NODE},
            "containers": [{
                "name": "main", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 3600"],
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}},
            }],
        },
    }))?;
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    user_pods.create(&PostParams::default(), &victim).await?;
    let admin_pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let victim = eventually(
        "the victim pod to run with its booking",
        Duration::from_secs(120),
        Duration::from_millis(250),
        || async {
            admin_pods
                .get_opt("victim")
                .await
                .ok()
                .flatten()
                .filter(|p| {
                    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                        && p.metadata
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get("hami.io/bind-phase"))
                            .is_some_and(|v| v == "success")
                })
        },
    )
    .await?;
    let booked = victim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("hami.io/vgpu-devices-allocated"))
        .cloned()
        .ok_or_else(|| Error::msg("victim has no vgpu-devices-allocated"))?;

    // The chart's identities, with tokens from the TokenRequest API.
    let plugin_sa = "tessera-device-plugin";
    let scheduler_sa = "tessera-scheduler";
    let plugin_pod = c.chart_pod_on("device-plugin", GPU_NODE).await?;
    let plugin = c
        .client_with_token(
            &c.service_account_token(plugin_sa, Some(&plugin_pod))
                .await?,
        )
        .await?;
    let plugin_unbound = c
        .client_with_token(&c.service_account_token(plugin_sa, None).await?)
        .await?;
    let scheduler = c
        .client_with_token(&c.service_account_token(scheduler_sa, None).await?)
        .await?;

    let image_patch = Patch::Strategic(
        json!({"spec": {"containers": [{"name": "main", "image": "evil:latest"}]}}),
    );
    let taint = Patch::Merge(json!({"spec": {"taints": [{"key": "evil", "effect": "NoExecute"}]}}));

    // Positive control: the plugin may still annotate its own node (dry run).
    Api::<Node>::all(plugin.clone())
        .patch(
            GPU_NODE,
            &dry(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"hami.io/node-nvidia-register": "[]"}}}),
            ),
        )
        .await
        .map_err(|e| Error::msg(format!("the plugin cannot annotate its own node: {e}")))?;

    // 1. The plugin's identity.
    refused(
        "plugin: patch a tenant pod's image",
        Api::<Pod>::namespaced(plugin.clone(), TENANT)
            .patch("victim", &dry(), &image_patch)
            .await,
        &[POLICY],
    )?;
    refused(
        "plugin: taint its own node NoExecute",
        Api::<Node>::all(plugin.clone())
            .patch(GPU_NODE, &dry(), &taint)
            .await,
        &[POLICY],
    )?;
    refused(
        "plugin: annotate a node that is not its own",
        Api::<Node>::all(plugin.clone())
            .patch(
                OTHER_NODE,
                &dry(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"hami.io/node-nvidia-register": "[]"}}}),
                ),
            )
            .await,
        &[POLICY],
    )?;
    refused(
        "plugin: relabel its own node",
        Api::<Node>::all(plugin.clone())
            .patch(
                GPU_NODE,
                &dry(),
                &Patch::Merge(json!({"metadata": {"labels": {"gpu": "off"}}})),
            )
            .await,
        &[POLICY],
    )?;
    refused(
        "plugin, token without a node claim: annotate its node",
        Api::<Node>::all(plugin_unbound.clone())
            .patch(
                GPU_NODE,
                &dry(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"hami.io/node-nvidia-register": "[]"}}}),
                ),
            )
            .await,
        &[POLICY],
    )?;

    // 2. The scheduler's identity (kube-scheduler shares it).
    refused(
        "scheduler: patch a tenant pod's image",
        Api::<Pod>::namespaced(scheduler.clone(), TENANT)
            .patch("victim", &dry(), &image_patch)
            .await,
        &[POLICY],
    )?;
    refused(
        "scheduler: relabel a tenant pod",
        Api::<Pod>::namespaced(scheduler.clone(), TENANT)
            .patch(
                "victim",
                &dry(),
                &Patch::Merge(json!({"metadata": {"labels": {"app": "evil"}}})),
            )
            .await,
        &[POLICY],
    )?;
    // RBAC: the scheduler has no node writes at all.
    refused(
        "scheduler: taint a node NoExecute",
        Api::<Node>::all(scheduler.clone())
            .patch(GPU_NODE, &dry(), &taint)
            .await,
        &[],
    )?;

    // 2b. The extender's identity holds none of kube-scheduler's rights: kube-scheduler has its
    // own ServiceAccount, whose token only its container mounts (issue 28, item 5).
    extender_and_kube_scheduler_are_apart(c, &scheduler).await?;

    // 3. The tenant, skipping the webhook with its label.
    let forged: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "forged", "namespace": TENANT,
            "labels": {"hami.io/webhook": "ignore"},
            "annotations": {
                "hami.io/bind-phase": "allocating",
                "hami.io/vgpu-node": GPU_NODE,
                "hami.io/vgpu-devices-to-allocate": booked,
                "hami.io/vgpu-devices-allocated": booked,
            },
        },
        "spec": {
            "nodeName": GPU_NODE,
            "schedulerName": "hami-scheduler",
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 3600"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }],
        },
    }))?;
    refused(
        "tenant: create a pod with hami.io/webhook=ignore and a forged booking",
        user_pods
            .create(
                &PostParams {
                    dry_run: true,
                    ..PostParams::default()
                },
                &forged,
            )
            .await,
        &[POLICY],
    )?;
    let strip = Patch::Merge(
        json!({"metadata": {"annotations": {"hami.io/vgpu-devices-allocated": null}}}),
    );
    refused(
        "tenant: remove vgpu-devices-allocated from a running pod",
        user_pods.patch("victim", &dry(), &strip).await,
        &[POLICY, WEBHOOK],
    )?;
    user_pods
        .patch(
            "victim",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"hami.io/webhook": "ignore"}}})),
        )
        .await?;
    refused(
        "tenant: remove vgpu-devices-allocated from a running pod labelled hami.io/webhook=ignore",
        user_pods.patch("victim", &dry(), &strip).await,
        &[POLICY],
    )?;
    refused(
        "tenant: rewrite bind-phase on a labelled pod",
        user_pods
            .patch(
                "victim",
                &dry(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"hami.io/bind-phase": "allocating"}}}),
                ),
            )
            .await,
        &[POLICY],
    )?;

    // pods/status: give the tenant the right to write it, so the refusal is the policy's.
    grant_tenant(c, "pod-status-writer", "pods/status").await?;
    let status_strip = Patch::Merge(json!({"metadata": {"annotations": {
        "hami.io/vgpu-devices-allocated": null,
        "hami.io/vgpu-devices-to-allocate": booked,
        "hami.io/bind-phase": "allocating",
    }}}));
    let status_result = eventually(
        "the tenant's pods/status right to take effect",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            match user_pods
                .patch_status("victim", &dry(), &status_strip)
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 403 && !e.message.contains(POLICY) => None,
                r => Some(r),
            }
        },
    )
    .await?;
    refused(
        "tenant with pods/status rights: rewrite the booking through pods/status",
        status_result,
        &[POLICY],
    )?;

    // 4. A Binding carrying a forged booking: the API server merges a Binding's annotations into
    //    the pod, and the extender writes its decision that way. An identity that may create
    //    Bindings but is not the scheduler (here the cluster admin) must not set them.
    let unbound: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "unbound", "namespace": TENANT},
        "spec": {
            "schedulerName": "nobody",
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 3600"],
            }],
        },
    }))?;
    let unbound = admin_pods.create(&PostParams::default(), &unbound).await?;
    let forged_binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {
            "name": "unbound", "namespace": TENANT, "uid": unbound.metadata.uid,
            "annotations": {
                "hami.io/bind-phase": "allocating",
                "hami.io/vgpu-node": GPU_NODE,
                "hami.io/vgpu-devices-to-allocate": booked,
                "hami.io/vgpu-devices-allocated": booked,
            },
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": GPU_NODE},
    });
    let dry_post = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    refused(
        "admin: bind a pod with a Binding that carries a forged booking",
        admin_pods
            .create_subresource::<_, Value>("binding", "unbound", &dry_post, &forged_binding)
            .await,
        &[POLICY],
    )?;
    // Positive control: the scheduler's identity may (it writes its decisions so).
    Api::<Pod>::namespaced(scheduler.clone(), TENANT)
        .create_subresource::<_, Value>("binding", "unbound", &dry_post, &forged_binding)
        .await
        .map_err(|e| Error::msg(format!("the scheduler cannot bind with annotations: {e}")))?;
    admin_pods
        .delete("unbound", &kube::api::DeleteParams::default())
        .await?;

    // Nothing changed on the victim.
    let after = admin_pods.get("victim").await?;
    let ann = after.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        ann.get("hami.io/vgpu-devices-allocated"),
        Some(&booked),
        "booking intact"
    );
    assert_eq!(
        ann.get("hami.io/bind-phase").map(String::as_str),
        Some("success")
    );
    assert_eq!(
        after
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.as_deref()),
        Some(PROBE_IMAGE)
    );
    Ok(())
}

/// Gives the tenant `get`, `patch` and `update` on `resource` in its namespace (a Role and its
/// binding named `name`), so that a refusal that follows is the policy's, not RBAC's.
/// The scheduler pod runs two identities: the extender's (the pod's account, `scheduler`) may
/// neither delete a pod nor write a ResourceClaim's status, both of which kube-scheduler's own
/// account may (positive control, with the token of its Secret); and the extender's container
/// mounts no token but its own.
async fn extender_and_kube_scheduler_are_apart(
    c: &RealCluster,
    scheduler: &kube::Client,
) -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::DeleteParams;
    let dry_delete = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    let claim_status = Patch::Merge(json!({"status": {"allocation": null}}));
    let claims = |client: &kube::Client| {
        Api::<k8s_openapi::api::resource::v1::ResourceClaim>::namespaced(client.clone(), TENANT)
    };
    refused(
        "extender: delete a tenant pod",
        Api::<Pod>::namespaced(scheduler.clone(), TENANT)
            .delete("victim", &dry_delete)
            .await,
        &[],
    )?;
    refused(
        "extender: write a ResourceClaim's status",
        claims(scheduler)
            .patch_status("any-claim", &dry(), &claim_status)
            .await,
        &[],
    )?;
    let secret = Api::<Secret>::namespaced(c.admin().clone(), NAMESPACE)
        .get("tessera-kube-scheduler-token")
        .await?;
    let token = secret
        .data
        .as_ref()
        .and_then(|d| d.get("token"))
        .ok_or_else(|| Error::msg("kube-scheduler's token Secret has no token"))?;
    let kube_scheduler = c
        .client_with_token(std::str::from_utf8(&token.0).map_err(|e| Error::msg(e.to_string()))?)
        .await?;
    Api::<Pod>::namespaced(kube_scheduler, TENANT)
        .delete("victim", &dry_delete)
        .await
        .map_err(|e| Error::msg(format!("kube-scheduler's account cannot delete a pod: {e}")))?;
    let pod = c.chart_pod_on_any("scheduler").await?;
    let spec = pod
        .spec
        .ok_or_else(|| Error::msg("scheduler pod without spec"))?;
    if spec.automount_service_account_token != Some(false) {
        return Err(Error::msg(
            "the scheduler pod mounts its account's token for every container",
        ));
    }
    for container in &spec.containers {
        let mounts: Vec<&str> = container
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| m.mount_path.starts_with("/var/run/secrets/kubernetes.io"))
            .map(|m| m.name.as_str())
            .collect();
        let expected = match container.name.as_str() {
            "kube-scheduler" => "kube-scheduler-token",
            _ => "extender-token",
        };
        if mounts != [expected] {
            return Err(Error::msg(format!(
                "container {} mounts tokens {mounts:?}, expected only {expected}",
                container.name
            )));
        }
    }
    eprintln!("the extender's account holds none of kube-scheduler's rights");
    Ok(())
}

async fn grant_tenant(c: &RealCluster, name: &str, resource: &str) -> Result<()> {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": TENANT},
        "rules": [{"apiGroups": [""], "resources": [resource], "verbs": ["get", "patch", "update"]}],
    }))?;
    Api::<Role>::namespaced(c.admin().clone(), TENANT)
        .create(&PostParams::default(), &role)
        .await?;
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": TENANT},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": real::USER}],
    }))?;
    Api::<RoleBinding>::namespaced(c.admin().clone(), TENANT)
        .create(&PostParams::default(), &rb)
        .await?;
    Ok(())
}

/// A pod of the tenant's namespace: `containers` (JSON) on the GPU node, `extra` merged into the
/// spec.
fn tenant_pod(name: &str, labels: Value, containers: Value, extra: Value) -> Result<Pod> {
    let spec = with_fields(
        json!({
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": GPU_NODE},
            "containers": containers,
        }),
        extra,
    );
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": TENANT, "labels": labels},
        "spec": spec,
    }))?)
}

/// One container running the probe image for an hour.
fn container(name: &str, resources: Value, more: Value) -> Value {
    with_fields(
        json!({
            "name": name, "image": PROBE_IMAGE, "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", "sleep 3600"],
            "resources": resources,
        }),
        more,
    )
}

/// `base` (a JSON object) with the fields of `more` added or replaced.
fn with_fields(mut base: Value, more: Value) -> Value {
    if let (Some(o), Some(m)) = (base.as_object_mut(), more.as_object()) {
        for (k, v) in m {
            o.insert(k.clone(), v.clone());
        }
    }
    base
}

/// Issue 28's routes to more GPU than a pod booked, each tried by the tenant (its own identity,
/// the `edit` role) and refused by the container-isolation policy, which no label skips; and the
/// ordinary pods the policy must keep admitting.
async fn isolation_attacks(c: &RealCluster) -> Result<()> {
    const ISOLATION: &str = "Tessera admission policy";
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    let dry_post = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let gpu = json!({"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}});
    let none = json!({});
    let skip = json!({"hami.io/webhook": "ignore"});
    let env = |pairs: &[(&str, &str)]| json!({"env": pairs.iter().map(|(k, v)| json!({"name": k, "value": v})).collect::<Vec<_>>()});

    // 1. The webhook's opt-out label with the shim switched off, or a privileged container.
    let mut attempts: Vec<(String, Pod)> = vec![
        (
            "GPU pod labelled hami.io/webhook=ignore with CUDA_DISABLE_CONTROL=true".to_owned(),
            tenant_pod(
                "no-shim",
                skip.clone(),
                json!([container(
                    "main",
                    gpu.clone(),
                    env(&[("CUDA_DISABLE_CONTROL", "true")])
                )]),
                json!({}),
            )?,
        ),
        (
            "GPU pod labelled hami.io/webhook=ignore with a privileged container".to_owned(),
            tenant_pod(
                "privileged",
                skip.clone(),
                json!([container(
                    "main",
                    gpu.clone(),
                    json!({"securityContext": {"privileged": true}})
                )]),
                json!({}),
            )?,
        ),
        (
            "privileged sidecar without a GPU request beside a GPU container".to_owned(),
            tenant_pod(
                "privileged-sidecar",
                skip.clone(),
                json!([
                    container("main", gpu.clone(), json!({})),
                    container(
                        "side",
                        none.clone(),
                        json!({"securityContext": {"privileged": true}})
                    ),
                ]),
                json!({}),
            )?,
        ),
        (
            "GPU pod raising its own limit in env (CUDA_DEVICE_MEMORY_LIMIT_0)".to_owned(),
            tenant_pod(
                "own-limit",
                skip.clone(),
                json!([container(
                    "main",
                    gpu.clone(),
                    env(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "15000m")])
                )]),
                json!({}),
            )?,
        ),
        (
            "GPU pod with LD_PRELOAD".to_owned(),
            tenant_pod(
                "preload-env",
                json!({}),
                json!([container(
                    "main",
                    gpu.clone(),
                    env(&[("LD_PRELOAD", "/tmp/mine.so")])
                )]),
                json!({}),
            )?,
        ),
    ];
    // 2. Its own files over the limits file, the preload file or the shim's directory: a
    //    ConfigMap subPath file is root-owned and read-only, all the shim can check.
    let cm_volume = json!({"volumes": [{"name": "cm", "configMap": {"name": "anything"}}]});
    for (i, (path, sub)) in [
        ("/usr/local/vgpu/vgpu-limits", Some("limits")),
        ("/etc/ld.so.preload", Some("preload")),
        ("/usr/local/vgpu", None),
        ("/usr/local", None),
        ("/etc", None),
        ("/", None),
        ("//usr//local/./vgpu/vgpu-limits", Some("limits")),
        ("/usr/local/vgpu/../vgpu/vgpu-limits", Some("limits")),
        ("/etc/ld.so.preload/", Some("preload")),
    ]
    .into_iter()
    .enumerate()
    {
        let mut mount = json!({"name": "cm", "mountPath": path});
        if let Some(sub) = sub {
            mount["subPath"] = json!(sub);
        }
        attempts.push((
            format!("a volume mounted at {path}"),
            tenant_pod(
                &format!("mount-{i}"),
                json!({}),
                json!([container(
                    "main",
                    gpu.clone(),
                    json!({"volumeMounts": [mount]})
                )]),
                cm_volume.clone(),
            )?,
        ));
    }
    // 3. NVIDIA_VISIBLE_DEVICES from a pod that booked no GPU (or more than it booked), in every
    //    kind of container, as a value or by reference.
    attempts.push((
        "a pod without a GPU request setting NVIDIA_VISIBLE_DEVICES=all".to_owned(),
        tenant_pod(
            "all-gpus",
            json!({}),
            json!([container(
                "main",
                none.clone(),
                env(&[("NVIDIA_VISIBLE_DEVICES", "all")])
            )]),
            json!({}),
        )?,
    ));
    attempts.push((
        "an init container setting NVIDIA_VISIBLE_DEVICES from a ConfigMap key".to_owned(),
        tenant_pod(
            "all-gpus-init",
            json!({}),
            json!([container("main", none.clone(), json!({}))]),
            json!({"initContainers": [container("init", none.clone(), json!({"env": [{
                "name": "NVIDIA_VISIBLE_DEVICES",
                "valueFrom": {"configMapKeyRef": {"name": "anything", "key": "k"}},
            }]}))]}),
        )?,
    ));
    attempts.push((
        "a GPU pod replacing the device list Allocate returns".to_owned(),
        tenant_pod(
            "replace-list",
            json!({}),
            json!([container(
                "main",
                gpu.clone(),
                env(&[("NVIDIA_VISIBLE_DEVICES", "GPU-0,GPU-1")])
            )]),
            json!({}),
        )?,
    ));
    attempts.push((
        "a hostPath volume of the node's shim directory".to_owned(),
        tenant_pod(
            "host-shim",
            json!({}),
            json!([container(
                "main",
                none.clone(),
                json!({"volumeMounts": [{"name": "h", "mountPath": "/data"}]})
            )]),
            json!({"volumes": [{"name": "h", "hostPath": {"path": "/usr/local/vgpu/"}}]}),
        )?,
    ));
    for (what, pod) in &attempts {
        refused(
            &format!("tenant: {what}"),
            user_pods.create(&dry_post, pod).await,
            &[ISOLATION],
        )?;
    }

    // 4. Ephemeral containers (`kubectl debug`) added to the running GPU pod. The tenant is
    //    given the right to add them, so the refusal is the policy's.
    grant_tenant(c, "debugger", "pods/ephemeralcontainers").await?;
    let debug = |name: &str, more: Value| {
        let e = with_fields(
            json!({
                "name": name, "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 3600"],
            }),
            more,
        );
        Patch::Strategic(json!({"spec": {"ephemeralContainers": [e]}}))
    };
    for (what, patch) in [
        (
            "kubectl debug with NVIDIA_VISIBLE_DEVICES=all on the GPU pod",
            debug("debug-all", env(&[("NVIDIA_VISIBLE_DEVICES", "all")])),
        ),
        (
            "a privileged ephemeral container in the GPU pod",
            debug(
                "debug-priv",
                json!({"securityContext": {"privileged": true}}),
            ),
        ),
    ] {
        let result = eventually(
            "the tenant's pods/ephemeralcontainers right to take effect",
            Duration::from_secs(10),
            Duration::from_millis(200),
            || async {
                match user_pods
                    .patch_subresource("ephemeralcontainers", "victim", &dry(), &patch)
                    .await
                {
                    Err(kube::Error::Api(e)) if e.code == 403 && !e.message.contains(ISOLATION) => {
                        None
                    }
                    r => Some(r),
                }
            },
        )
        .await?;
        refused(&format!("tenant: {what}"), result, &[ISOLATION])?;
    }

    // Positive controls: what ordinary GPU and CPU pods do stays admitted.
    let ordinary = [
        tenant_pod(
            "ordinary-gpu",
            json!({}),
            json!([container(
                "main",
                gpu.clone(),
                json!({
                    "env": [
                        {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
                        {"name": "LD_LIBRARY_PATH", "value": "/opt/lib"},
                        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
                    ],
                    "volumeMounts": [
                        {"name": "scratch", "mountPath": "/tmp"},
                        {"name": "scratch", "mountPath": "/usr/local/vgpu-data", "subPath": "a"},
                        {"name": "scratch", "mountPath": "/etc/app"},
                    ],
                })
            )]),
            json!({"volumes": [{"name": "scratch", "emptyDir": {}}]}),
        )?,
        tenant_pod(
            "no-gpus",
            json!({}),
            json!([container(
                "main",
                none.clone(),
                env(&[("NVIDIA_VISIBLE_DEVICES", "none")])
            )]),
            json!({}),
        )?,
    ];
    for pod in &ordinary {
        user_pods.create(&dry_post, pod).await.map_err(|e| {
            Error::msg(format!(
                "an ordinary pod {} was refused: {e}",
                pod.metadata.name.as_deref().unwrap_or_default()
            ))
        })?;
    }
    // 5. What admission cannot see: NVIDIA_VISIBLE_DEVICES=all through envFrom, in a pod that
    //    booked no GPU, on the GPU node. Admitted; the node's runtime ignores the variable in an
    //    unprivileged container, so the container gets no driver and no GPU.
    let cm: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "all-gpus", "namespace": TENANT},
        "data": {"NVIDIA_VISIBLE_DEVICES": "all"},
    }))?;
    Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.user().clone(), TENANT)
        .create(&PostParams::default(), &cm)
        .await?;
    let env_from = tenant_pod(
        "env-from",
        json!({}),
        json!([{
            "name": "main", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
            "envFrom": [{"configMapRef": {"name": "all-gpus"}}],
            "command": ["/bin/sh", "-c",
                "echo visible=$NVIDIA_VISIBLE_DEVICES; \
                 if [ -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 ]; then echo DRIVER; else echo NO-DRIVER; fi; \
                 cuda_probe info 2>&1 | head -n 3"],
        }]),
        json!({}),
    )?;
    user_pods.create(&PostParams::default(), &env_from).await?;
    c.wait_finished(TENANT, "env-from", Duration::from_secs(120))
        .await?;
    let log = c.logs(TENANT, "env-from", "main").await?;
    eprintln!("envFrom NVIDIA_VISIBLE_DEVICES=all on the GPU node:\n{log}");
    if !log.contains("visible=all") || !log.contains("NO-DRIVER") {
        return Err(Error::msg(format!(
            "a pod without a GPU request set NVIDIA_VISIBLE_DEVICES=all through envFrom and got \
             the driver (or the test did not run as meant): {log}"
        )));
    }

    // A label change on a running pod (the policy checks what an UPDATE adds, nothing else).
    user_pods
        .patch(
            "victim",
            &dry(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
        )
        .await
        .map_err(|e| Error::msg(format!("a label update of a running pod was refused: {e}")))?;
    Ok(())
}

/// Issue 28, item 3: the node sees every process on its GPUs. On the node with one shared
/// simulated GPU, a GPU pod holding memory through the shim is accounted and never reported;
/// a pod of the tenant with no GPU booking that reaches the GPU anyway (the driver and the GPU's
/// state by hostPath, as a pod with `/dev/nvidia*` mounted would) is reported on the pod within
/// two passes, and so is a process in no pod (on the Node). Evicting is the unit tests'
/// (`process_watch`): the shared cluster runs the default policy, `report`.
async fn unaccounted_processes(c: &RealCluster) -> Result<()> {
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    let running = |name: &'static str| tenant_pod_in(c, name, &["Running"]);
    // The honest pod: 1000 MiB booked, held through the shim.
    let honest = tenant_pod(
        "honest",
        json!({}),
        json!([container(
            "main",
            json!({"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}}),
            json!({"command": ["cuda_probe", "hold", "1048576", "/", "/tmp/held"]})
        )]),
        json!({"nodeSelector": {"kubernetes.io/hostname": OTHER_NODE}}),
    )?;
    user_pods.create(&PostParams::default(), &honest).await?;
    let honest = running("honest").await?;

    // The stowaway: no GPU request, the node's driver and GPU state by hostPath.
    let stowaway = stowaway_pod(c, "stowaway")?;
    user_pods.create(&PostParams::default(), &stowaway).await?;
    let stowaway = running("stowaway").await?;
    let node = c.node(OTHER_NODE).ok_or_else(|| Error::msg("no t4-node"))?;
    let state = node.dir.join("gpu-state");

    // A process in no pod: the fake CUDA run on the node itself, outside every pod's cgroup
    // (`timeout`: it is the node's, and outlives nsenter).
    let mut host = node
        .command_in(Path::new("/usr/bin/timeout"))?
        .arg("120")
        .arg(&c.artifacts.cuda_probe)
        .args(["hold", "1048576", "/", "/dev/null"])
        .env("LD_LIBRARY_PATH", &c.artifacts.driver_dir)
        .env("FAKE_GPU_STATE", &state)
        .env("FAKE_CUDA_MEMORY_MIB", "15360")
        .spawn()?;

    let uid_of = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
    let warnings_on = |uid: String| async move { events_on(c, &uid).await.unwrap_or_default() };
    // Two passes confirm; a few more for the Event to be written and the pod's start.
    let within = Duration::from_secs(WATCH_PERIOD_SECS * 2 + 30);
    let found = eventually(
        "a GpuNotBooked Event on the stowaway pod",
        within,
        Duration::from_millis(500),
        || async {
            warnings_on(uid_of(&stowaway))
                .await
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("GpuNotBooked"))
        },
    )
    .await;
    let node_events: Api<Event> = Api::namespaced(c.admin().clone(), "default");
    let outside = eventually(
        "a GpuProcessOutsidePods Event on the node",
        within,
        Duration::from_millis(500),
        || async {
            node_events
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("GpuProcessOutsidePods"))
        },
    )
    .await;
    let _ = host.kill();
    let _ = host.wait();
    if found.is_err() || outside.is_err() {
        // What the plugin saw: its log's last lines and its unaccounted-process series.
        let plugin = c.chart_pod_on("device-plugin", OTHER_NODE).await?;
        let name = plugin.metadata.name.unwrap_or_default();
        let log = c
            .logs(NAMESPACE, &name, "tessera-device-plugin")
            .await
            .unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let metrics = c
            .device_plugin_metrics(OTHER_NODE)
            .await
            .unwrap_or_default();
        let series: Vec<&str> = metrics
            .lines()
            .filter(|l| l.contains("unaccounted") || l.contains("undetermined"))
            .collect();
        return Err(Error::msg(format!(
            "stowaway: {:?}; outside pods: {:?}\nplugin metrics:\n{}\nplugin log (newest first):\n{}",
            found.err().map(|e| e.to_string()),
            outside.err().map(|e| e.to_string()),
            series.join("\n"),
            tail.join("\n")
        )));
    }
    let found = found?;
    let message = found.message.unwrap_or_default();
    if !message.contains("GPU-") {
        return Err(Error::msg(format!(
            "the stowaway's Event does not name the GPU: {message}"
        )));
    }
    let metrics = eventually(
        "the plugin's metric of the unaccounted process",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async {
            c.device_plugin_metrics(OTHER_NODE).await.filter(|m| {
                m.contains(
                    "tessera_device_plugin_unaccounted_gpu_processes{reason=\"GpuNotBooked\"} 1",
                )
            })
        },
    )
    .await;
    metrics?;
    // The honest pod, accounted all along, got no such Event.
    let honest_warnings: Vec<String> = warnings_on(uid_of(&honest))
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .filter(|r| r.starts_with("GpuProcess") || r == "GpuNotBooked")
        .collect();
    if !honest_warnings.is_empty() {
        return Err(Error::msg(format!(
            "the honest pod was reported: {honest_warnings:?}"
        )));
    }
    for name in ["stowaway", "honest"] {
        c.delete_pod(TENANT, name).await?;
    }
    Ok(())
}

/// Issue 31: what a tenant's container sees of a shared GPU through NVML. On the node's one
/// simulated GPU another namespace's pod holds memory and keeps the GPU busy; the tenant's pod
/// runs a busy process and then reads what `nvidia-smi` reads (`cuda_probe smi`). Every list
/// holds only the tenant's own two processes, with the PIDs its container sees; its utilization
/// is its busy process's (host PIDs recorded in its region by the node's watch), below the
/// card's; the neighbour's processes, which the node's own view of the GPU lists, appear in
/// none of it.
async fn nvml_view(c: &RealCluster) -> Result<()> {
    let gpu_pod = |namespace: &str, name: &str, command: &str| -> Result<Pod> {
        let mut pod = tenant_pod(
            name,
            json!({}),
            json!([container(
                "main",
                json!({"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}}),
                json!({"command": ["/bin/sh", "-c", command]})
            )]),
            json!({"nodeSelector": {"kubernetes.io/hostname": OTHER_NODE}}),
        )?;
        pod.metadata.namespace = Some(namespace.to_owned());
        Ok(pod)
    };
    let neighbour = gpu_pod(
        OTHER,
        "smi-neighbour",
        "cuda_probe busy 300 40 & exec cuda_probe hold 1048576 / /tmp/held",
    )?;
    Api::<Pod>::namespaced(c.user().clone(), OTHER)
        .create(&PostParams::default(), &neighbour)
        .await?;
    // Three watch passes after its busy process starts, the smi process reads.
    let mine = gpu_pod(
        TENANT,
        "smi-mine",
        &format!(
            "cuda_probe busy 300 40 & echo BUSY $!; sleep {}; cuda_probe smi 67108864 0; sleep 3600",
            WATCH_PERIOD_SECS * 3 + 4
        ),
    )?;
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    user_pods.create(&PostParams::default(), &mine).await?;
    let log = eventually(
        "smi-mine's NVML view",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            c.logs(TENANT, "smi-mine", "main")
                .await
                .ok()
                .filter(|l| l.contains("SAMPLES2 "))
        },
    )
    .await?;
    let value = |prefix: &str| -> Option<String> {
        log.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .map(str::to_owned)
    };
    let pids_of = |rest: &str| -> Vec<u32> {
        rest.split_whitespace()
            .skip(1)
            .filter_map(|e| e.split_once(':')?.0.parse().ok())
            .collect()
    };
    let busy: u32 = value("BUSY ")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let smi: u32 = value("PID ")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let fail = |why: String| Err(Error::msg(format!("{why}\nsmi-mine's log:\n{log}")));
    if log.contains("FAIL") || busy == 0 || smi == 0 {
        return fail("the probe failed".into());
    }
    let compute = value("LIST nvmlDeviceGetComputeRunningProcesses_v3 n=").unwrap_or_default();
    let mut listed = pids_of(&compute);
    listed.sort_unstable();
    let mut own = vec![busy, smi];
    own.sort_unstable();
    if listed != own {
        return fail(format!(
            "the compute list is not the container's two processes {own:?}"
        ));
    }
    for line in log
        .lines()
        .filter(|l| l.starts_with("LIST ") || l.starts_with("SAMPLES"))
    {
        let (_, rest) = line.split_once(" n=").unwrap_or(("", ""));
        if let Some(other) = pids_of(rest).into_iter().find(|p| !own.contains(p)) {
            return fail(format!("{line}: PID {other} is not the container's"));
        }
    }
    let util: u32 = value("UTIL gpu=")
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let samples = value("SAMPLES n=").unwrap_or_default();
    if util == 0 || pids_of(&samples) != [busy] {
        return fail(format!(
            "the container's utilization ({util} %) or samples ({samples}) are not its busy process's"
        ));
    }
    // The card as the node sees it (the bare driver, no shim): the neighbour's processes are
    // there, and the card is busier than the tenant's share.
    let node = c.node(OTHER_NODE).ok_or_else(|| Error::msg("no t4-node"))?;
    let bare = node
        .command_in(&c.artifacts.cuda_probe)?
        .args(["smi", "0", "0"])
        .env("LD_LIBRARY_PATH", &c.artifacts.driver_dir)
        .env("FAKE_GPU_STATE", node.dir.join("gpu-state"))
        .env("FAKE_NVML_SCENARIO", node.dir.join("gpu-scenario.json"))
        .output()?;
    let bare = String::from_utf8_lossy(&bare.stdout).into_owned();
    let card: Vec<u32> = bare
        .lines()
        .find_map(|l| l.strip_prefix("LIST nvmlDeviceGetComputeRunningProcesses_v3 n="))
        .map(pids_of)
        .unwrap_or_default();
    if card.len() < 3 {
        return fail(format!(
            "the node's view of the GPU lacks the neighbour's processes:\n{bare}"
        ));
    }
    eprintln!(
        "smi-mine sees {own:?} at {util} % of the card; the card has {} processes",
        card.len()
    );
    c.delete_pod(TENANT, "smi-mine").await?;
    c.delete_pod(OTHER, "smi-neighbour").await?;
    Ok(())
}

/// Issue 28, item 4: busy connections from one peer do not stop GPU pod creation. A tenant's pod
/// keeps 1,000 connections open to the extender's listener (the webhook's port), each reopened
/// as soon as it is closed; meanwhile another namespace's GPU pod is admitted (the API server
/// calls the webhook, which fails closed) within 5 s, and the extender stays Ready, unrestarted.
async fn listener_flood(c: &RealCluster) -> Result<()> {
    const CONNECTIONS: usize = 1000;
    let scheduler = c.chart_pod_on_any("scheduler").await?;
    let ip = scheduler
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .ok_or_else(|| Error::msg("the scheduler pod has no IP"))?;
    let node = scheduler
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .ok_or_else(|| Error::msg("the scheduler pod has no node"))?;
    let restarts = |p: &Pod| -> i32 {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map_or(0, |cs| cs.iter().map(|c| c.restart_count).sum())
    };
    let restarts_before = restarts(&scheduler);
    // One slot per connection: open, hold without a byte, reopen when the listener closes it.
    let script = format!(
        "i=0; while [ $i -lt {CONNECTIONS} ]; do \
           (while :; do sleep 60 | nc {ip} 443 >/dev/null 2>&1; done) & i=$((i+1)); \
         done; echo flooding; wait"
    );
    let flood = tenant_pod(
        "flood",
        json!({}),
        json!([container(
            "main",
            json!({}),
            json!({"command": ["/bin/sh", "-c", script]})
        )]),
        json!({"nodeSelector": {"kubernetes.io/hostname": node}}),
    )?;
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    user_pods.create(&PostParams::default(), &flood).await?;
    tenant_pod_in(c, "flood", &["Running"]).await?;
    // Let every slot connect and the listener reach its per-peer limit.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let other_pods: Api<Pod> = Api::namespaced(c.user().clone(), OTHER);
    let mut slowest = Duration::ZERO;
    for i in 0..3 {
        let name = format!("admitted-{i}");
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": OTHER},
            "spec": {
                "restartPolicy": "Never",
                "containers": [container(
                    "main",
                    json!({"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "500"}}),
                    json!({})
                )],
            },
        }))?;
        let started = std::time::Instant::now();
        other_pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(|e| {
                Error::msg(format!("GPU pod {name} not admitted during the flood: {e}"))
            })?;
        slowest = slowest.max(started.elapsed());
        other_pods.delete(&name, &Default::default()).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    eprintln!(
        "during a {CONNECTIONS}-connection flood from one pod: slowest GPU pod admission {slowest:?}"
    );
    if slowest > Duration::from_secs(5) {
        return Err(Error::msg(format!(
            "a GPU pod took {slowest:?} to be admitted during the flood (limit 5 s)"
        )));
    }
    let after = c.chart_pod_on_any("scheduler").await?;
    let ready = after
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    if !ready || restarts(&after) != restarts_before {
        return Err(Error::msg(format!(
            "the extender during the flood: ready={ready}, restarts {} -> {}",
            restarts_before,
            restarts(&after)
        )));
    }
    c.delete_pod(TENANT, "flood").await?;
    Ok(())
}

/// Beyond HAMi (issue 28): a booked pod whose process reaches the driver around the shim (a
/// second copy of the driver in a new link-map namespace: `cuda_probe bypass`) takes 4096 MiB
/// against its 1000 MiB booking. Its region lists the process, so it is not "without shim";
/// NVML's per-process memory against the booking reports it on the pod within two passes
/// (`GpuMemoryOverBooking`, naming both figures), and the gauge counts it.
async fn over_booking(c: &RealCluster) -> Result<()> {
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    let pod = tenant_pod(
        "bypass",
        json!({}),
        json!([container(
            "main",
            json!({"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}}),
            json!({"command": ["cuda_probe", "bypass", "4096", "/tmp/held"]})
        )]),
        json!({"nodeSelector": {"kubernetes.io/hostname": OTHER_NODE}}),
    )?;
    user_pods.create(&PostParams::default(), &pod).await?;
    let pod = tenant_pod_in(c, "bypass", &["Running"]).await?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let reported = eventually(
        "a GpuMemoryOverBooking Event on the bypass pod",
        Duration::from_secs(WATCH_PERIOD_SECS * 2 + 30),
        Duration::from_millis(500),
        || async {
            events_on(c, &uid)
                .await
                .ok()?
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("GpuMemoryOverBooking"))
        },
    )
    .await;
    let reported = match reported {
        Ok(e) => e,
        Err(e) => {
            let metrics = c
                .device_plugin_metrics(OTHER_NODE)
                .await
                .unwrap_or_default();
            let series: Vec<&str> = metrics
                .lines()
                .filter(|l| l.contains("unaccounted"))
                .collect();
            return Err(Error::msg(format!(
                "{e}
plugin metrics:
{}",
                series.join("\n")
            )));
        }
    };
    let message = reported.message.unwrap_or_default();
    // "… uses N MiB of GPU …": at least the 4096 MiB taken around the shim.
    let used: u64 = message
        .split(" uses ")
        .nth(1)
        .and_then(|rest| rest.split(" MiB").next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    if used < 4096 {
        return Err(Error::msg(format!(
            "the over-booking Event does not name the 4096 MiB taken: {message}"
        )));
    }
    for part in ["the 1000 MiB it was allocated", "GPU-"] {
        if !message.contains(part) {
            return Err(Error::msg(format!(
                "the over-booking Event does not say {part:?}: {message}"
            )));
        }
    }
    eventually(
        "the gauge of the over-booked pod",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || async {
            c.device_plugin_metrics(OTHER_NODE).await.filter(|m| {
                m.contains(
                    "tessera_device_plugin_unaccounted_gpu_processes{reason=\"GpuMemoryOverBooking\"} 1",
                )
            })
        },
    )
    .await?;
    // The region vouches for the process: only the memory gives it away.
    let without_shim = events_on(c, &uid)
        .await?
        .into_iter()
        .any(|e| e.reason.as_deref() == Some("GpuProcessWithoutShim"));
    if without_shim {
        return Err(Error::msg(
            "the bypass was reported as without the shim: the test no longer shows what only the memory check catches",
        ));
    }
    eprintln!("over-booking reported: {message}");
    c.delete_pod(TENANT, "bypass").await?;
    Ok(())
}

/// Issue 28, item 4: `/webhook` as a yes/no oracle for another namespace's quota (a review of
/// a pod in `team-b` asking for more than its quota would be denied, naming the quota). This
/// cluster runs with `scheduler.admissionWebhook.clientAuth` and its API server presents its
/// webhook client certificate (`e2e/src/real.rs` `write_webhook_client`). A peer in the cluster
/// network without that certificate gets 403 for every review and learns nothing, while
/// `/healthz` still answers it; the API server itself is still answered: every GPU pod of this
/// test is admitted through the webhook (its `schedulerName` set by it, checked here once more).
async fn webhook_oracle(c: &RealCluster) -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    let scheduler = c.chart_pod_on_any("scheduler").await?;
    let ip = scheduler
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .ok_or_else(|| Error::msg("the scheduler pod has no IP"))?;
    let tls = Api::<Secret>::namespaced(c.admin().clone(), NAMESPACE)
        .get("tessera-scheduler-tls")
        .await?;
    let ca = tls
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .map(|b| b.0.clone())
        .ok_or_else(|| Error::msg("the serving Secret has no ca.crt"))?;
    let body = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "oracle-1", "operation": "CREATE", "namespace": OTHER,
            "userInfo": {"username": "mallory"},
            "object": {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
                "spec": {"containers": [{"name": "main", "image": "app", "resources": {
                    "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000000"}}}]},
            },
        },
    })
    .to_string();
    let review = format!(
        "POST /webhook HTTP/1.1\r\nHost: tessera-scheduler.{NAMESPACE}.svc\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let healthz = format!(
        "GET /healthz HTTP/1.1\r\nHost: tessera-scheduler.{NAMESPACE}.svc\r\nConnection: close\r\n\r\n"
    );
    let (answer, health) = tokio::task::spawn_blocking(move || {
        Ok::<_, Error>((https(&ip, &ca, &review)?, https(&ip, &ca, &healthz)?))
    })
    .await
    .map_err(|e| Error::msg(e.to_string()))??;
    if !health.starts_with("HTTP/1.1 200") {
        return Err(Error::msg(format!(
            "/healthz did not answer a peer without a certificate: {health}"
        )));
    }
    if !answer.starts_with("HTTP/1.1 403") || answer.contains("allowed") || answer.contains("quota")
    {
        return Err(Error::msg(format!(
            "a review without the API server's certificate was answered: {answer}"
        )));
    }
    // Positive control: the API server's reviews are answered (the webhook set the scheduler).
    let victim = Api::<Pod>::namespaced(c.admin().clone(), TENANT)
        .get("victim")
        .await?;
    let scheduler_name = victim
        .spec
        .and_then(|s| s.scheduler_name)
        .unwrap_or_default();
    if scheduler_name != "hami-scheduler" {
        return Err(Error::msg(format!(
            "the webhook did not mutate the victim pod (schedulerName {scheduler_name:?})"
        )));
    }
    eprintln!(
        "/webhook refused a peer without the API server's certificate: {}",
        answer.lines().next().unwrap_or("")
    );
    Ok(())
}

/// Issue 28, item 5: the metrics name every namespace's GPU quota and GPU pods. The tenant scrapes
/// the extender's 9395 and its node's device plugin's 9394 from the pod network, without a token,
/// with a made-up one and with its own ServiceAccount's token (issued to the tenant itself): 401,
/// 401, 403, and no metric in any answer. The e2e's scraper (a ServiceAccount allowed `get` on
/// `/metrics`, as Prometheus is) reads them (the extender's name the tenant's pod); the probes
/// stay open.
async fn metrics_oracle(c: &RealCluster) -> Result<()> {
    use tessera_e2e::cluster::http_get_status;
    let ip_of = |p: &Pod| p.status.as_ref().and_then(|s| s.pod_ip.clone());
    let scheduler = c.chart_pod_on_any("scheduler").await?;
    let plugin = c.chart_pod_on("device-plugin", GPU_NODE).await?;
    let targets = [
        ("extender", ip_of(&scheduler), 9395),
        ("device plugin", ip_of(&plugin), 9394),
    ];
    let req: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 600}}))?;
    let tenant_token =
        Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(c.user().clone(), TENANT)
            .create_subresource::<k8s_openapi::api::authentication::v1::TokenRequest, k8s_openapi::api::authentication::v1::TokenRequest>(
                "token",
                "default",
                &PostParams::default(),
                &req,
            )
            .await?
            .status
            .map(|s| s.token)
            .unwrap_or_default();
    let scraper = c.scrape_token().await?;
    for (what, ip, port) in targets {
        let ip = ip.ok_or_else(|| Error::msg(format!("the {what} pod has no IP")))?;
        let get = |path: &'static str, token: Option<String>| {
            let ip = ip.clone();
            async move {
                http_get_status(&ip, port, path, token.as_deref())
                    .await
                    .ok_or_else(|| Error::msg(format!("{what} {ip}:{port}{path} did not answer")))
            }
        };
        for (who, token, want) in [
            ("no token", None, 401),
            ("a made-up token", Some("not-a-token".to_owned()), 401),
            ("the tenant's own token", Some(tenant_token.clone()), 403),
        ] {
            let (status, body) = get("/metrics", token).await?;
            if status != want || body.contains("hami_") || body.contains(TENANT) {
                return Err(Error::msg(format!(
                    "{what} /metrics with {who}: {status} (want {want}): {}",
                    body.chars().take(300).collect::<String>()
                )));
            }
            eprintln!("{what} /metrics refused {who}: {status}");
        }
        // What the refusals kept back: the GPU series, and on the extender the tenant's pod.
        let (status, body) = get("/metrics", Some(scraper.clone())).await?;
        let complete = body.contains("hami_") && (port != 9395 || body.contains(TENANT));
        if status != 200 || !complete {
            return Err(Error::msg(format!(
                "{what} /metrics with the scraper's token: {status}: {}",
                body.chars().take(300).collect::<String>()
            )));
        }
        for probe in ["/healthz", "/readyz"] {
            let (status, _) = get(probe, None).await?;
            if status != 200 {
                return Err(Error::msg(format!(
                    "{what} {probe} without a token: {status}"
                )));
            }
        }
    }
    Ok(())
}

/// Issue 28, item 5: a GPU container writes 64 MiB into its cache directory (a host directory:
/// `/usr/local/vgpu` inside) to fill the node's disk outside its ephemeral-storage accounting.
/// The chart's default `devicePlugin.cacheDirLimit` (16 MiB) stops it with "No space left on
/// device"; the honest pod of `unaccounted_processes`, whose region lives in such a directory,
/// was accounted all along (the plugin reads the same limited directory).
async fn cache_dir_limit(c: &RealCluster) -> Result<()> {
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    let filler = tenant_pod(
        "filler",
        json!({}),
        json!([container(
            "main",
            json!({"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "500"}}),
            json!({"command": ["/bin/sh", "-c",
                "dd if=/dev/zero of=/usr/local/vgpu/fill bs=1M count=64 2>&1; \
                 echo written=$(wc -c < /usr/local/vgpu/fill)"]})
        )]),
        json!({"nodeSelector": {"kubernetes.io/hostname": OTHER_NODE}}),
    )?;
    user_pods.create(&PostParams::default(), &filler).await?;
    tenant_pod_in(c, "filler", &["Succeeded", "Failed"]).await?;
    let log = c.logs(TENANT, "filler", "main").await?;
    let written: u64 = log
        .lines()
        .find_map(|l| l.trim().strip_prefix("written="))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| Error::msg(format!("the filler said nothing of what it wrote: {log}")))?;
    if !log.contains("No space left on device") || written > 16 << 20 {
        return Err(Error::msg(format!(
            "a container wrote {written} bytes into its cache directory (limit 16 MiB): {log}"
        )));
    }
    eprintln!("the cache directory stopped the filler at {written} bytes");
    c.delete_pod(TENANT, "filler").await?;
    Ok(())
}

/// One HTTPS request to `ip:443` without a client certificate, trusting `ca_pem` for the
/// extender's serving certificate (issued for the Service names); the whole response.
fn https(ip: &str, ca_pem: &[u8], request: &str) -> Result<String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use std::io::{Read, Write};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots
            .add(cert.map_err(|e| Error::msg(e.to_string()))?)
            .map_err(|e| Error::msg(e.to_string()))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::msg(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = ServerName::try_from(format!("tessera-scheduler.{NAMESPACE}.svc"))
        .map_err(|e| Error::msg(e.to_string()))?;
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name)
        .map_err(|e| Error::msg(e.to_string()))?;
    let mut tcp = std::net::TcpStream::connect((ip, 443))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut stream = rustls::Stream::new(&mut conn, &mut tcp);
    stream.write_all(request.as_bytes())?;
    let mut out = Vec::new();
    // A close without close_notify after the response is fine here.
    let _ = stream.read_to_end(&mut out);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A pod of the tenant without a GPU request that reaches the node's (simulated) GPU anyway: the
/// driver and the GPU's state by hostPath, holding memory in 1 MiB pieces.
fn stowaway_pod(c: &RealCluster, name: &str) -> Result<Pod> {
    let node = c.node(OTHER_NODE).ok_or_else(|| Error::msg("no t4-node"))?;
    let driver = c.artifacts.driver_dir.join("libcuda.so.1");
    let state = node.dir.join("gpu-state");
    tenant_pod(
        name,
        json!({}),
        json!([container(
            "main",
            json!({}),
            json!({
                "command": ["cuda_probe", "hold", "1048576", "/", "/tmp/held"],
                "env": [
                    {"name": "FAKE_GPU_STATE", "value": tessera_e2e::real::SHARED_GPU_STATE},
                    {"name": "FAKE_CUDA_MEMORY_MIB", "value": "15360"},
                ],
                "volumeMounts": [
                    {"name": "driver", "mountPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "readOnly": true},
                    {"name": "state", "mountPath": tessera_e2e::real::SHARED_GPU_STATE},
                ],
            })
        )]),
        json!({
            "nodeSelector": {"kubernetes.io/hostname": OTHER_NODE},
            "volumes": [
                {"name": "driver", "hostPath": {"path": driver, "type": "File"}},
                {"name": "state", "hostPath": {"path": state, "type": "File"}},
            ],
        }),
    )
}

/// With `devicePlugin.unaccountedProcesses.policy: evict` (an upgrade of the release), the
/// stowaway is evicted within two passes: the plugin's delete passes the scope policy (its own
/// node's pod) and the RBAC the chart grants only under `evict`.
async fn unaccounted_evicted(c: &mut RealCluster) -> Result<()> {
    c.helm_upgrade_set(&[("devicePlugin.unaccountedProcesses.policy", "evict")])
        .await?;
    c.wait_plugin_rolled_out().await?;
    let user_pods: Api<Pod> = Api::namespaced(c.user().clone(), TENANT);
    user_pods
        .create(&PostParams::default(), &stowaway_pod(c, "stowaway-2")?)
        .await?;
    let admin_pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let seen_running = tenant_pod_in(c, "stowaway-2", &["Running"]).await?;
    let uid = seen_running.metadata.uid.clone().unwrap_or_default();
    eventually(
        "stowaway-2 evicted (deleted) by the device plugin",
        Duration::from_secs(WATCH_PERIOD_SECS * 2 + 40),
        Duration::from_millis(500),
        || async {
            match admin_pods.get_opt("stowaway-2").await {
                Ok(None) => Some(()),
                Ok(Some(p)) => (p.metadata.uid.as_deref() != Some(uid.as_str())
                    || p.metadata.deletion_timestamp.is_some())
                .then_some(()),
                Err(_) => None,
            }
        },
    )
    .await?;
    // The Event is queued before the delete but written by the plugin's Event task, so it may
    // reach the API server just after the pod is gone (a run failed on a one-shot read).
    eventually(
        "the Event that says why stowaway-2 was evicted",
        Duration::from_secs(15),
        Duration::from_millis(250),
        || async {
            events_on(c, &uid)
                .await
                .ok()?
                .into_iter()
                .any(|e| e.reason.as_deref() == Some("EvictingForUnaccountedGPUProcess"))
                .then_some(())
        },
    )
    .await
    .map_err(|e| {
        Error::msg(format!(
            "stowaway-2 was deleted without the Event that says why: {e}"
        ))
    })
}
