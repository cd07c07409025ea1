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
}
