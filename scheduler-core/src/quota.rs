//! A namespace's GPU ResourceQuotas: the limits one object sets, and the tightest of them across
//! the namespace (HAMi #2997). The filter's budget ([`crate::state::ClusterState::quota_budget`])
//! and the webhook's pre-check ([`crate::facts::ClusterFacts::namespace_limits`]) both read them
//! through [`Quotas::namespace_limits`].

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceQuota;

/// GPU limits of one ResourceQuota object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaRecord {
    pub namespace: String,
    pub name: String,
    /// MiB, already × `memoryFactor`.
    pub mem_limit: Option<u64>,
    pub cores_limit: Option<u64>,
    pub count_limit: Option<u64>,
}

/// The resource names and factor the quota keys depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaKeys {
    pub memory: String,
    pub cores: String,
    pub count: Vec<String>,
    pub memory_factor: u32,
}

impl QuotaKeys {
    pub fn new(names: &hami_contract::ResourceNames, memory_factor: u32) -> Self {
        let (memory, cores) = names.quota_keys();
        QuotaKeys {
            memory,
            cores,
            count: vec![
                format!("limits.{}", names.count),
                format!("requests.{}", names.count),
                names.count.clone(),
            ],
            memory_factor: memory_factor.max(1),
        }
    }
}

fn quantity_value(text: &str) -> Option<u64> {
    let q = hami_contract::quantity::parse(text).ok()?;
    u64::try_from(q.ceil().max(0)).ok()
}

impl QuotaRecord {
    /// `None` when the object names no GPU key.
    pub fn from_quota(q: &ResourceQuota, keys: &QuotaKeys) -> Option<Self> {
        let hard = q.spec.as_ref()?.hard.as_ref()?;
        let get = |k: &str| hard.get(k).and_then(|v| quantity_value(&v.0));
        let mem_limit = get(&keys.memory).map(|m| m.saturating_mul(u64::from(keys.memory_factor)));
        let cores_limit = get(&keys.cores);
        let count_limit = keys.count.iter().filter_map(|k| get(k)).min();
        if mem_limit.is_none() && cores_limit.is_none() && count_limit.is_none() {
            return None;
        }
        Some(QuotaRecord {
            namespace: q.metadata.namespace.clone().unwrap_or_default(),
            name: q.metadata.name.clone().unwrap_or_default(),
            mem_limit,
            cores_limit,
            count_limit,
        })
    }
}

/// One GPU limit of a namespace: the smallest across its ResourceQuotas, and which one sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit<'a> {
    pub value: u64,
    /// Name of the quota that sets it (the first by name among equal limits).
    pub quota: &'a str,
}

/// The GPU limits of a namespace (`None`: no quota limits that resource).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NamespaceLimits<'a> {
    /// MiB, already × `memoryFactor` (as requests are).
    pub mem: Option<Limit<'a>>,
    pub cores: Option<Limit<'a>>,
    pub count: Option<Limit<'a>>,
}

impl NamespaceLimits<'_> {
    pub fn is_empty(&self) -> bool {
        self.mem.is_none() && self.cores.is_none() && self.count.is_none()
    }
}

/// The GPU ResourceQuotas known, by `(namespace, name)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quotas {
    by_key: BTreeMap<(String, String), QuotaRecord>,
}

impl Quotas {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records quota `namespace/name`; `None` (it names no GPU key) forgets it.
    pub fn upsert(&mut self, namespace: &str, name: &str, rec: Option<QuotaRecord>) {
        let key = (namespace.to_owned(), name.to_owned());
        match rec {
            Some(r) => {
                self.by_key.insert(key, r);
            }
            None => {
                self.by_key.remove(&key);
            }
        }
    }

    pub fn remove(&mut self, namespace: &str, name: &str) {
        self.by_key.remove(&(namespace.to_owned(), name.to_owned()));
    }

    /// Replaces every quota (a watcher's complete List).
    pub fn replace(&mut self, recs: impl IntoIterator<Item = QuotaRecord>) {
        self.by_key.clear();
        for r in recs {
            self.by_key.insert((r.namespace.clone(), r.name.clone()), r);
        }
    }

    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    /// Every quota, by namespace then name.
    pub fn iter(&self) -> impl Iterator<Item = &QuotaRecord> {
        self.by_key.values()
    }

    /// Every quota's `(namespace, name)`.
    pub fn keys(&self) -> impl Iterator<Item = &(String, String)> {
        self.by_key.keys()
    }

    /// The namespace's GPU limits: per resource, the minimum across its quotas.
    pub fn namespace_limits(&self, namespace: &str) -> NamespaceLimits<'_> {
        fn tighten<'a>(current: &mut Option<Limit<'a>>, value: Option<u64>, quota: &'a str) {
            if let Some(v) = value
                && current.is_none_or(|c| v < c.value)
            {
                *current = Some(Limit { value: v, quota });
            }
        }
        let mut out = NamespaceLimits::default();
        // Keys sort by namespace first: the namespace's quotas are one range.
        let from = (namespace.to_owned(), String::new());
        for ((ns, name), q) in self.by_key.range(from..) {
            if ns != namespace {
                break;
            }
            tighten(&mut out.mem, q.mem_limit, name);
            tighten(&mut out.cores, q.cores_limit, name);
            tighten(&mut out.count, q.count_limit, name);
        }
        out
    }
}
