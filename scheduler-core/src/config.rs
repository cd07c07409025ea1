//! What every decision is configured with: the daemon's flags and device config as the filter,
//! the cluster state's node reading and `simulate` all need them.

use hami_contract::NvidiaConfig;

use crate::podspec::PolicyDefaults;

/// Configuration every decision needs.
#[derive(Debug, Clone, Default)]
pub struct DecisionConfig {
    pub nvidia: NvidiaConfig,
    pub defaults: PolicyDefaults,
    /// HAMi `--node-label-selector`: only nodes with all these labels take GPU pods.
    pub node_selector: Vec<(String, String)>,
    /// Threads evaluating candidates of one filter (`--filter-threads`); 0 or 1 = sequential.
    pub filter_threads: usize,
    /// Whether a placed pod's verdict keeps every other candidate's reason (`simulate` and
    /// `kubectl tessera` show them). Off in the extender: kube-scheduler reads an extender's
    /// `FailedNodes` only when no node passes, so on a fitting pod they would be built, encoded
    /// and decoded for nothing (deviation L7).
    pub reasons_when_placed: bool,
    /// How decisions reach the API server (not part of the decision itself; it travels with
    /// the rest of the daemon's configuration to the handlers).
    pub writes: WriteOptions,
}

/// What the extender writes to the API server besides the Binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteOptions {
    /// HAMi's order: patch the decision (annotations and the `hami.io/vgpu-node` label) onto
    /// the pod in `/filter`, before kube-scheduler binds it (`--write-decision-at-filter`).
    /// Off: the decision travels only in the Binding, one write per placed pod.
    pub decision_at_filter: bool,
    /// HAMi's `FilteringSucceed` and `BindingSucceed` Events (`--pod-events all`); warnings
    /// (`FilteringFailed`, `BindingFailed`) are always written.
    pub success_events: bool,
}
