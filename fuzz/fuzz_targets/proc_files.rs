//! The `/proc/<pid>` texts the device plugin's unaccounted-process watch reads about processes a
//! container controls (its cgroup path, through the names a runtime gives; its status), and the
//! node's NVIDIA runtime configuration: any bytes give a defined answer, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_node_core::nvidia_runtime::RuntimeConfig;
use tessera_node_core::pod_cgroup::{CgroupOwner, ns_pid_from_status, owner_from_proc_cgroup};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match owner_from_proc_cgroup(&text) {
        CgroupOwner::Pod(pod) => assert!(!pod.pod_uid.is_empty()),
        CgroupOwner::Container { container_id, .. } => assert_eq!(container_id.len(), 64),
        CgroupOwner::Host { .. } => {}
    }
    if let Some(pid) = ns_pid_from_status(&text) {
        assert!(pid > 0);
    }
    let _ = RuntimeConfig::parse(&text);
});
