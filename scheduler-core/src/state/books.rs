//! The books: how much of which GPU each pod uses, kept compactly per pod ([`PodEntry`], shared
//! strings), and what a booking charges against a namespace ([`usage_charge`]).

use super::*;

/// Strings many pod entries repeat (node names, namespaces, GPU UUIDs, vendors, bind phases),
/// kept once. Strings no entry holds any more are dropped from time to time.
#[derive(Debug, Default)]
pub(super) struct Strings {
    /// The default (keyed) hasher: pods name these strings.
    pub(super) set: HashSet<std::sync::Arc<str>>,
    /// Entries dropped since the last collection.
    pub(super) dropped: usize,
}

impl Strings {
    pub(super) fn get(&mut self, s: &str) -> std::sync::Arc<str> {
        if let Some(a) = self.set.get(s) {
            return a.clone();
        }
        let a: std::sync::Arc<str> = std::sync::Arc::from(s);
        self.set.insert(a.clone());
        a
    }

    /// An entry holding some of these strings went away: collect once as many entries went as
    /// there are strings (amortised O(1) per entry).
    pub(super) fn entry_dropped(&mut self) {
        self.dropped += 1;
        if self.dropped > self.set.len().max(1024) {
            self.set.retain(|a| std::sync::Arc::strong_count(a) > 1);
            self.set.shrink_to_fit();
            self.dropped = 0;
        }
    }
}

/// One device of a pod's container device list, with shared strings.
#[derive(Debug, Clone)]
pub(super) struct Device {
    pub(super) uuid: std::sync::Arc<str>,
    pub(super) vendor: std::sync::Arc<str>,
    pub(super) usedmem: u32,
    pub(super) usedcores: u32,
}

/// One collapsed usage entry ([`DeviceUsage`]), with shared strings.
#[derive(Debug, Clone)]
pub(super) struct Usage {
    pub(super) uuid: std::sync::Arc<str>,
    pub(super) vendor: std::sync::Arc<str>,
    pub(super) slots: u32,
    pub(super) mem: u32,
    pub(super) cores: u32,
}

/// A [`PodRecord`] as the state keeps it: the same information in a fifth of the memory (at
/// 50,000 pods the records were most of the loop's state). Repeated strings are shared, lists
/// are exact-sized, and the allocation signature is kept only for the pods the bind gate reads
/// it of (pending allocation, decided and not bound); for the others it is derived again from
/// the devices and the pod's placement constraints when the record is asked for.
#[derive(Debug, Clone)]
pub(super) struct PodEntry {
    pub(super) namespace: std::sync::Arc<str>,
    /// Shared (as `usage` is) so that a metrics scrape holds the booked pods for reference
    /// counts ([`ClusterState::shared_bookings`]).
    pub(super) name: std::sync::Arc<str>,
    pub(super) node: Option<std::sync::Arc<str>>,
    pub(super) bound_node: Option<std::sync::Arc<str>>,
    pub(super) bind_phase: Option<std::sync::Arc<str>>,
    pub(super) terminal: bool,
    pub(super) deleting: bool,
    pub(super) devices: Box<[Box<[Device]>]>,
    pub(super) usage: std::sync::Arc<[Usage]>,
    pub(super) signature: Option<Box<AllocationSignature>>,
    /// The signature's placement constraints when the signature is not kept.
    pub(super) constraints: Box<[(Box<str>, Box<str>)]>,
    pub(super) decode_error: Option<Box<str>>,
    /// [`PodRecord::mig`], kept only for the pods that have MIG reservations.
    pub(super) mig: Option<Box<[MigAllocation]>>,
    pub(super) standing: Standing,
    pub(super) preempted: bool,
}

