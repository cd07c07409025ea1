//! Tessera's control-plane daemon: a kube-scheduler extender (filter, bind), the admission
//! webhook, per-namespace GPU budgets and the offline `simulate` tool.
//!
//! Layout: pure logic in [`fit`] (placement rules), [`state`] (cluster model and reservation
//! overlay), [`decide`] (one filter decision) and [`simulate`]; the daemon's edges around them.

pub mod decide;
pub mod edge;
pub mod engine;
pub mod extender;
pub mod facts;
pub mod fit;
pub mod http;
pub mod kube_edge;
pub mod lease;
pub mod listen;
pub mod metrics;
pub mod podspec;
pub mod simulate;
pub mod state;
pub mod testing;
pub mod tls;
pub mod webhook;
