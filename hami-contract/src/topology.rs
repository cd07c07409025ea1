//! The links between a node's GPUs, as NVML reports them, turned into the pair scores of
//! `hami.io/node-nvidia-score` (contract §2.2). Pure: the device plugin reads NVML into
//! [`NodeTopology`] and [`pair_scores`] does the rest, so the rule is tested without a driver.
//!
//! HAMi v2.10 does this in `pkg/device/nvidia/links.go` (`GetP2PLink`, `GetNVLink`, which come
//! from NVIDIA's go-gpuallocator) and `pkg/device/nvidia/calculate_score.go`
//! (`calculateGPUScore`, `calculateGPUPairScore`). The rule, for an ordered pair of GPUs (a, b):
//!
//! 1. The PCIe link: NVML's common ancestor of a and b, one [`P2pLink`] from
//!    [`P2pLink::from_nvml_topology_level`].
//! 2. At most one NVLink entry, N links counted as [`P2pLink::NvLink`]`(N)`:
//!    * direct: N = the active links of a whose remote PCI bus id is b's;
//!    * otherwise, when a has an active link with a known remote bus id and both a and b have
//!      active links into an NVSwitch: N = the smaller of the two switch-link counts
//!      (every NVSwitch-attached GPU reaches every other through the switch fabric);
//!    * N outside 1..=18 means no entry.
//! 3. The pair's score is the sum of its entries' scores, unless a sees a different number of
//!    entries towards b than b sees towards a: then the pair scores 0 and is reported as
//!    asymmetric (HAMi logs it and raises the node Warning event `AsymmetricGPUP2PLink`).
//!
//! Only the number of entries is compared in step 3, not their kinds or counts: a pair where a
//! sees 2 links to b and b sees 3 to a is symmetric by this rule and scores a's view.

use std::collections::BTreeMap;

use crate::node::{DevicePairScore, P2pLink};

/// NVML's `NVML_NVLINK_MAX_LINKS`: links 0..18 are asked about per GPU, and more links than
/// this between two GPUs count as none (HAMi's `nvlinkCountToType`).
pub const NVLINK_MAX_LINKS: u32 = 18;

impl P2pLink {
    /// The PCIe link for NVML's `nvmlGpuTopologyLevel_t` (`nvmlDeviceGetTopologyCommonAncestor`):
    /// INTERNAL (0) same board, SINGLE (10) one PCIe switch, MULTIPLE (20) several switches,
    /// HOSTBRIDGE (30), NODE (40, formerly CPU) same NUMA node, SYSTEM (50) across sockets.
    /// Any other value is `None` (HAMi: "unknown topology level", an error).
    pub fn from_nvml_topology_level(level: u32) -> Option<P2pLink> {
        match level {
            0 => Some(P2pLink::SameBoard),
            10 => Some(P2pLink::SingleSwitch),
            20 => Some(P2pLink::MultiSwitch),
            30 => Some(P2pLink::HostBridge),
            40 => Some(P2pLink::SameCpu),
            50 => Some(P2pLink::CrossCpu),
            _ => None,
        }
    }
}

/// What NVML says is at the other end of an NVLink (`nvmlDeviceGetNvLinkRemoteDeviceType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvLinkRemote {
    Gpu,
    /// An NVSwitch (HGX/DGX A100, H100, B200 baseboards).
    Switch,
    /// IBM POWER's NVLink-attached CPU.
    IbmNpu,
    /// NVML said `UNKNOWN`, or its answer could not be read. nvml-wrapper 0.13's
    /// `NvLink::remote_device_type` always returns `Unknown` (it hands NVML a temporary to fill),
    /// so Tessera's plugin sees this for every link; see [`NvLinkEnd::leads_to_switch`].
    Unknown,
}

/// One active NVLink of a GPU (links NVML reports disabled are left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvLinkEnd {
    /// The remote end's PCI bus id (`nvmlDeviceGetNvLinkRemotePciInfo_v2`); `None` when NVML
    /// does not support the question for this link.
    pub remote_pci_bus_id: Option<String>,
    /// The remote end's kind; `None` when NVML does not support the question for this link.
    pub remote: Option<NvLinkRemote>,
}

