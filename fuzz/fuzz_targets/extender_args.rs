//! The extender's request decoders (`ExtenderArgs::decode` for `/filter`,
//! `ExtenderBindingArgs::decode` for `/bind`) on any body, and the `Nodes` form's pure filter
//! (node objects given in the request, no cluster state): an error or a verdict, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide;
use tessera_scheduler_core::extender::{ExtenderArgs, ExtenderBindingArgs};

fuzz_target!(|data: &[u8]| {
    if let Err(e) = ExtenderBindingArgs::decode(data) {
        assert!(!e.to_string().is_empty());
    }
    let args = match ExtenderArgs::decode(data) {
        Ok(a) => a,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let (Some(pod), Some(nodes)) = (args.pod, args.nodes) else {
        return;
    };
    let nodes: Vec<_> = nodes.into_iter().map(|(node, _)| node).collect();
    let _ = decide::filter_given_nodes(&DecisionConfig::default(), &pod, &nodes);
});
