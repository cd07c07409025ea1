//! `Allocate`'s answer from the informer's cache and one read by name, exactly the answer a
//! consistent LIST of the node's pods would give (docs/design/allocation-identity.md, step 7).
//!
//! Why it is exact. On a kubelet from 1.34 on, pod-resources `List` shows only active pods, and
//! every active pod but the one under admission has its devices recorded (facts F1, F5). With
//! pod-resources a pod is a candidate only if it is listed (step 4 of the design), so:
//! 1. *Every listing that may be the pod under admission is read by name.* A listing is taken
//!    from the cache only when a cached object of that name, not finished, deleting or
//!    allocating, reports the same containers, at least one of them a GPU container, and
//!    devices in exactly its GPU containers. The pod under admission never shows that: the
//!    container being allocated has no devices yet, and if it is a regular init container
//!    (never reported) neither have the pod's reported GPU containers, which come after it; a
//!    pod with no reported GPU container is always read. So it is never taken from the cache,
//!    even when the cache still holds a predecessor of the same name (a StatefulSet's
//!    replacement) or an older state of its own run. Every other listing (not cached,
//!    allocating, anything else) is read, all at once: the candidates, the continuing pod among
//!    them, are then the API server's current objects. A pod this plugin served in full is
//!    explained while the cache still shows it `allocating` (its record follows the answer).
//!    One exception: a listing without devices whose cached object has no GPU container at all
//!    (a DaemonSet's pod, a plain workload) is read only if the call is not decided without it.
//!    It can be the pod under admission only behind a cached predecessor of its name; the pod
//!    under admission is then the only listed pod missing devices (F1, F5), so no read listing
//!    is a candidate, the cache decides nothing, and the call goes to a LIST.
//! 2. *The chosen pod is read.* A candidate is pending: allocating (read in step 1) or served
//!    and possibly asked for again (ruled out by step 3). Should a choice still come from the
//!    cache, it is read and must have the same UID and give the same choice (defence in depth).
//! 3. *Re-asks are ruled out.* A kubelet that restarted may ask again for pods the plugin
//!    served; which pod it means is decided on a LIST until a LIST showed none left
//!    ([`Ledger::reasks_ruled_out`]).
//!
//! Anything else (an older kubelet, no pod-resources answer, HAMi's node lock, more listings to
//! read than [`MAX_READS`], a read that fails, a choice not confirmed, a re-ask, a choice the
//! selection could not make) is [`NotFromCache`]: the caller decides on a LIST. Calls that must
//! reuse an init container's devices (`must_include`) are not asked here.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;

use hami_contract::annotations as keys;

use crate::identity::{
    BookingPolicy, CallFacts, Choice, ChoiceReason, IdentityError, Ledger, PodRejection,
    PodResourcesView, PodSnapshot, pending_pods_checked, select,
};

/// Listings read by name before a LIST is cheaper: the pod under admission and two pods whose
/// `success` the cache has not seen yet.
pub const MAX_READS: usize = 3;

/// Reads one pod from the API server (a read issued after the call began).
pub trait PodReader {
    type Error: std::error::Error + Send + Sync + 'static;
    /// Pod `namespace/name` as the API server has it now; `None`: there is none.
    fn read(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<PodSnapshot>, Self::Error>> + Send;
}

/// What the call knows besides the pods.
#[derive(Debug, Clone, Copy)]
pub struct CacheCall<'a> {
    pub node: &'a str,
    pub policy: &'a BookingPolicy,
    /// The call's device count.
    pub count: usize,
    /// `namespace/name` named by a live HAMi node lock.
    pub hami_lock: Option<&'a str>,
    /// The pod-resources `List` taken during the call.
    pub pod_resources: Option<&'a PodResourcesView>,
    /// The node's `status.nodeInfo.kubeletVersion`.
    pub kubelet_version: Option<&'a str>,
}

/// Why the cache cannot answer this call: the caller decides on a LIST.
#[derive(Debug, thiserror::Error)]
pub enum NotFromCache {
    #[error("the kubelet's pod-resources List did not answer")]
    NoPodResources,
    #[error(
        "kubelet {0:?} may list pods it rejected (pod-resources shows only active pods from 1.34)"
    )]
    KubeletBefore134(Option<String>),
    #[error("HAMi's node lock names a pod")]
    HamiLock,
    #[error("the kubelet may ask again for pods it was served before it restarted")]
    ReasksPossible,
    #[error("{0} pods the kubelet lists would have to be read")]
    Unexplained(usize),
    #[error("cannot read pod {pod}")]
    Read {
        pod: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("on the cache: {0}")]
    Undecided(#[source] IdentityError),
    #[error(
        "no pod the kubelet lists with a GPU container could be meant, and {0} listings the cache shows without one were not read"
    )]
    GpuLessUnread(usize),
    #[error("chosen as {0}, which only a LIST decides")]
    Reason(&'static str),
    #[error("pod {0} is not what the cache showed")]
    NotConfirmed(String),
}

