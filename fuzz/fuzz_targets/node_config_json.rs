//! `/config/config.json` (contract §1.5): never panics; a parsed entry merges over defaults.
#![no_main]

use hami_contract::config::{NodeConfigFile, NvidiaConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(file) = NodeConfigFile::from_json(&text) {
        let base = NvidiaConfig::default();
        for node in &file.nodeconfig {
            let merged = base.with_node_override(node);
            assert_eq!(merged.resources, base.resources);
            let _ = file.for_node(&node.name);
            let _ = node.filterdevices.hides("GPU-a", 0);
        }
        let _ = file.duplicate_names();
    }
});
