//! The extender's request decoders (`ExtenderArgs::decode` for `/filter`,
//! `ExtenderBindingArgs::decode` for `/bind`, `ExtenderPreemptionArgs::decode` for `/preempt`) on
//! any body, the `Nodes` form's pure filter (node objects given in the request, no cluster
//! state) and the preemption verb over a small cluster: an error or an answer, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide;
use tessera_scheduler_core::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs, ExtenderPreemptionResult,
};
use tessera_scheduler_core::fixtures::{cluster_state, gpu_node, running_pod};
use tessera_scheduler_core::preempt;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = ExtenderBindingArgs::decode(data) {
        assert!(!e.to_string().is_empty());
    }
    match ExtenderPreemptionArgs::decode(data) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(args) => {
            // Two nodes the proposal may name, with one tenant of priority 0 each.
            let mut state = cluster_state(
                &[gpu_node("n0", 2, 16384, 4), gpu_node("n1", 1, 8192, 1)],
                &[
                    running_pod("ns", "a", "n0", "GPU-n0-0,NVIDIA,8192,50:;"),
                    running_pod("ns", "b", "n1", "GPU-n1-0,NVIDIA,8192,100:;"),
                ],
            );
            let uid = args.pod.metadata.uid.clone().unwrap_or_default();
            let (chosen, refused) = preempt::preempt(
                &mut state,
                &DecisionConfig::default(),
                &args.pod,
                &uid,
                &args.victims,
                &[],
            );
            assert!(chosen.values().all(|v| !v.pods.is_empty()));
            let _ = preempt::describe(&chosen, &refused);
            let _ = ExtenderPreemptionResult::from_victims(&chosen).to_json();
        }
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