/// The answer and what it was decided on.
#[derive(Debug)]
pub struct FromCache {
    pub choice: Choice,
    /// The cache, with the pods read by name in place of their cached objects.
    pub pods: Vec<PodSnapshot>,
    /// Bookings the policy refused (the caller logs them).
    pub rejected: Vec<PodRejection>,
}

/// Whether this kubelet's pod-resources `List` shows only active pods (1.34 and later):
/// `v1.34.4`, `v1.35.0-rc.1`, `v1.34.2-gke.100` do; `v1.33.5` and anything unreadable do not.
pub fn lists_only_active_pods(kubelet_version: &str) -> bool {
    let mut parts = kubelet_version.trim_start_matches('v').split('.');
    let number = |p: Option<&str>| -> Option<u32> {
        let digits: String = p?.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    match (number(parts.next()), number(parts.next())) {
        (Some(major), Some(minor)) => (major, minor) >= (1, 34),
        _ => false,
    }
}

/// The keys (`namespace/name`) of listed pods the cache cannot answer for (module docs,
/// step 1), in the listing's order.
pub fn unexplained_listings(
    view: &PodResourcesView,
    pods: &[PodSnapshot],
    ledger: &Ledger,
) -> Vec<String> {
    view.pods
        .iter()
        .filter(|(key, listed)| {
            !pods
                .iter()
                .any(|p| p.key() == **key && explains(p, listed, ledger))
        })
        .map(|(key, _)| key.clone())
        .collect()
}

/// Listing `key` is read only when the others do not decide the call: its cached object is live
/// and has no container (init or app) that requests the resource, and the kubelet recorded no
/// device for it. Such a listing is the pod under admission only if the cache holds a
/// predecessor of its name; then no other listing can be a candidate (the pod under admission is
/// the only listed pod still missing devices, F1, F5), the cache cannot decide, and the call
/// goes to a LIST. So a node's GPU-less pods (DaemonSets, the plugin itself, plain workloads)
/// cost no read per call.
fn gpu_less(view: &PodResourcesView, pods: &[PodSnapshot], key: &str) -> bool {
    view.pods
        .get(key)
        .is_some_and(|listed| listed.values().all(Vec::is_empty))
        && pods
            .iter()
            .any(|p| p.key() == key && !p.terminal && !p.deleting && p.gpu_containers().is_empty())
}

/// Cached `pod` accounts for the listing `listed` (container → device IDs) of its name: it is
/// live and served, and the kubelet recorded devices in exactly its GPU containers. Served:
/// the cache shows it past `allocating`, or this plugin served every one of its entries (the
/// ledger is ahead of the cache by the plugin's own record, which lands after the answer).
fn explains(pod: &PodSnapshot, listed: &BTreeMap<String, Vec<String>>, ledger: &Ledger) -> bool {
    let allocating = pod.annotation(keys::BIND_PHASE) == Some(keys::BIND_PHASE_ALLOCATING);
    if pod.terminal || pod.deleting || (allocating && !ledger.served_all(pod)) {
        return false;
    }
    // Pod-resources reports app and restartable init containers, never regular init ones.
    let reported: Vec<_> = pod
        .init_containers
        .iter()
        .filter(|c| c.restartable_init)
        .chain(pod.containers.iter())
        .collect();
    reported.len() == listed.len()
        && reported.iter().any(|c| c.requests_resource)
        && reported.iter().all(|c| {
            listed
                .get(&c.name)
                .is_some_and(|ids| ids.is_empty() != c.requests_resource)
        })
}

/// The choice on `pods`, as `Allocate` makes it.
fn decide(
    call: &CacheCall<'_>,
    ledger: &Ledger,
    pods: &[PodSnapshot],
) -> (Result<Choice, IdentityError>, Vec<PodRejection>) {
    let (pending, rejected) = pending_pods_checked(call.node, call.policy, pods, ledger);
    let facts = CallFacts {
        count: call.count,
        must_include: false,
        hami_lock: call.hami_lock,
        pod_resources: call.pod_resources,
    };
    (select(facts, &pending, ledger), rejected)
}

async fn read<R: PodReader>(reader: &R, key: &str) -> Result<Option<PodSnapshot>, NotFromCache> {
    let (namespace, name) = key.split_once('/').unwrap_or(("", key));
    reader
        .read(namespace, name)
        .await
        .map_err(|e| NotFromCache::Read {
            pod: key.to_owned(),
            source: Box::new(e),
        })
}

/// Decides a call (no `must_include`) on the cache `pods`, reading by name what the module docs
/// say; [`NotFromCache`] when only a LIST may decide.
pub async fn choose_from_cache<R: PodReader>(
    call: CacheCall<'_>,
    ledger: &Ledger,
    mut pods: Vec<PodSnapshot>,
    reader: &R,
) -> Result<FromCache, NotFromCache> {
    let view = call.pod_resources.ok_or(NotFromCache::NoPodResources)?;
    if !call.kubelet_version.is_some_and(lists_only_active_pods) {
        return Err(NotFromCache::KubeletBefore134(
            call.kubelet_version.map(str::to_owned),
        ));
    }
    if call.hami_lock.is_some() {
        return Err(NotFromCache::HamiLock);
    }
    if !ledger.reasks_ruled_out() {
        return Err(NotFromCache::ReasksPossible);
    }
    let (unread, to_read): (Vec<String>, Vec<String>) = unexplained_listings(view, &pods, ledger)
        .into_iter()
        .partition(|key| gpu_less(view, &pods, key));
    if to_read.len() > MAX_READS {
        return Err(NotFromCache::Unexplained(to_read.len()));
    }
    // Concurrently: the call waits for the slowest read, not for their sum.
    let current = futures::future::join_all(to_read.iter().map(|key| read(reader, key))).await;
    let mut read_now = BTreeSet::new();
    for (key, current) in to_read.iter().zip(current) {
        let current = current?;
        pods.retain(|p| p.key() != *key);
        if let Some(p) = current {
            read_now.insert(p.uid.clone());
            pods.push(p);
        }
    }
    let (first, _) = decide(&call, ledger, &pods);
    let first = first.map_err(|why| match unread.len() {
        0 => NotFromCache::Undecided(why),
        n => NotFromCache::GpuLessUnread(n),
    })?;
    match first.reason {
        ChoiceReason::Continuing
        | ChoiceReason::Elimination
        | ChoiceReason::Unique
        | ChoiceReason::OldestOfClass => {}
        other => return Err(NotFromCache::Reason(other.as_str())),
    }
    let key = format!("{}/{}", first.namespace, first.name);
    if !read_now.contains(&first.uid) {
        let Some(current) = read(reader, &key).await?.filter(|p| p.uid == first.uid) else {
            return Err(NotFromCache::NotConfirmed(key));
        };
        pods.retain(|p| p.uid != first.uid);
        pods.push(current);
    }
    let (again, rejected) = decide(&call, ledger, &pods);
    match again {
        Ok(choice) if choice == first => Ok(FromCache {
            choice,
            pods,
            rejected,
        }),
        _ => Err(NotFromCache::NotConfirmed(key)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ContainerSpec;

    fn pod(name: &str, phase: &str, containers: &[(&str, bool)]) -> PodSnapshot {
        PodSnapshot {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            node_name: Some("node-a".into()),
            scheduler_name: None,
            annotations: BTreeMap::from([(keys::BIND_PHASE.to_owned(), phase.to_owned())]),
            terminal: false,
            deleting: false,
            init_containers: Vec::new(),
            containers: containers
                .iter()
                .map(|(name, gpu)| ContainerSpec {
                    name: (*name).into(),
                    requests_resource: *gpu,
                    restartable_init: false,
                    disable_control: false,
                })
                .collect(),
            started_containers: BTreeSet::new(),
            container_ids: BTreeMap::new(),
            resource_version: String::new(),
        }
    }

    /// `(namespace/name, [(container, device IDs)])` per listed pod.
    type Listing<'a> = (&'a str, &'a [(&'a str, &'a [&'a str])]);

    fn view(listed: &[Listing<'_>]) -> PodResourcesView {
        PodResourcesView {
            pods: listed
                .iter()
                .map(|(key, containers)| {
                    let containers = containers
                        .iter()
                        .map(|(c, ids)| {
                            (
                                (*c).to_owned(),
                                ids.iter().map(|i| (*i).to_owned()).collect(),
                            )
                        })
                        .collect();
                    ((*key).to_owned(), containers)
                })
                .collect(),
        }
    }

    #[test]
    fn only_kubelets_from_134_list_only_active_pods() {
        for v in [
            "v1.34.0",
            "v1.34.4",
            "v1.35.0-rc.1",
            "1.34.2-gke.100",
            "v2.0.0",
        ] {
            assert!(lists_only_active_pods(v), "{v}");
        }
        for v in ["v1.33.5", "v1.9.0", "", "v1", "vX.Y", "v1.3x"] {
            assert!(!lists_only_active_pods(v), "{v}");
        }
    }

    /// Issue 29: a pod this plugin served in full is explained while the cache still shows it
    /// `allocating` (the plugin's record lands after the answer), but not in the middle of its
    /// run, and never when the listing shows a GPU container without devices.
    #[test]
    fn a_pod_the_ledger_served_in_full_needs_no_read() {
        let served = pod("served", keys::BIND_PHASE_ALLOCATING, &[("main", true)]);
        let pair = pod(
            "pair",
            keys::BIND_PHASE_ALLOCATING,
            &[("a", true), ("b", true)],
        );
        let mut ledger = Ledger::default();
        ledger.record_served(&served.uid, 0, None);
        ledger.record_served(&pair.uid, 0, Some(1));
        let cache = [served.clone(), pair.clone()];
        let listed = view(&[
            ("default/served", &[("main", &["GPU-a-0"])]),
            ("default/pair", &[("a", &["GPU-a-1"]), ("b", &[])]),
        ]);
        assert_eq!(
            unexplained_listings(&listed, &cache, &ledger),
            ["default/pair"]
        );
        assert_eq!(
            unexplained_listings(&listed, &cache, &Ledger::default()),
            ["default/pair", "default/served"],
            "without the ledger's record both are read"
        );
        ledger.record_served(&pair.uid, 1, None);
        let listed_done = view(&[("default/pair", &[("a", &["GPU-a-1"]), ("b", &["GPU-a-2"])])]);
        assert!(unexplained_listings(&listed_done, &cache, &ledger).is_empty());
        let under_admission = view(&[("default/served", &[("main", &[])])]);
        assert_eq!(
            unexplained_listings(&under_admission, &cache, &ledger),
            ["default/served"],
            "a listing without devices is the pod under admission (a successor): always read"
        );
    }

    /// A listing is taken from the cache only for a live, served cached pod whose reported
    /// containers carry the same names and devices in exactly its GPU containers; anything else
    /// (not cached, allocating, finished, deleting, other containers, a GPU container without
    /// devices as the pod under admission shows, devices where the cache has no GPU container, a
    /// pod without reported GPU containers) is read by name.
    #[test]
    fn listings_the_cache_cannot_explain_are_read() {
        let allocating = pod("allocating", keys::BIND_PHASE_ALLOCATING, &[("main", true)]);
        let done = pod(
            "done",
            keys::BIND_PHASE_SUCCESS,
            &[("main", true), ("log", false)],
        );
        let mut finished = pod("finished", keys::BIND_PHASE_SUCCESS, &[("main", true)]);
        finished.terminal = true;
        let mut deleting = pod("deleting", keys::BIND_PHASE_ALLOCATING, &[("main", true)]);
        deleting.deleting = true;
        let renamed = pod("renamed", keys::BIND_PHASE_SUCCESS, &[("main", true)]);
        let bare = pod("bare", keys::BIND_PHASE_SUCCESS, &[("main", true)]);
        let init_only = pod("init-only", keys::BIND_PHASE_SUCCESS, &[("main", false)]);
        let moved = pod(
            "moved",
            keys::BIND_PHASE_SUCCESS,
            &[("main", true), ("log", false)],
        );
        let cache = [
            allocating, done, finished, deleting, renamed, bare, init_only, moved,
        ];
        let listed = view(&[
            ("default/allocating", &[("main", &[])]),
            ("default/done", &[("main", &["GPU-a-0"]), ("log", &[])]),
            ("default/finished", &[("main", &["GPU-a-1"])]),
            ("default/deleting", &[("main", &[])]),
            ("default/renamed", &[("other", &["GPU-a-2"])]),
            ("default/bare", &[("main", &[])]),
            ("default/new", &[("main", &[])]),
            ("default/init-only", &[("main", &[])]),
            (
                "default/moved",
                &[("main", &["GPU-a-3"]), ("log", &["GPU-a-4"])],
            ),
        ]);
        assert_eq!(
            unexplained_listings(&listed, &cache, &Ledger::default()),
            [
                "default/allocating",
                "default/bare",
                "default/deleting",
                "default/finished",
                "default/init-only",
                "default/moved",
                "default/new",
                "default/renamed"
            ]
        );
    }
}
