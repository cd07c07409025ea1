//! The extender's request decoders (`ExtenderArgs::decode` for `/filter`,
//! `ExtenderBindingArgs::decode` for `/bind`) on any body, and the `Nodes` form's pure filter
//! (node objects given in the request, no cluster state): an error or a verdict, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_scheduler::decide::{self, DecisionConfig};
use tessera_scheduler::extender::{ExtenderArgs, ExtenderBindingArgs};
use tessera_scheduler::state::{ClusterState, NodeRecord};

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
    let cfg = DecisionConfig::default();
    let mut state = ClusterState::new();
    let mut names = Vec::new();
    for (node, _) in &nodes {
        if let Some(rec) = NodeRecord::from_node(node, &cfg) {
            names.push(rec.name.clone());
            state.upsert_node(rec);
        }
    }
    let _ = decide::filter_pod(&mut state, &cfg, &pod, "fuzz-uid", &names);
});
