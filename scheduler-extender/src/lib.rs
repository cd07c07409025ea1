//! Tessera's control-plane daemon: a kube-scheduler extender (filter, bind), the admission
//! webhook, per-namespace GPU budgets and the offline `simulate` tool.
//!
//! Layout: pure logic in [`fit`] (placement rules), [`state`] (cluster model and reservation
//! overlay), [`decide`] (one filter decision) and [`simulate`]; the daemon's edges around them.

pub mod decide;
pub mod fit;
pub mod podspec;
pub mod simulate;
pub mod state;
pub mod edge;
pub mod engine;
pub mod extender;
pub mod webhook;
pub mod http;
pub mod metrics;
pub mod testing;
pub mod kube_edge;
pub mod tls;
