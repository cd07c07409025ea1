//! `device-config.yaml` (contract §1.4): never panics; errors always carry a message.
#![no_main]

use hami_contract::config::DeviceConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match DeviceConfig::from_yaml(&text) {
        Ok(cfg) => {
            assert!(cfg.nvidia.device_memory_scaling > 0.0 && cfg.nvidia.device_core_scaling > 0.0);
            let _ = cfg.nvidia.effective_memory_factor();
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