impl PodEntry {
    pub(super) fn new(rec: PodRecord, strings: &mut Strings) -> PodEntry {
        let keep_signature = rec.is_pending_allocation() || rec.is_decided_unbound();
        let PodRecord {
            uid: _,
            namespace,
            name,
            node,
            bound_node,
            devices,
            usage,
            bind_phase,
            terminal,
            deleting,
            signature,
            decode_error,
            mig,
            standing,
            preempted,
        } = rec;
        let devices = devices
            .0
            .iter()
            .map(|c| {
                c.iter()
                    .map(|d| Device {
                        uuid: strings.get(&d.uuid),
                        vendor: strings.get(&d.vendor),
                        usedmem: d.usedmem,
                        usedcores: d.usedcores,
                    })
                    .collect()
            })
            .collect();
        let usage = usage
            .iter()
            .map(|u| Usage {
                uuid: strings.get(&u.uuid),
                vendor: strings.get(&u.vendor),
                slots: u.slots,
                mem: u.mem,
                cores: u.cores,
            })
            .collect();
        let (signature, constraints) = if keep_signature {
            (Some(Box::new(signature)), Box::default())
        } else {
            let constraints = signature
                .constraints
                .into_iter()
                .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
                .collect();
            (None, constraints)
        };
        PodEntry {
            namespace: strings.get(&namespace),
            name: std::sync::Arc::from(name),
            node: node.map(|n| strings.get(&n)),
            bound_node: bound_node.map(|n| strings.get(&n)),
            bind_phase: bind_phase.map(|p| strings.get(&p)),
            terminal,
            deleting,
            devices,
            usage,
            signature,
            constraints,
            decode_error: decode_error.map(String::into_boxed_str),
            mig: (!mig.is_empty()).then(|| mig.into_boxed_slice()),
            standing,
            preempted,
        }
    }

    pub(super) fn phase(&self) -> PodPhase<'_> {
        PodPhase {
            has_node: self.node.is_some(),
            bound: self.bound_node.is_some(),
            bind_phase: self.bind_phase.as_deref(),
            terminal: self.terminal,
            deleting: self.deleting,
        }
    }

    pub(super) fn books_capacity(&self) -> bool {
        self.phase().books_capacity()
    }

    /// What the pod's own booking charges its namespace, when it books capacity on a node
    /// (what [`ClusterState::effective`] counts of it without a reservation).
    pub(super) fn charge(&self) -> Option<Charge> {
        (self.books_capacity() && self.node.is_some())
            .then(|| UsageRef::Compact(&self.usage).charge())
    }

    pub(super) fn is_pending_allocation(&self) -> bool {
        self.phase().is_pending_allocation()
    }

    pub(super) fn is_decided_unbound(&self) -> bool {
        self.phase().is_decided_unbound()
    }

    /// The record [`PodRecord::from_pod`] built.
    pub(super) fn record(&self, uid: &str) -> PodRecord {
        let devices = PodDevices(
            self.devices
                .iter()
                .map(|c| {
                    c.iter()
                        .map(|d| hami_contract::ContainerDevice {
                            uuid: d.uuid.to_string(),
                            vendor: d.vendor.to_string(),
                            usedmem: d.usedmem,
                            usedcores: d.usedcores,
                        })
                        .collect()
                })
                .collect(),
        );
        let signature = match &self.signature {
            Some(s) => (**s).clone(),
            None => {
                let constraints: BTreeMap<String, String> = self
                    .constraints
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                AllocationSignature::new(&devices, &constraints)
            }
        };
        PodRecord {
            uid: uid.to_owned(),
            namespace: self.namespace.to_string(),
            name: self.name.to_string(),
            node: self.node.as_deref().map(str::to_owned),
            bound_node: self.bound_node.as_deref().map(str::to_owned),
            devices,
            usage: UsageRef::Compact(&self.usage).to_vec(),
            bind_phase: self.bind_phase.as_deref().map(str::to_owned),
            terminal: self.terminal,
            deleting: self.deleting,
            signature,
            decode_error: self.decode_error.as_deref().map(str::to_owned),
            mig: self.mig.as_deref().map(<[_]>::to_vec).unwrap_or_default(),
            standing: self.standing,
            preempted: self.preempted,
        }
    }
}