impl NvLinkEnd {
    /// The link goes into an NVSwitch. HAMi trusts NVML's device type alone. Tessera also counts
    /// an `Unknown` remote whose bus id is none of the node's GPUs (`gpu_bus_ids`, normalised):
    /// with nvml-wrapper 0.13 every answer reads `Unknown`, and on NVSwitch systems the remote
    /// bus id of a GPU's link is the switch's (deviation T1 in `docs/contract-deviations.md`).
    fn leads_to_switch(&self, gpu_bus_ids: &[String]) -> bool {
        match self.remote {
            Some(NvLinkRemote::Switch) => true,
            Some(NvLinkRemote::Unknown) => self
                .remote_pci_bus_id
                .as_deref()
                .map(normalise_bus_id)
                .is_some_and(|id| !gpu_bus_ids.contains(&id)),
            _ => false,
        }
    }
}

/// One GPU and its active NVLinks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLinks {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// PCI bus id as NVML writes it (`00000000:07:00.0`).
    pub pci_bus_id: String,
    /// Active NVLinks, in link order.
    pub nvlinks: Vec<NvLinkEnd>,
}

/// Everything NVML told about a node's GPUs and the links between them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeTopology {
    /// Every GPU NVML lists, in NVML index order (also GPUs the plugin does not advertise: an
    /// NVLink is recognised by the bus id of the GPU at its other end).
    pub gpus: Vec<GpuLinks>,
    /// The PCIe link of each ordered pair of positions in `gpus` (NVML's common ancestor). A
    /// missing pair has no PCIe entry.
    pub pcie: BTreeMap<(usize, usize), P2pLink>,
}

/// Why scores cannot be computed for the GPUs asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// The GPU is not among those NVML described (HAMi: "no device with uuid").
    #[error("GPU {0} is not in the NVML topology")]
    UnknownGpu(String),
}

/// The annotation entries, plus the pairs whose link data disagreed between their two ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PairScores {
    /// One entry per GPU asked for, in that order, scoring every other GPU asked for.
    pub entries: Vec<DevicePairScore>,
    /// `(a, b)` UUIDs of asymmetric pairs (each pair once, `a` before `b` in the order asked for);
    /// they score 0.
    pub asymmetric: Vec<(String, String)>,
}

/// HAMi's bus id comparison form (`PciInfo.BusID` in `links.go`): lower case, and the first
/// `0000` of an 8-digit domain dropped (`00000000:07:00.0` → `0000:07:00.0`).
pub fn normalise_bus_id(bus_id: &str) -> String {
    let id = bus_id.trim_end_matches('\0').to_ascii_lowercase();
    if id == "0000" {
        return id;
    }
    match id.strip_prefix("0000") {
        Some(rest) => rest.to_owned(),
        None => id,
    }
}

/// `NvLink(n)` for 1..=18 links, otherwise no NVLink entry.
fn nvlink_entry(links: usize) -> Option<P2pLink> {
    let n = u8::try_from(links).ok()?;
    (1..=NVLINK_MAX_LINKS as u8)
        .contains(&n)
        .then_some(P2pLink::NvLink(n))
}

impl NodeTopology {
    /// The entries NVML's facts give the ordered pair (a, b): the PCIe link, then the NVLink.
    fn links(&self, a: usize, b: usize, gpu_bus_ids: &[String]) -> Vec<P2pLink> {
        let mut links = Vec::with_capacity(2);
        if let Some(pcie) = self.pcie.get(&(a, b)) {
            links.push(*pcie);
        }
        if let Some(nvlink) = self.nvlink(a, b, gpu_bus_ids) {
            links.push(nvlink);
        }
        links
    }

    fn nvlink(&self, a: usize, b: usize, gpu_bus_ids: &[String]) -> Option<P2pLink> {
        let (from, to) = (&self.gpus[a], &self.gpus[b]);
        let remote_ids: Vec<String> = from
            .nvlinks
            .iter()
            .filter_map(|l| l.remote_pci_bus_id.as_deref().map(normalise_bus_id))
            .collect();
        let target = normalise_bus_id(&to.pci_bus_id);
        let direct = remote_ids.iter().filter(|id| **id == target).count();
        if let Some(entry) = nvlink_entry(direct) {
            return Some(entry);
        }
        // HAMi looks for NVSwitch links only when `a` has a link with a readable remote.
        if remote_ids.is_empty() {
            return None;
        }
        let switch_links = |g: &GpuLinks| {
            g.nvlinks
                .iter()
                .filter(|l| l.leads_to_switch(gpu_bus_ids))
                .count()
        };
        let (via_a, via_b) = (switch_links(from), switch_links(to));
        if via_a > 0 && via_b > 0 {
            nvlink_entry(via_a.min(via_b))
        } else {
            None
        }
    }
}

