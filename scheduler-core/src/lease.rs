//! Leader election as a pure decision: given the extender's own Lease, the Lease it follows
//! (kube-scheduler's, `--follow-lease`), the time and who we are, what to do next. The I/O (read
//! both Leases, write ours) lives in the daemon's `kube_edge::run_leader_election`.
//!
//! Why a followed Lease: in the chart each scheduler pod runs a stock kube-scheduler next to the
//! extender, and kube-scheduler only ever calls the extender of its own pod (127.0.0.1). Both
//! elect separately, so with two replicas the kube-scheduler leader and the extender leader can
//! sit in different pods; the leading kube-scheduler then only reaches a standby extender, which
//! refuses every filter and bind, and nothing is ever scheduled. Following kube-scheduler's Lease
//! pairs the two without giving up the extender's own Lease (the single-writer guarantee):
//! a replica contends for its Lease only while its own kube-scheduler leads, and hands it back
//! at once when another pod's kube-scheduler does.

use k8s_openapi::jiff::Timestamp;

/// What one Lease says, as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    /// `spec.holderIdentity`; empty when nobody holds it (released).
    pub holder: String,
    /// `spec.renewTime`.
    pub renew_time: Option<Timestamp>,
    /// `spec.leaseDurationSeconds` (absent or below 1 ⇒ the caller's default).
    pub duration_s: i64,
    /// `spec.leaseTransitions`: the leadership term.
    pub transitions: u64,
}

impl LeaseRecord {
    /// Nobody holds the Lease: released (empty holder), never renewed, or not renewed within its
    /// duration.
    pub fn is_free(&self, now: Timestamp) -> bool {
        if self.holder.is_empty() {
            return true;
        }
        match self.renew_time {
            None => true,
            Some(t) => {
                let until = t
                    .as_microsecond()
                    .saturating_add(self.duration_s.max(1).saturating_mul(1_000_000));
                until <= now.as_microsecond()
            }
        }
    }
}

/// Who this replica is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity<'a> {
    /// Holder identity written into our own Lease (the pod name).
    pub own: &'a str,
    /// With a followed Lease: the hostname its holders write before `_` (kube-scheduler's
    /// identity is `<hostname>_<uuid>`, and a pod's hostname is its name). `None`: no followed
    /// Lease, plain contention.
    pub follow_host: Option<&'a str>,
}

impl Identity<'_> {
    /// The followed Lease's holder is this pod's kube-scheduler.
    pub fn is_own_follower(&self, holder: &str) -> bool {
        self.follow_host.is_some_and(|h| {
            !h.is_empty()
                && holder
                    .strip_prefix(h)
                    .is_some_and(|rest| rest.starts_with('_'))
        })
    }
}

/// Why a replica stands by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standby {
    /// Another replica holds our Lease.
    HeldBy(String),
    /// Another pod's kube-scheduler leads (the followed Lease's holder): its extender must lead.
    FollowedElsewhere(String),
}

/// What to do with our own Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAction {
    /// Our Lease does not exist: create it, holding it (term 0).
    Create,
    /// We hold it: renew it, keeping the term.
    Renew { term: u64 },
    /// It is free or expired: take it (a new term).
    Acquire { term: u64 },
    /// We hold it but another pod's kube-scheduler leads: stop deciding, then clear the holder so
    /// the paired replica takes it at its next try instead of after a full lease duration.
    Release { followed_holder: String },
    /// Leave the Lease alone.
    Standby(Standby),
}

impl LeaseAction {
    /// The term we lead in after a successful write of this action, if any.
    pub fn term(&self) -> Option<u64> {
        match self {
            LeaseAction::Create => Some(0),
            LeaseAction::Renew { term } | LeaseAction::Acquire { term } => Some(*term),
            LeaseAction::Release { .. } | LeaseAction::Standby(_) => None,
        }
    }
}

