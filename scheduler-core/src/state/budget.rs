//! The quota view: each namespace's GPU ResourceQuotas and what its pods (and in-flight
//! decisions) already charge against them.

use super::*;

impl ClusterState {
    pub fn upsert_quota(&mut self, q: &ResourceQuota, keys: &QuotaKeys) {
        self.quotas.upsert(
            q.metadata.namespace.as_deref().unwrap_or_default(),
            q.metadata.name.as_deref().unwrap_or_default(),
            QuotaRecord::from_quota(q, keys),
        );
    }

    pub fn remove_quota(&mut self, namespace: &str, name: &str) {
        self.quotas.remove(namespace, name);
    }

    /// The namespace's budget: the minimum of every quota object's limits, and the usage of
    /// every pod and reservation of the namespace except `exclude`. `None` when unlimited.
    pub fn quota_budget(&self, namespace: &str, exclude: Option<&str>) -> Option<QuotaBudget> {
        let limits = self.quotas.namespace_limits(namespace);
        if limits.is_empty() {
            return None;
        }
        let used = self.namespace_usage(namespace, exclude);
        Some(QuotaBudget {
            mem_limit: limits.mem.map(|l| l.value),
            cores_limit: limits.cores.map(|l| l.value),
            count_limit: limits.count.map(|l| l.value),
            used_mem: used.mem,
            used_cores: used.cores,
            used_count: used.count,
        })
    }

    /// GPU usage charged to a namespace (placed pods plus in-flight reservations, each pod's
    /// reservation counted instead of its record, as [`Self::effective`] does), less that of
    /// `exclude`.
    pub fn namespace_usage(&self, namespace: &str, exclude: Option<&str>) -> Charge {
        let mut total = self.charged.get(namespace).copied().unwrap_or_default();
        for r in self
            .reservations
            .values()
            .filter(|r| r.namespace == namespace)
        {
            if let Some(own) = self.pods.get(r.uid.as_str()).and_then(PodEntry::charge) {
                total -= own;
            }
            total += usage_charge(&r.usage);
        }
        if let Some(uid) = exclude
            && let Some((_, usage)) = self.effective(uid)
            && self.namespace_of(uid) == Some(namespace)
        {
            total -= usage.charge();
        }
        total
    }

    /// The namespace of the pod or reservation `uid`.
    fn namespace_of(&self, uid: &str) -> Option<&str> {
        match self.reservations.get(uid) {
            Some(r) => Some(&r.namespace),
            None => self.pods.get(uid).map(|p| &*p.namespace),
        }
    }
}
