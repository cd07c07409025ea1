//! Request resolution and the webhook mutation (contract §1.2, §1.3, §7) from arbitrary
//! resource quantities: never panic, and the resolved request keeps HAMi's invariants.
#![no_main]

use hami_contract::config::NvidiaConfig;
use hami_contract::quantity;
use hami_contract::request::{
    ContainerResources, resolve_container, resolve_pod, webhook_mutation,
};
use hami_contract::resources::MEM_PERCENTAGE_UNSET;
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 5] = [
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "nvidia.com/priority",
];

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let mut c = ContainerResources {
        name: "fuzz".into(),
        ..Default::default()
    };
    // Line i is the quantity of resource i; bit i of `flags` puts it in limits, else requests;
    // an empty line leaves the resource out.
    for (i, value) in text.split('\n').take(NAMES.len()).enumerate() {
        let _ = quantity::parse(value);
        if value.is_empty() {
            continue;
        }
        let into = if flags & (1 << i) != 0 {
            &mut c.limits
        } else {
            &mut c.requests
        };
        into.insert(NAMES[i].to_owned(), value.to_owned());
    }
    let cfg = NvidiaConfig {
        memory_factor: u32::from(flags >> 5),
        default_memory: if flags & 0x80 != 0 { 1024 } else { 0 },
        overwrite_env: flags & 0x20 != 0,
        ..Default::default()
    };
    let r = resolve_container(&c, &cfg);
    if let Some(req) = &r.request {
        assert!(req.nums >= 1);
        assert!((1..=MEM_PERCENTAGE_UNSET).contains(&req.mem_percentage_req));
        assert!(req.memreq > 0 || req.mem_percentage_req != MEM_PERCENTAGE_UNSET);
        assert!(req.memreq <= i32::MAX as u32 && req.coresreq <= i32::MAX as u32);
        let _ = req.memory_on(u32::MAX);
        let _ = req.memory_on(0);
    }
    for w in &r.warnings {
        assert!(!w.to_string().is_empty());
    }
    if let Ok(m) = webhook_mutation(&c, &cfg) {
        // After the mutation, a container with resources resolves to a request unless its count
        // is unusable.
        let _ = m.has_resource;
    }
    let pod = resolve_pod(std::slice::from_ref(&c), &[c.clone(), c.clone()], &cfg);
    let quota = pod.quota_request();
    if let Some(req) = &r.request {
        // Two app copies sum; the init copy is a max: the app sum dominates.
        assert_eq!(
            quota.memory,
            2 * u64::from(req.memreq) * u64::from(req.nums)
        );
    }
});
