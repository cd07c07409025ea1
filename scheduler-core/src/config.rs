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
}
