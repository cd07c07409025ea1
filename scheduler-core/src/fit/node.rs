//! A whole pod onto one node (`scoreNode`: init containers each on a fresh copy, app containers
//! cumulatively), and the choice among the nodes that fit (contract §5.5).

use std::collections::BTreeMap;

use hami_contract::mig::{MigAllocation, MigPlacement};
use hami_contract::{ContainerDevice, NVIDIA_VENDOR, PodDevices};

use super::capacity::{Charge, GpuState, NodeState, QuotaBudget};
use super::container::{ContainerFit, MigPick, Pick};
use super::input::{NodePolicyKey, PlacementOptions, PodAsk};
use super::reason::FitFailure;
use super::score::node_score;

/// A node that can take the pod: its score and the per-container devices.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFit {
    pub node: String,
    /// Node score (existing usage only, contract §5.2 step 1).
    pub score: f32,
    /// One entry per container, init containers first.
    pub devices: PodDevices,
    /// Quota charge of the pod as placed (collapsed: max over init, sum over app).
    pub charge: Charge,
    /// The MIG instances to carve (`hami.io/vgpu-mig-allocations`), one per device on a `mig`
    /// GPU; empty when the pod has none.
    pub mig: Vec<MigAllocation>,
}

/// What fitting one node found, before anything is copied out of the node: per container
/// (init containers first) the picked GPU positions. [`NodePicks::into_fit`] builds the
/// [`NodeFit`]; the filter does that only for the node it keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct NodePicks {
    /// Node score (existing usage only, contract §5.2 step 1).
    pub score: f32,
    pub containers: Vec<Vec<Pick>>,
    pub charge: Charge,
}

impl NodePicks {
    /// The container device list (UUIDs of `node`'s GPUs).
    pub fn devices(&self, node: &NodeState) -> PodDevices {
        PodDevices(
            self.containers
                .iter()
                .map(|picks| to_devices(&node.gpus, picks))
                .collect(),
        )
    }

    pub fn into_fit(self, node: &NodeState) -> NodeFit {
        NodeFit {
            node: node.name.clone(),
            score: self.score,
            devices: self.devices(node),
            charge: self.charge,
            mig: self.mig_allocations(node),
        }
    }

    /// The reservations of the picks on `mig` GPUs (HAMi `EncodeMigAllocations`):
    /// `containerIndex` counts init containers first, then app containers (the index space of
    /// the device annotations); `deviceIndex` is the position in that container's device list.
    pub fn mig_allocations(&self, node: &NodeState) -> Vec<MigAllocation> {
        let mut out = Vec::new();
        for (c, picks) in self.containers.iter().enumerate() {
            for (d, p) in picks.iter().enumerate() {
                if let Some(m) = &p.mig {
                    out.push(MigAllocation {
                        container_index: u32::try_from(c).unwrap_or(u32::MAX),
                        device_index: u32::try_from(d).unwrap_or(u32::MAX),
                        gpu_uuid: node.gpus[p.gpu].uuid.clone(),
                        profile: m.profile.clone(),
                        placement: m.placement,
                        ..MigAllocation::default()
                    });
                }
            }
        }
        out
    }
}

/// The MIG half of `AddResourceUsage` (HAMi `pkg/device/nvidia/device.go`) for one container's
/// picks, in order: each pick on a `mig` GPU takes the instance `selectMigCandidate` gives for its
/// memory next to the GPU's instances in use and the container's earlier ones, and books that
/// profile's memory and core instead of the request.
fn realize_mig(gpus: &[GpuState], picks: &mut [Pick]) -> Result<(), FitFailure> {
    for k in 0..picks.len() {
        let gi = picks[k].gpu;
        let Some(m) = gpus.get(gi).and_then(|g| g.mig.as_deref()) else {
            continue;
        };
        let mut occupied: Vec<MigPlacement> = m.occupied().collect();
        occupied.extend(
            picks[..k]
                .iter()
                .filter(|p| p.gpu == gi)
                .filter_map(|p| p.mig.as_ref().map(|x| x.placement)),
        );
        let Some((profile, placement)) = m.select(&occupied, picks[k].mem) else {
            return Err(FitFailure::MigAllocation {
                device: gpus[gi].uuid.clone(),
            });
        };
        let p = &mut picks[k];
        p.mem = profile.memory_mb;
        p.cores = profile.core;
        p.mig = Some(MigPick {
            profile: profile.name.clone(),
            placement,
        });
    }
    Ok(())
}

/// Evaluates one node for one pod (`scoreNode`): init containers each on a fresh copy, app
/// containers cumulatively. On failure says why (HAMi's reason string as `Display`).
pub fn evaluate_node(
    node: &NodeState,
    ask: &PodAsk,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
) -> Result<NodeFit, FitFailure> {
    evaluate_picks(node, None, ask, opts, quota).map(|p| p.into_fit(node))
}

