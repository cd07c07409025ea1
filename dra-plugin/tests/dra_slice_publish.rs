//! The DRA plugin's ResourceSlice publisher against a mock API server: the slice it creates, how
//! it notices an API server whose `DRAConsumableCapacity` gate is off (the sharing fields are
//! dropped on create) and republishes whole GPUs, and that an unchanged slice is not rewritten.

use http::Method;
use serde_json::{Value, json};
use tessera_dra_plugin::publish::{ConsumableMode, SlicePublisher};
use tessera_dra_plugin::slice::{GpuFacts, Sharing, slice_devices};
use tessera_node::testing::apiserver::{mock_client, ok};
use tessera_node::testing::t4;

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

fn devices_for(sharing: Sharing) -> Vec<k8s_openapi::api::resource::v1::Device> {
    let gpus: Vec<_> = (0..2)
        .map(|i| (t4(&format!("GPU-{i}"), i), GpuFacts::default()))
        .collect();
    slice_devices(&gpus, Some("550.54.15"), &|_| true, sharing).0
}

async fn body(req: http::Request<kube::client::Body>) -> Value {
    let bytes = req.into_body().collect_bytes().await.expect("body");
    serde_json::from_slice(&bytes).expect("json body")
}

fn list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
           "metadata": {"resourceVersion": "10"}, "items": items})
}

#[tokio::test]
async fn a_dropped_sharing_field_turns_the_slice_into_whole_gpus_and_an_unchanged_slice_is_left_alone()
 {
    let (client, mut api) = mock_client();
    let mut publisher = SlicePublisher::new(client, "node-a".into(), ConsumableMode::Auto);
    let test = tokio::spawn(async move {
        let wrote = publisher.sync(&devices_for).await.expect("sync");
        assert!(wrote);
        assert_eq!(publisher.sharing(), Sharing::Exclusive);
        // The API server now holds what the publisher wrote: nothing to do.
        let wrote = publisher.sync(&devices_for).await.expect("second sync");
        assert!(!wrote);
    });

    // 1. No slice yet: the node is read for its UID and the slice created, shareable.
    let (req, send) = api.expect(Method::GET, SLICES).await;
    let query = req.uri().query().unwrap_or_default().to_owned();
    assert!(
        query.contains("fieldSelector=spec.nodeName%3Dnode-a%2Cspec.driver%3Dgpu.tessera.dev"),
        "{query}"
    );
    send.send_response(ok(list(vec![])));
    let (_, send) = api.expect(Method::GET, "/api/v1/nodes/node-a").await;
    send.send_response(ok(json!({"apiVersion": "v1", "kind": "Node",
                                 "metadata": {"name": "node-a", "uid": "node-uid"}})));
    let (req, send) = api.expect(Method::POST, SLICES).await;
    let mut created = body(req).await;
    assert_eq!(
        created["metadata"]["generateName"],
        "node-a-gpu.tessera.dev-"
    );
    assert_eq!(created["metadata"]["ownerReferences"][0]["uid"], "node-uid");
    assert_eq!(created["spec"]["driver"], "gpu.tessera.dev");
    assert_eq!(created["spec"]["nodeName"], "node-a");
    assert_eq!(
        created["spec"]["pool"],
        json!({"name": "node-a", "generation": 1, "resourceSliceCount": 1})
    );
    let devices = created["spec"]["devices"].as_array().unwrap().clone();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0]["allowMultipleAllocations"], true);
    assert_eq!(devices[0]["capacity"]["memory"]["value"], "15360Mi");
    assert_eq!(
        devices[0]["attributes"]["driverVersion"]["version"],
        "550.54.15"
    );
    // An API server with the gate off keeps the slice but drops the sharing fields.
    created["metadata"]["name"] = json!("node-a-gpu.tessera.dev-x1");
    created["metadata"]["resourceVersion"] = json!("11");
    for d in created["spec"]["devices"].as_array_mut().unwrap() {
        d.as_object_mut()
            .unwrap()
            .remove("allowMultipleAllocations");
        for cap in d["capacity"].as_object_mut().unwrap().values_mut() {
            cap.as_object_mut().unwrap().remove("requestPolicy");
        }
    }
    send.send_response(ok(created.clone()));

    // 2. The publisher noticed and replaces the devices with whole GPUs, generation 2.
    let (_, send) = api.expect(Method::GET, SLICES).await;
    send.send_response(ok(list(vec![created.clone()])));
    let (req, send) = api
        .expect(Method::PUT, &format!("{SLICES}/node-a-gpu.tessera.dev-x1"))
        .await;
    let mut replaced = body(req).await;
    assert_eq!(replaced["spec"]["pool"]["generation"], 2);
    let devices = replaced["spec"]["devices"].as_array().unwrap();
    assert!(
        devices
            .iter()
            .all(|d| d.get("allowMultipleAllocations").is_none())
    );
    assert!(
        devices
            .iter()
            .all(|d| d["capacity"]["cores"].get("requestPolicy").is_none())
    );
    replaced["metadata"]["resourceVersion"] = json!("12");
    send.send_response(ok(replaced.clone()));

    // 3. The next pass finds the slice as written.
    let (_, send) = api.expect(Method::GET, SLICES).await;
    send.send_response(ok(list(vec![replaced])));
    test.await.expect("publisher task");
}
