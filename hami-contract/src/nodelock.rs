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
    /// Parses a lock value. The first `,` ends the time; the rest is `namespace,name` (a pod name
    /// cannot contain `,`, so the last `,` separates them). Returns `None` for a value with a
    /// time and only one more field, or an empty time.
    pub fn parse(value: &str) -> Option<Self> {
        match value.split_once(NODE_LOCK_SEPARATOR) {
            None => (!value.is_empty()).then(|| NodeLock {
                time: value.to_owned(),
                holder: None,
            }),
            Some((time, rest)) => {
                let (ns, name) = rest.rsplit_once(NODE_LOCK_SEPARATOR)?;
                (!time.is_empty()).then(|| NodeLock {
                    time: time.to_owned(),
                    holder: Some((ns.to_owned(), name.to_owned())),
                })
            }
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

/// HAMi's release rule: a pod may release the lock only if the value ends with `,<ns>,<name>`.
pub fn is_held_by(value: &str, namespace: &str, name: &str) -> bool {
    value.ends_with(&format!(
        "{NODE_LOCK_SEPARATOR}{namespace}{NODE_LOCK_SEPARATOR}{name}"
    ))
}
