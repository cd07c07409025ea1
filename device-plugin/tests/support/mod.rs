//! The fake kubelet lives in `test-support/kubelet-harness`; until that crate is a workspace
//! member (and a dev-dependency here), its source is included as a module.

#[path = "../../../test-support/kubelet-harness/src/lib.rs"]
pub mod kubelet_harness;