/// The decision. `followed` is `None` when there is no followed Lease, it does not exist, or it
/// could not be read: all mean plain contention, as when it exists but is free or expired.
/// Only a followed Lease actively held by another pod's kube-scheduler keeps this replica off
/// (and makes it release what it holds).
pub fn decide(
    own: Option<&LeaseRecord>,
    followed: Option<&LeaseRecord>,
    now: Timestamp,
    me: Identity<'_>,
) -> LeaseAction {
    let elsewhere = match (me.follow_host, followed) {
        (Some(_), Some(f)) if !f.is_free(now) && !me.is_own_follower(&f.holder) => {
            Some(f.holder.clone())
        }
        _ => None,
    };
    match (own, elsewhere) {
        (Some(l), Some(holder)) if l.holder == me.own => LeaseAction::Release {
            followed_holder: holder,
        },
        (_, Some(holder)) => LeaseAction::Standby(Standby::FollowedElsewhere(holder)),
        (None, None) => LeaseAction::Create,
        (Some(l), None) if l.holder == me.own => LeaseAction::Renew {
            term: l.transitions,
        },
        (Some(l), None) if l.is_free(now) => LeaseAction::Acquire {
            term: l.transitions.saturating_add(1),
        },
        (Some(l), None) => LeaseAction::Standby(Standby::HeldBy(l.holder.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    fn lease(holder: &str, renewed: i64, transitions: u64) -> LeaseRecord {
        LeaseRecord {
            holder: holder.to_owned(),
            renew_time: Some(at(renewed)),
            duration_s: 15,
            transitions,
        }
    }

    const A: Identity<'static> = Identity {
        own: "sched-a",
        follow_host: Some("sched-a"),
    };
    const B: Identity<'static> = Identity {
        own: "sched-b",
        follow_host: Some("sched-b"),
    };

    /// The outage this module exists for: kube-scheduler leads in pod B, the extender Lease is
    /// held by pod A. A lets go and B takes it over, in one round each, without waiting out
    /// the lease.
    #[test]
    fn split_leadership_converges_to_the_kube_scheduler_leaders_pod() {
        let followed = lease("sched-b_0f1e2d3c", 100, 4);
        let own = lease("sched-a", 100, 7);
        assert_eq!(
            decide(Some(&own), Some(&followed), at(101), A),
            LeaseAction::Release {
                followed_holder: "sched-b_0f1e2d3c".to_owned()
            }
        );
        // B waits while A still holds it (A's lease is not expired)…
        assert_eq!(
            decide(Some(&own), Some(&followed), at(101), B),
            LeaseAction::Standby(Standby::HeldBy("sched-a".to_owned()))
        );
        // …and takes it as soon as A has cleared the holder, long before the 15 s expiry.
        let released = LeaseRecord {
            holder: String::new(),
            ..own.clone()
        };
        assert_eq!(
            decide(Some(&released), Some(&followed), at(102), B),
            LeaseAction::Acquire { term: 8 }
        );
        // A does not take it back while B's kube-scheduler leads.
        assert_eq!(
            decide(Some(&released), Some(&followed), at(102), A),
            LeaseAction::Standby(Standby::FollowedElsewhere("sched-b_0f1e2d3c".to_owned()))
        );
    }

    #[test]
    fn the_paired_replica_renews_and_the_other_never_contends() {
        let followed = lease("sched-a_77", 200, 1);
        let own = lease("sched-a", 199, 3);
        assert_eq!(
            decide(Some(&own), Some(&followed), at(200), A),
            LeaseAction::Renew { term: 3 }
        );
        // Even once A's Lease expired (A's extender stalled), B stays off while A's
        // kube-scheduler leads: B leading would not schedule anything either.
        let still_leading = lease("sched-a_77", 225, 1);
        assert_eq!(
            decide(Some(&own), Some(&still_leading), at(230), B),
            LeaseAction::Standby(Standby::FollowedElsewhere("sched-a_77".to_owned()))
        );
        // No own Lease yet: only the paired replica creates it.
        assert_eq!(
            decide(None, Some(&followed), at(200), A),
            LeaseAction::Create
        );
        assert_eq!(
            decide(None, Some(&followed), at(200), B),
            LeaseAction::Standby(Standby::FollowedElsewhere("sched-a_77".to_owned()))
        );
    }

    #[test]
    fn without_a_live_followed_lease_it_is_plain_contention() {
        let own = lease("sched-a", 100, 2);
        let expired_followed = lease("sched-b_1", 100, 9);
        let released_followed = LeaseRecord {
            holder: String::new(),
            ..lease("sched-b_1", 200, 9)
        };
        for followed in [None, Some(&expired_followed), Some(&released_followed)] {
            // The holder keeps renewing…
            assert_eq!(
                decide(Some(&own), followed, at(200), A),
                LeaseAction::Renew { term: 2 }
            );
            // …others wait while it is live and take it once it expired.
            assert_eq!(
                decide(Some(&own), followed, at(110), B),
                LeaseAction::Standby(Standby::HeldBy("sched-a".to_owned()))
            );
            assert_eq!(
                decide(Some(&own), followed, at(116), B),
                LeaseAction::Acquire { term: 3 }
            );
            assert_eq!(decide(None, followed, at(200), B), LeaseAction::Create);
        }
    }

    #[test]
    fn no_follow_flag_ignores_the_followed_lease() {
        let me = Identity {
            own: "sched-a",
            follow_host: None,
        };
        let followed = lease("sched-b_1", 100, 1);
        let own = lease("sched-a", 100, 5);
        assert_eq!(
            decide(Some(&own), Some(&followed), at(101), me),
            LeaseAction::Renew { term: 5 }
        );
    }

    #[test]
    fn the_holder_prefix_must_be_the_whole_hostname() {
        // Pod `sched-a` must not mistake pod `sched-ab`'s kube-scheduler for its own.
        assert!(A.is_own_follower("sched-a_1234"));
        assert!(!A.is_own_follower("sched-ab_1234"));
        assert!(!A.is_own_follower("sched-a"));
        assert!(!A.is_own_follower(""));
        let empty = Identity {
            own: "x",
            follow_host: Some(""),
        };
        assert!(!empty.is_own_follower("_1234"));
        let followed = lease("sched-ab_1", 100, 1);
        assert_eq!(
            decide(None, Some(&followed), at(101), A),
            LeaseAction::Standby(Standby::FollowedElsewhere("sched-ab_1".to_owned()))
        );
    }

    #[test]
    fn expiry_uses_the_leases_own_duration() {
        let mut l = lease("x", 100, 0);
        l.duration_s = 60;
        assert!(!l.is_free(at(159)));
        assert!(l.is_free(at(160)));
        l.renew_time = None;
        assert!(l.is_free(at(0)));
        // A nonsensical duration counts as one second, never as "held forever".
        l.renew_time = Some(at(100));
        l.duration_s = -5;
        assert!(l.is_free(at(101)));
    }

    #[test]
    fn terms_follow_transitions() {
        assert_eq!(LeaseAction::Create.term(), Some(0));
        assert_eq!(LeaseAction::Renew { term: 4 }.term(), Some(4));
        assert_eq!(LeaseAction::Acquire { term: 5 }.term(), Some(5));
        assert_eq!(
            LeaseAction::Release {
                followed_holder: "b_1".into()
            }
            .term(),
            None
        );
        let at_max = LeaseRecord {
            transitions: u64::MAX,
            ..LeaseRecord::default()
        };
        assert_eq!(
            decide(Some(&at_max), None, at(0), A),
            LeaseAction::Acquire { term: u64::MAX }
        );
    }
}
