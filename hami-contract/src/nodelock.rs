//! HAMi's node lock annotation `hami.io/mutex.lock` (contract §2.4).
//!
//! Tessera does not rely on the lock for allocation identity, but reads and writes it so that a
//! mixed HAMi / Tessera cluster agrees on who holds a node.

use std::fmt;

/// Separator of the lock value's fields (HAMi `NodeLockSep`).
pub const NODE_LOCK_SEPARATOR: char = ',';

/// A parsed `hami.io/mutex.lock` value: `<RFC3339 time>,<namespace>,<pod name>`, or the legacy
/// bare `<RFC3339 time>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeLock {
    /// The RFC 3339 time text as written (e.g. `2025-06-13T09:07:40+08:00`).
    pub time: String,
    /// The holder `(namespace, name)`; `None` for the legacy form.
    pub holder: Option<(String, String)>,
}

impl NodeLock {
    /// Parses a lock value by HAMi v2.10's rule (`ParseNodeLock`): a value without `,` is the
    /// legacy bare time; otherwise it must split on `,` into exactly three fields
    /// `time,namespace,name`. Anything else is malformed (`None`): `t,ns` and `t,ns,a,b` name
    /// nobody (a pod name cannot contain `,`, so such a value was not written by a scheduler). An
    /// empty time is malformed too. The time text is kept as written, not validated: callers
    /// that need the instant parse it as RFC 3339 (and treat a failure as malformed, as HAMi).
    pub fn parse(value: &str) -> Option<Self> {
        let mut fields = value.split(NODE_LOCK_SEPARATOR);
        let time = fields.next().filter(|t| !t.is_empty())?;
        match (fields.next(), fields.next(), fields.next()) {
            (None, _, _) => Some(NodeLock {
                time: time.to_owned(),
                holder: None,
            }),
            (Some(ns), Some(name), None) => Some(NodeLock {
                time: time.to_owned(),
                holder: Some((ns.to_owned(), name.to_owned())),
            }),
            _ => None,
        }
    }

    /// The value HAMi's scheduler writes when binding `namespace/name`.
    pub fn for_pod(rfc3339_time: &str, namespace: &str, name: &str) -> Self {
        NodeLock {
            time: rfc3339_time.to_owned(),
            holder: Some((namespace.to_owned(), name.to_owned())),
        }
    }

    /// The annotation value.
    pub fn encode(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for NodeLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.holder {
            Some((ns, name)) => write!(
                f,
                "{}{NODE_LOCK_SEPARATOR}{ns}{NODE_LOCK_SEPARATOR}{name}",
                self.time
            ),
            None => f.write_str(&self.time),
        }
    }
}

/// HAMi's release rule (`ReleaseNodeLock`): a pod may release the lock only if the value ends
/// with `,<ns>,<name>`. A plain suffix test, as HAMi's: it does not parse the value.
pub fn is_held_by(value: &str, namespace: &str, name: &str) -> bool {
    value.ends_with(&format!(
        "{NODE_LOCK_SEPARATOR}{namespace}{NODE_LOCK_SEPARATOR}{name}"
    ))
}

/// HAMi's lock expiry (`NodeLockTimeout`, 5 minutes unless `HAMI_NODELOCK_EXPIRE` says
/// otherwise): an older lock is taken over by the next bind.
pub const NODE_LOCK_EXPIRY_SECS: u64 = 300;

/// What binding `namespace/name` does with the node's current lock, by HAMi v2.10's `LockNode`
/// (`pkg/util/nodelock/nodelock.go`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireStep {
    /// No lock, or an expired one: write ours.
    Take,
    /// The lock already names this pod (a retried bind).
    Held,
    /// Another pod's live lock: it may be taken only if that pod no longer exists (HAMi reads
    /// the pod; not found ⇒ release and take).
    TakeIfGone { namespace: String, name: String },
    /// A live lock that names nobody (the legacy bare time, or empty fields): the node is busy.
    Busy,
}

