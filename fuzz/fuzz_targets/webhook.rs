//! The admission webhook (`tessera_scheduler_core::webhook::handle`, the pure function behind
//! `POST /webhook`): any body gets an answer, never a panic, and a denial never names the
//! cluster's nodes, GPU sizes or any quota (the caller may be anyone who reaches the port).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::facts::ClusterFacts;
use tessera_scheduler_core::fixtures::gpu_node;
use tessera_scheduler_core::quota::{QuotaKeys, QuotaRecord};
use tessera_scheduler_core::state::NodeRecord;
use tessera_scheduler_core::webhook::{WebhookConfig, handle};

/// Strings of the cluster that no denial may contain (unless the input itself does).
const SECRETS: [&str; 4] = ["secretnode", "secretquota", "81920", "123457"];

fn setup() -> &'static (WebhookConfig, ClusterFacts) {
    static S: OnceLock<(WebhookConfig, ClusterFacts)> = OnceLock::new();
    S.get_or_init(|| {
        let mut facts = ClusterFacts::new();
        let cfg = DecisionConfig::default();
        for n in [gpu_node("secretnode-a100", 8, 81920, 10), gpu_node("t4", 1, 15360, 4)] {
            if let Some(r) = NodeRecord::from_node(&n, &cfg) {
                facts.upsert_node(&r);
            }
        }
        let keys = QuotaKeys::new(&Default::default(), 1);
        for ns in ["default", "team-a"] {
            let q: Result<k8s_openapi::api::core::v1::ResourceQuota, _> =
                serde_json::from_value(serde_json::json!({
                    "metadata": {"namespace": ns, "name": "secretquota"},
                    "spec": {"hard": {"limits.nvidia.com/gpumem": "123457", "limits.nvidia.com/gpu": "2"}}
                }));
            if let Some(r) = q.ok().and_then(|q| QuotaRecord::from_quota(&q, &keys)) {
                facts.upsert_quota(ns, "secretquota", Some(r));
            }
        }
        let wh = WebhookConfig {
            scheduler_name: "hami-scheduler".into(),
            force_overwrite_default_scheduler: true,
            trusted_users: ["system:serviceaccount:gpu:tessera-scheduler".to_owned()]
                .into_iter()
                .collect(),
            allow_control_env_namespaces: ["ml-admin".to_owned()].into_iter().collect(),
            ..Default::default()
        };
        (wh, facts)
    })
}

fuzz_target!(|data: &[u8]| {
    let (cfg, facts) = setup();
    let a = handle(data, cfg, facts);
    assert!(a.status == 200 || a.status == 400, "status {}", a.status);
    if a.status == 200 && a.body["response"]["allowed"] == false {
        let m = a.body["response"]["status"]["message"]
            .as_str()
            .unwrap_or("");
        assert!(!m.is_empty());
        let input = String::from_utf8_lossy(data);
        for s in SECRETS {
            assert!(input.contains(s) || !m.contains(s), "{s} leaked: {m}");
        }
    }
});