/// A pod's collapsed usage as the state holds it: a reservation's list, or a pod entry's.
#[derive(Debug, Clone, Copy)]
pub(super) enum UsageRef<'a> {
    Full(&'a [DeviceUsage]),
    Compact(&'a [Usage]),
}

impl<'a> UsageRef<'a> {
    /// `(uuid, slots, mem, cores)` of every entry.
    pub(super) fn each(self, mut f: impl FnMut(&str, u32, u32, u32)) {
        match self {
            UsageRef::Full(u) => u.iter().for_each(|u| f(&u.uuid, u.slots, u.mem, u.cores)),
            UsageRef::Compact(u) => u.iter().for_each(|u| f(&u.uuid, u.slots, u.mem, u.cores)),
        }
    }

    /// [`Self::each`] with the UUIDs borrowed for as long as the usage is.
    pub(super) fn each_ref(self, mut f: impl FnMut(&'a str, u32, u32, u32)) {
        match self {
            UsageRef::Full(u) => u.iter().for_each(|u| f(&u.uuid, u.slots, u.mem, u.cores)),
            UsageRef::Compact(u) => u.iter().for_each(|u| f(&u.uuid, u.slots, u.mem, u.cores)),
        }
    }

    pub(super) fn to_vec(self) -> Vec<DeviceUsage> {
        self.to_cow().into_owned()
    }

    pub(super) fn to_cow(self) -> std::borrow::Cow<'a, [DeviceUsage]> {
        match self {
            UsageRef::Full(u) => std::borrow::Cow::Borrowed(u),
            UsageRef::Compact(u) => std::borrow::Cow::Owned(
                u.iter()
                    .map(|u| DeviceUsage {
                        uuid: u.uuid.to_string(),
                        vendor: u.vendor.to_string(),
                        slots: u.slots,
                        mem: u.mem,
                        cores: u.cores,
                    })
                    .collect(),
            ),
        }
    }

    /// [`usage_charge`].
    pub(super) fn charge(self) -> Charge {
        let mut c = Charge::default();
        self.each(|_, slots, mem, cores| {
            c.mem += u64::from(mem);
            c.cores += u64::from(cores);
            c.count += u64::from(slots.max(1));
        });
        c
    }

    /// [`fit::book_pod`].
    pub(super) fn book(self, node: &mut NodeState) {
        self.each(|uuid, slots, mem, cores| node.book_usage(uuid, slots, mem, cores));
    }
}

/// Charge of a collapsed usage against a namespace budget.
pub fn usage_charge(usage: &[DeviceUsage]) -> Charge {
    usage.iter().fold(Charge::default(), |c, u| Charge {
        mem: c.mem + u64::from(u.mem),
        cores: c.cores + u64::from(u.cores),
        count: c.count + u64::from(u.slots.max(1)),
    })
}

/// A pod that books capacity, with every part shared with the state: taking all of them costs
/// the decision loop reference counts, not copies, and they stay valid after it moves on.
#[derive(Debug, Clone)]
pub struct SharedBooking {
    pub namespace: std::sync::Arc<str>,
    pub name: std::sync::Arc<str>,
    pub node: std::sync::Arc<str>,
    usage: SharedUsage,
}

#[derive(Debug, Clone)]
enum SharedUsage {
    /// A reservation's list (few: the pods in flight).
    Full(std::sync::Arc<[DeviceUsage]>),
    /// A pod entry's own list.
    Compact(std::sync::Arc<[Usage]>),
}

impl SharedBooking {
    fn usage_ref(&self) -> UsageRef<'_> {
        match &self.usage {
            SharedUsage::Full(u) => UsageRef::Full(u),
            SharedUsage::Compact(u) => UsageRef::Compact(u),
        }
    }

    /// The pod's collapsed usage entries: `(uuid, mem, cores)`, in order.
    pub fn usage(&self) -> Vec<(&str, u32, u32)> {
        let mut out = Vec::new();
        self.usage_ref()
            .each_ref(|uuid, _, mem, cores| out.push((uuid, mem, cores)));
        out
    }

    /// What the pod charges its namespace's budget ([`usage_charge`]).
    pub fn charge(&self) -> Charge {
        self.usage_ref().charge()
    }
}

impl ClusterState {
    /// Every pod that books capacity now (informer view, reservations winning), each shared
    /// with the state ([`SharedBooking`]).
    pub fn shared_bookings(&self) -> Vec<SharedBooking> {
        let mut out = Vec::with_capacity(self.reservations.len() + self.pods.len());
        for r in self.reservations.values() {
            out.push(SharedBooking {
                namespace: r.namespace.as_str().into(),
                name: r.name.as_str().into(),
                node: r.node.as_str().into(),
                usage: SharedUsage::Full(r.usage.as_slice().into()),
            });
        }
        // Most of the time nothing is in flight: then no pod's UID is hashed.
        let in_flight = !self.reservations.is_empty();
        for (uid, p) in &self.pods {
            if !p.books_capacity() || in_flight && self.reservations.contains_key(&**uid) {
                continue;
            }
            if let Some(n) = &p.node {
                out.push(SharedBooking {
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    node: n.clone(),
                    usage: SharedUsage::Compact(p.usage.clone()),
                });
            }
        }
        out
    }
}