/// [`AcquireStep`] for the node's lock value `current`; `age_secs` is how old its time is (`None`
/// when the time does not parse as RFC 3339).
///
/// One difference from HAMi: a value HAMi cannot parse (malformed fields, bad time) makes HAMi's
/// bind fail until someone removes the annotation; here it is taken over, since nothing that
/// could hold it can be named (deviation V5 of the device plugin reads it the same way).
pub fn acquire_step(
    current: Option<&str>,
    namespace: &str,
    name: &str,
    age_secs: Option<u64>,
) -> AcquireStep {
    let Some(value) = current else {
        return AcquireStep::Take;
    };
    let Some(lock) = NodeLock::parse(value) else {
        return AcquireStep::Take;
    };
    match age_secs {
        None => return AcquireStep::Take,
        Some(age) if age > NODE_LOCK_EXPIRY_SECS => return AcquireStep::Take,
        Some(_) => {}
    }
    match lock.holder {
        Some((ns, n)) if ns == namespace && n == name => AcquireStep::Held,
        Some((ns, n)) if !ns.is_empty() && !n.is_empty() => AcquireStep::TakeIfGone {
            namespace: ns,
            name: n,
        },
        _ => AcquireStep::Busy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_follows_hami_v2_10_field_count() {
        let lock =
            NodeLock::parse("2025-06-13T09:07:40+08:00,default,gpu-pod-1").expect("3 fields");
        assert_eq!(
            lock.holder,
            Some(("default".to_owned(), "gpu-pod-1".to_owned()))
        );
        // HAMi: "expected 3 parts" — neither `ns/a,b` nor `ns,a/b`: malformed, no holder at all.
        assert_eq!(NodeLock::parse("2025-06-13T09:07:40+08:00,ns,a,b"), None);
        assert_eq!(NodeLock::parse("2025-06-13T09:07:40+08:00,ns"), None);
        assert_eq!(NodeLock::parse("2025-06-13T09:07:40+08:00,"), None);
        assert_eq!(NodeLock::parse(",ns,name"), None);
        assert_eq!(NodeLock::parse(""), None);
        // Three fields with empty ones parse (HAMi returns empty strings); callers decide.
        assert_eq!(
            NodeLock::parse("t,,").map(|l| l.holder),
            Some(Some((String::new(), String::new())))
        );
        // Legacy bare time.
        assert_eq!(
            NodeLock::parse("2025-06-13T09:07:40+08:00").map(|l| l.holder),
            Some(None)
        );
    }

    #[test]
    fn release_rule_is_a_suffix_test_as_hami() {
        let v = "2025-06-13T09:07:40+08:00,ns,a,b";
        // HAMi's `ReleaseNodeLock` would release this malformed value for pod `a/b`.
        assert!(is_held_by(v, "a", "b"));
        assert!(!is_held_by(v, "ns", "a"));
        assert!(!is_held_by("2025-06-13T09:07:40+08:00", "ns", "a"));
    }

    #[test]
    fn acquiring_follows_hamis_lock_node() {
        let live = Some(10);
        assert_eq!(acquire_step(None, "ns", "p", None), AcquireStep::Take);
        assert_eq!(
            acquire_step(Some("t,ns,p"), "ns", "p", live),
            AcquireStep::Held
        );
        assert_eq!(
            acquire_step(Some("t,ns,other"), "ns", "p", live),
            AcquireStep::TakeIfGone {
                namespace: "ns".into(),
                name: "other".into()
            }
        );
        // Expired (HAMi: older than NodeLockTimeout) or unreadable: taken over.
        assert_eq!(
            acquire_step(Some("t,ns,other"), "ns", "p", Some(301)),
            AcquireStep::Take
        );
        assert_eq!(
            acquire_step(Some("t,ns,other"), "ns", "p", None),
            AcquireStep::Take
        );
        assert_eq!(
            acquire_step(Some("t,a,b,c"), "ns", "p", live),
            AcquireStep::Take
        );
        // A live lock naming nobody keeps the node busy, as in HAMi.
        assert_eq!(acquire_step(Some("t"), "ns", "p", live), AcquireStep::Busy);
        assert_eq!(
            acquire_step(Some("t,,"), "ns", "p", live),
            AcquireStep::Busy
        );
    }
}