/// [`evaluate_node`] without building the device list. `nvidia` is the node's
/// [`nvidia_mask`](super::nvidia_mask) when the caller keeps one (it must match `node.gpus`),
/// else `None`.
pub fn evaluate_picks(
    node: &NodeState,
    nvidia: Option<&[bool]>,
    ask: &PodAsk,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
) -> Result<NodePicks, FitFailure> {
    let nvidia = nvidia.filter(|m| m.len() == node.gpus.len());
    let score = node_score(&node.gpus);
    let mut containers: Vec<Vec<Pick>> = Vec::with_capacity(ask.init.len() + ask.app.len());
    let mut init_charge = Charge::default();
    for req in &ask.init {
        match req {
            None => containers.push(Vec::new()),
            Some(r) => {
                let mut picks = ContainerFit {
                    node,
                    gpus: &node.gpus,
                    req: r,
                    opts,
                    quota,
                    charged: Charge::default(),
                    nvidia,
                }
                .picks()?;
                realize_mig(&node.gpus, &mut picks)?;
                let c = picks
                    .iter()
                    .fold(Charge::default(), |c, p| c.add(p.mem, p.cores));
                if (c.count, c.mem) > (init_charge.count, init_charge.mem) {
                    init_charge = c;
                }
                containers.push(picks);
            }
        }
    }
    // Only pods with several GPU app containers need a scratch copy of the usage.
    let multi = ask.app.iter().filter(|r| r.is_some()).count() > 1;
    let mut gpus = if multi {
        std::borrow::Cow::Owned(node.gpus.clone())
    } else {
        std::borrow::Cow::Borrowed(node.gpus.as_slice())
    };
    // HAMi sorts one copy of the node's device list in place for each app container in turn, so
    // each container starts from the order the one before left (`allocateAppContainers`); ties
    // keep that order. Init containers each start from the node's own order.
    let mut order: Vec<usize> = if multi {
        (0..node.gpus.len()).collect()
    } else {
        Vec::new()
    };
    let mut app_charge = Charge::default();
    for req in &ask.app {
        match req {
            None => containers.push(Vec::new()),
            Some(r) => {
                let fit = ContainerFit {
                    node,
                    gpus: &gpus,
                    req: r,
                    opts,
                    quota,
                    charged: app_charge,
                    nvidia,
                };
                let mut picks = if multi {
                    fit.picks_in_order(&mut order)?
                } else {
                    fit.picks()?
                };
                realize_mig(&gpus, &mut picks)?;
                for p in &picks {
                    if multi {
                        let g = &mut gpus.to_mut()[p.gpu];
                        g.book(p.mem, p.cores);
                        if let Some(m) = &p.mig {
                            g.book_mig(MigAllocation {
                                gpu_uuid: g.uuid.clone(),
                                profile: m.profile.clone(),
                                placement: m.placement,
                                ..MigAllocation::default()
                            });
                        }
                    }
                    app_charge = app_charge.add(p.mem, p.cores);
                }
                containers.push(picks);
            }
        }
    }
    let charge = Charge {
        mem: init_charge.mem.max(app_charge.mem),
        cores: init_charge.cores.max(app_charge.cores),
        count: init_charge.count.max(app_charge.count),
    };
    Ok(NodePicks {
        score,
        containers,
        charge,
    })
}

fn to_devices(gpus: &[GpuState], picks: &[Pick]) -> Vec<ContainerDevice> {
    picks
        .iter()
        .map(|p| ContainerDevice {
            uuid: gpus[p.gpu].uuid.clone(),
            vendor: NVIDIA_VENDOR.to_owned(),
            usedmem: p.mem,
            usedcores: p.cores,
        })
        .collect()
}

/// Picks the node (contract §5.5): binpack ⇒ the highest node score, spread ⇒ the lowest. Ties go to
/// the earliest candidate (HAMi: Go map order, i.e. random).
pub fn select_node(fits: &[NodeFit], policy: NodePolicyKey) -> Option<&NodeFit> {
    let mut best: Option<&NodeFit> = None;
    for f in fits {
        best = match best {
            None => Some(f),
            Some(b) => Some(if policy.prefers(f.score, b.score) {
                f
            } else {
                b
            }),
        };
    }
    best
}

/// The outcome of filtering one pod over a set of candidate nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterOutcome {
    pub chosen: Option<NodeFit>,
    /// All fitting nodes with their scores (for the `FilteringSucceed` event).
    pub fitting: Vec<(String, f32)>,
    /// Why each failed node does not fit.
    pub failed: BTreeMap<String, FitFailure>,
}

/// Evaluates every candidate and selects one.
pub fn filter<'a>(
    nodes: impl IntoIterator<Item = &'a NodeState>,
    ask: &PodAsk,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
) -> FilterOutcome {
    let mut fits = Vec::new();
    let mut failed = BTreeMap::new();
    for n in nodes {
        match evaluate_node(n, ask, opts, quota) {
            Ok(f) => fits.push(f),
            Err(r) => {
                failed.insert(n.name.clone(), r);
            }
        }
    }
    let fitting = fits.iter().map(|f| (f.node.clone(), f.score)).collect();
    let chosen = select_node(&fits, opts.node_policy).cloned();
    FilterOutcome {
        chosen,
        fitting,
        failed,
    }
}