impl NodeTopology {
    /// For each GPU (position in `gpus`), the NVLink domain it belongs to: the lowest position of
    /// the GPUs it reaches over NVLink, directly or through NVSwitches (by the same link rules as
    /// the pair scores); `None` for a GPU with no NVLink to another GPU. Two GPUs with the same
    /// domain can talk over NVLink (for the DRA driver's `nvlinkDomain` attribute).
    pub fn nvlink_domains(&self) -> Vec<Option<usize>> {
        let gpu_bus_ids: Vec<String> = self
            .gpus
            .iter()
            .map(|g| normalise_bus_id(&g.pci_bus_id))
            .collect();
        let n = self.gpus.len();
        // Union-find with the lowest position as each set's root.
        let mut parent: Vec<usize> = (0..n).collect();
        fn root(parent: &mut [usize], mut i: usize) -> usize {
            while parent[i] != i {
                parent[i] = parent[parent[i]];
                i = parent[i];
            }
            i
        }
        let mut linked = vec![false; n];
        for a in 0..n {
            for b in a + 1..n {
                if self.nvlink(a, b, &gpu_bus_ids).is_some()
                    || self.nvlink(b, a, &gpu_bus_ids).is_some()
                {
                    linked[a] = true;
                    linked[b] = true;
                    let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
                    parent[ra.max(rb)] = ra.min(rb);
                }
            }
        }
        (0..n)
            .map(|i| linked[i].then(|| root(&mut parent, i)))
            .collect()
    }
}

