//! Fit and score: HAMi v2.10's placement rules as pure functions (contract §5.2–§5.5, §5.7).
//!
//! Nothing here does I/O or reads a clock. The decision loop, `simulate` and the benchmarks all
//! call [`evaluate_node`] and [`select_node`]; what differs between them is only where the
//! [`NodeState`]s and the [`QuotaBudget`] come from.
//!
//! The parts, in the order a decision uses them: [`input`] (what the pod asks for and how it wants
//! to be placed), [`capacity`] (a node's GPUs with their bookings, a namespace's quota budget),
//! [`score`] (HAMi's scores and device order), [`container`] (one container onto one node's
//! devices, with `topology` for the topology-aware choice), [`node`] (a whole pod onto a node,
//! and the choice among nodes), [`reason`] (why a pod does not fit, [`FitFailure`], whose
//! `Display` is HAMi's reason string), [`summary`] (a node reduced to what the common request's
//! checks read, for the filter's quick path).

pub mod capacity;
pub mod container;
pub mod input;
pub mod node;
pub mod reason;
pub mod score;
pub mod summary;
mod topology;

pub use capacity::{
    Charge, GpuState, MIG_MODE, MigGpu, NodeState, QuotaBudget, TopologyScores, book_pod,
    book_pod_mig, emptied, is_nvidia, nvidia_mask,
};
pub use container::{ContainerFit, MigPick, Pick};
pub use input::{
    GpuPolicyKey, GpuRequest, MEM_PERCENTAGE_UNSET, NodePolicyKey, PlacementOptions, PodAsk,
    Weights, gpu_request,
};
pub use node::{
    FilterOutcome, NodeFit, NodePicks, evaluate_node, evaluate_picks, filter, select_node,
};
pub use reason::{FitFailure, FitReason, ReasonCounts};
pub use score::{device_score, node_score};
pub use summary::{NodeSummary, QuickAsk};