/// The `hami.io/node-nvidia-score` entries for `uuids` (the GPUs the plugin registers, in
/// register order), by HAMi's rule (module documentation).
pub fn pair_scores(topology: &NodeTopology, uuids: &[String]) -> Result<PairScores, TopologyError> {
    let positions: Vec<usize> = uuids
        .iter()
        .map(|u| {
            topology
                .gpus
                .iter()
                .position(|g| g.uuid == *u)
                .ok_or_else(|| TopologyError::UnknownGpu(u.clone()))
        })
        .collect::<Result<_, _>>()?;
    let gpu_bus_ids: Vec<String> = topology
        .gpus
        .iter()
        .map(|g| normalise_bus_id(&g.pci_bus_id))
        .collect();
    let mut out = PairScores::default();
    for (i, &a) in positions.iter().enumerate() {
        let mut score = BTreeMap::new();
        for (j, &b) in positions.iter().enumerate() {
            if i == j {
                continue;
            }
            let there = topology.links(a, b, &gpu_bus_ids);
            let back = topology.links(b, a, &gpu_bus_ids);
            let value = if there.len() == back.len() {
                there.iter().map(|l| l.score()).sum()
            } else {
                if i < j {
                    out.asymmetric.push((uuids[i].clone(), uuids[j].clone()));
                }
                0
            };
            score.insert(uuids[j].clone(), value);
        }
        out.entries.push(DevicePairScore {
            uuid: uuids[i].clone(),
            score,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvlink_domains_group_gpus_that_reach_each_other() {
        let end = |bus: &str| NvLinkEnd {
            remote_pci_bus_id: Some(bus.to_owned()),
            remote: Some(NvLinkRemote::Gpu),
        };
        let gpu = |i: usize, links: Vec<NvLinkEnd>| GpuLinks {
            uuid: format!("GPU-{i}"),
            pci_bus_id: format!("00000000:0{i}:00.0"),
            nvlinks: links,
        };
        // 0-1 bridged, 2 alone, 3-4 bridged through 4's link only.
        let t = NodeTopology {
            gpus: vec![
                gpu(0, vec![end("00000000:01:00.0")]),
                gpu(1, vec![end("00000000:00:00.0")]),
                gpu(2, vec![]),
                gpu(3, vec![]),
                gpu(4, vec![end("00000000:03:00.0")]),
            ],
            pcie: BTreeMap::new(),
        };
        assert_eq!(
            t.nvlink_domains(),
            [Some(0), Some(0), None, Some(3), Some(3)]
        );
    }

    fn gpu_link(bus: &str) -> NvLinkEnd {
        NvLinkEnd {
            remote_pci_bus_id: Some(bus.to_owned()),
            remote: Some(NvLinkRemote::Gpu),
        }
    }

    fn switch_link(bus: &str, remote: NvLinkRemote) -> NvLinkEnd {
        NvLinkEnd {
            remote_pci_bus_id: Some(bus.to_owned()),
            remote: Some(remote),
        }
    }

    fn bus(i: usize) -> String {
        format!("00000000:{:02X}:00.0", 0x10 + i)
    }

    /// GPUs `GPU-0`… with the given links, every pair on `pcie`.
    fn node(links: Vec<Vec<NvLinkEnd>>, pcie: P2pLink) -> NodeTopology {
        let n = links.len();
        NodeTopology {
            gpus: links
                .into_iter()
                .enumerate()
                .map(|(i, nvlinks)| GpuLinks {
                    uuid: format!("GPU-{i}"),
                    pci_bus_id: bus(i),
                    nvlinks,
                })
                .collect(),
            pcie: (0..n)
                .flat_map(|a| (0..n).filter(move |b| *b != a).map(move |b| (a, b)))
                .map(|p| (p, pcie))
                .collect(),
        }
    }

    fn uuids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("GPU-{i}")).collect()
    }

    fn score(s: &PairScores, a: usize, b: usize) -> i64 {
        s.entries[a].score[&format!("GPU-{b}")]
    }

    #[test]
    fn nvml_topology_levels_map_to_hami_links() {
        let table = [
            (0, Some(P2pLink::SameBoard)),
            (10, Some(P2pLink::SingleSwitch)),
            (20, Some(P2pLink::MultiSwitch)),
            (30, Some(P2pLink::HostBridge)),
            (40, Some(P2pLink::SameCpu)),
            (50, Some(P2pLink::CrossCpu)),
            (5, None),
            (60, None),
        ];
        for (level, link) in table {
            assert_eq!(P2pLink::from_nvml_topology_level(level), link, "{level}");
        }
    }

    #[test]
    fn bus_ids_compare_in_hami_form() {
        let table = [
            ("00000000:07:00.0", "0000:07:00.0"),
            ("0000:07:00.0", ":07:00.0"),
            ("00000000:AF:00.0", "0000:af:00.0"),
            ("0000", "0000"),
            ("00000001:3b:00.0", "0001:3b:00.0"),
            ("", ""),
        ];
        for (raw, normal) in table {
            assert_eq!(normalise_bus_id(raw), normal, "{raw:?}");
        }
    }

    #[test]
    fn pcie_only_pairs_score_their_pcie_level() {
        for link in [
            P2pLink::CrossCpu,
            P2pLink::SameCpu,
            P2pLink::HostBridge,
            P2pLink::MultiSwitch,
            P2pLink::SingleSwitch,
            P2pLink::SameBoard,
        ] {
            let s = pair_scores(&node(vec![vec![], vec![]], link), &uuids(2)).unwrap();
            assert_eq!(
                (score(&s, 0, 1), score(&s, 1, 0)),
                (link.score(), link.score())
            );
            assert!(s.asymmetric.is_empty());
        }
    }

    #[test]
    fn direct_nvlinks_add_one_hundred_per_link_to_the_pcie_score() {
        // GPU-0 = GPU-1 by two links, GPU-0 – GPU-2 by one, GPU-1 and GPU-2 only through PCIe.
        let links = vec![
            vec![gpu_link(&bus(1)), gpu_link(&bus(1)), gpu_link(&bus(2))],
            vec![gpu_link(&bus(0)), gpu_link(&bus(0))],
            vec![gpu_link(&bus(0).to_lowercase())],
        ];
        let s = pair_scores(&node(links, P2pLink::CrossCpu), &uuids(3)).unwrap();
        let table = [
            ((0, 1), 210),
            ((1, 0), 210),
            ((0, 2), 110),
            ((2, 0), 110),
            ((1, 2), 10),
            ((2, 1), 10),
        ];
        for ((a, b), want) in table {
            assert_eq!(score(&s, a, b), want, "GPU-{a} → GPU-{b}");
        }
        assert!(s.asymmetric.is_empty());
    }

    #[test]
    fn nvswitch_pairs_take_the_smaller_switch_link_count() {
        let sw = |n: usize| {
            (0..n)
                .map(|k| switch_link(&format!("00000000:C{k}:00.0"), NvLinkRemote::Switch))
                .collect::<Vec<_>>()
        };
        let s = pair_scores(
            &node(vec![sw(18), sw(18), sw(12)], P2pLink::SameCpu),
            &uuids(3),
        )
        .unwrap();
        assert_eq!(score(&s, 0, 1), 1820);
        assert_eq!(score(&s, 0, 2), 1220);
        assert_eq!(score(&s, 2, 1), 1220);
    }

    #[test]
    fn unknown_remote_type_counts_as_a_switch_only_when_the_remote_is_no_gpu() {
        // nvml-wrapper 0.13 reads every remote type as Unknown.
        let unknown = |b: &str| switch_link(b, NvLinkRemote::Unknown);
        let fabric = vec![
            vec![unknown("00000000:C0:00.0"), unknown("00000000:C1:00.0")],
            vec![unknown("00000000:C0:00.0"), unknown("00000000:C1:00.0")],
        ];
        let s = pair_scores(&node(fabric, P2pLink::SameCpu), &uuids(2)).unwrap();
        assert_eq!(score(&s, 0, 1), 220, "two switch links each");
        // Direct links read as Unknown are direct links, not switch links.
        let direct = vec![
            vec![unknown(&bus(1)), unknown(&bus(1))],
            vec![unknown(&bus(0)), unknown(&bus(0))],
            vec![],
        ];
        let s = pair_scores(&node(direct, P2pLink::SameCpu), &uuids(3)).unwrap();
        assert_eq!(
            (score(&s, 0, 1), score(&s, 0, 2), score(&s, 1, 2)),
            (220, 20, 20)
        );
    }

    #[test]
    fn switch_links_need_both_ends_and_a_readable_remote() {
        let sw = switch_link("00000000:C0:00.0", NvLinkRemote::Switch);
        let no_remote = NvLinkEnd {
            remote_pci_bus_id: None,
            remote: Some(NvLinkRemote::Switch),
        };
        // GPU-1 has no NVLink at all: GPU-0 sees only PCIe towards it, and so does GPU-1.
        let s = pair_scores(
            &node(vec![vec![sw.clone()], vec![]], P2pLink::SameCpu),
            &uuids(2),
        )
        .unwrap();
        assert_eq!(score(&s, 0, 1), 20);
        // GPU-0's switch link has no readable remote: HAMi does not look at switches for it,
        // but GPU-1 does, so the pair is asymmetric and scores 0.
        let s = pair_scores(
            &node(vec![vec![no_remote], vec![sw]], P2pLink::SameCpu),
            &uuids(2),
        )
        .unwrap();
        assert_eq!((score(&s, 0, 1), score(&s, 1, 0)), (0, 0));
        assert_eq!(s.asymmetric, vec![("GPU-0".to_owned(), "GPU-1".to_owned())]);
    }

    #[test]
    fn a_link_seen_from_one_end_only_scores_the_pair_zero() {
        // GPU-0 reports a link to GPU-1; GPU-1's link is down.
        let s = pair_scores(
            &node(vec![vec![gpu_link(&bus(1))], vec![]], P2pLink::SingleSwitch),
            &uuids(2),
        )
        .unwrap();
        assert_eq!((score(&s, 0, 1), score(&s, 1, 0)), (0, 0));
        assert_eq!(s.asymmetric.len(), 1);
        // Different link counts seen from the two ends still count as symmetric (HAMi compares
        // the number of entries only) and each end scores its own view.
        let s = pair_scores(
            &node(
                vec![vec![gpu_link(&bus(1))], vec![gpu_link(&bus(0)); 2]],
                P2pLink::SingleSwitch,
            ),
            &uuids(2),
        )
        .unwrap();
        assert_eq!((score(&s, 0, 1), score(&s, 1, 0)), (150, 250));
        assert!(s.asymmetric.is_empty());
    }

    #[test]
    fn more_than_eighteen_links_count_as_no_nvlink() {
        let s = pair_scores(
            &node(
                vec![vec![gpu_link(&bus(1)); 19], vec![gpu_link(&bus(0)); 19]],
                P2pLink::SameCpu,
            ),
            &uuids(2),
        )
        .unwrap();
        assert_eq!(score(&s, 0, 1), 20);
    }

    #[test]
    fn entries_follow_the_order_asked_for_and_skip_gpus_not_asked_for() {
        let links = vec![vec![gpu_link(&bus(2))], vec![], vec![gpu_link(&bus(0))]];
        let topo = node(links, P2pLink::HostBridge);
        let asked = vec!["GPU-2".to_owned(), "GPU-0".to_owned()];
        let s = pair_scores(&topo, &asked).unwrap();
        assert_eq!(
            crate::node::encode_pair_scores(&s.entries),
            r#"[{"uuid":"GPU-2","score":{"GPU-0":130}},{"uuid":"GPU-0","score":{"GPU-2":130}}]"#
        );
        assert_eq!(
            pair_scores(&topo, &["GPU-9".to_owned()]),
            Err(TopologyError::UnknownGpu("GPU-9".to_owned()))
        );
        assert_eq!(pair_scores(&topo, &[]).unwrap(), PairScores::default());
    }
}
