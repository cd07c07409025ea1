//! `simulate` for pods that use ResourceClaims: where kube-scheduler's DRA allocator could put
//! their claims on Tessera's devices (`gpu.tessera.dev`), from the ResourceSlices and the claims
//! already allocated in the input. Pure.
//!
//! What it models, as kube-scheduler 1.34 does with `DRAConsumableCapacity`: the devices of the
//! driver's slices per node; the capacity each allocated claim consumed (`consumedCapacity`);
//! a request's capacity rounded up by the device's request policy (a capacity the request does
//! not name takes the policy's default: for Tessera's devices, all of it); devices that allow one
//! allocation only; `count`, `allocationMode: All`, `firstAvailable`; `matchAttribute` and
//! `distinctAttribute` constraints; a named claim shared by several pods (allocated once).
//!
//! What it does not (each result says so where it matters): CEL selectors (of a request, or of a
//! DeviceClass not in the input) are not evaluated, so every device of the driver matches; node
//! selectors, affinity, taints and every non-DRA resource are kube-scheduler's; a pod's claims are
//! allocated one after the other, first fit, where kube-scheduler searches them together (a pod
//! whose claims fit only in another order is refused here); and the node chosen is the first by
//! name where every claim fits, where kube-scheduler picks among those by its scores.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceConstraint, DeviceRequest, ResourceClaim, ResourceClaimSpec,
    ResourceClaimTemplate, ResourceSlice,
};

/// Tessera's DRA driver.
pub const DRIVER: &str = "gpu.tessera.dev";
/// HAMi's DRA class name, which the chart also installs for Tessera's devices.
pub const HAMI_CLASS: &str = "hami-core-gpu.project-hami.io";

/// Results one claim may have, and requests one claim may make (the API server's limits:
/// `AllocationResultsMaxSize`, `DeviceRequestsMaxSize`).
const MAX_RESULTS: usize = 32;

/// Steps a claim's search may take on one node before simulate gives up on that node (a claim
/// with many requests over many devices and constraints could otherwise search for ever).
const SEARCH_BUDGET: usize = 100_000;

/// The DRA objects of a simulate input.
#[derive(Debug, Default, Clone)]
pub struct DraObjects {
    pub slices: Vec<ResourceSlice>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    pub classes: Vec<DeviceClass>,
}

/// One capacity of a device: what is left, and how requests are rounded.
#[derive(Debug, Clone)]
struct Capacity {
    total: i128,
    free: i128,
    default: Option<i128>,
    min: Option<i128>,
    max: Option<i128>,
    step: Option<i128>,
    valid_values: Vec<i128>,
}

impl Capacity {
    /// What a request of `asked` (None: not named) consumes, or why it cannot be served.
    fn consumption(&self, asked: Option<i128>) -> Option<i128> {
        let Some(v) = asked else {
            return Some(self.default.unwrap_or(self.total));
        };
        if !self.valid_values.is_empty() {
            return self.valid_values.iter().copied().filter(|&x| x >= v).min();
        }
        let min = self.min.unwrap_or(0);
        let mut c = v.max(min);
        if let Some(step) = self.step.filter(|&s| s > 0) {
            let over = c.checked_sub(min)? % step;
            if over != 0 {
                c = c.checked_add(step - over)?;
            }
        }
        match self.max {
            Some(max) if c > max => None,
            _ => Some(c),
        }
    }
}

#[derive(Debug, Clone)]
struct DeviceState {
    node: String,
    pool: String,
    name: String,
    multiple: bool,
    /// Allocations on the device (claims' results).
    allocations: usize,
    capacity: BTreeMap<String, Capacity>,
    /// Fully qualified attribute name → value.
    attributes: BTreeMap<String, String>,
}

impl DeviceState {
    fn label(&self) -> String {
        format!("{}/{}", self.pool, self.name)
    }
}

/// One allocated result: which device, and what it took of each capacity.
#[derive(Debug, Clone)]
struct Taken {
    request: String,
    device: usize,
    consumed: BTreeMap<String, i128>,
}

/// One request, as the search sees it.
#[derive(Debug, Clone)]
struct Ask {
    /// `request` or `request/subrequest`.
    name: String,
    /// The top-level request's name (constraints may name either).
    parent: String,
    all: bool,
    count: usize,
    capacity: BTreeMap<String, i128>,
}

/// One claim of a pod to allocate.
#[derive(Debug, Clone)]
struct ClaimAsk {
    /// The pod's name for the claim.
    pod_claim: String,
    /// `namespace/name` of a named ResourceClaim (booked as allocated once placed).
    claim_key: Option<String>,
    /// Each request's alternatives.
    requests: Vec<Vec<Ask>>,
    constraints: Vec<DeviceConstraint>,
}

/// The devices of every node and what is allocated on them.
#[derive(Debug)]
pub struct DraState {
    devices: Vec<DeviceState>,
    /// Claims allocated (input, or by an earlier simulated pod): `namespace/name` → node.
    allocated: BTreeMap<String, String>,
    /// Classes whose devices are the driver's: the input's DeviceClasses selecting it, else
    /// the two the chart installs.
    classes: BTreeSet<String>,
    claims: BTreeMap<String, ResourceClaim>,
    templates: BTreeMap<String, ResourceClaimTemplate>,
    /// Problems with the input's objects (reported once by the caller).
    pub warnings: Vec<String>,
}

/// Where a pod's claims went, or why not.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraPlacement {
    pub node: Option<String>,
    /// `claim <pod claim>, request <request>: <pool>/<device> memory=8Gi cores=25` per result.
    pub devices: Vec<String>,
    /// Why each node with the driver's devices could not take the pod's claims.
    pub reasons: BTreeMap<String, String>,
    /// What simulate did not evaluate for this pod.
    pub notes: Vec<String>,
    /// The pod could not be evaluated at all.
    pub error: Option<String>,
}

fn key(ns: Option<&str>, name: Option<&str>) -> String {
    format!("{}/{}", ns.unwrap_or("default"), name.unwrap_or_default())
}

fn whole(q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Option<i128> {
    hami_contract::quantity::parse(&q.0).ok().map(|q| q.ceil())
}

/// An attribute name as a constraint writes it: a bare name is in the driver's domain.
fn qualified(name: &str) -> String {
    if name.contains('/') {
        name.to_owned()
    } else {
        format!("{DRIVER}/{name}")
    }
}

fn attribute_text(a: &k8s_openapi::api::resource::v1::DeviceAttribute) -> Option<String> {
    if let Some(b) = a.bool {
        return Some(format!("bool:{b}"));
    }
    if let Some(i) = a.int {
        return Some(format!("int:{i}"));
    }
    if let Some(s) = &a.string {
        return Some(format!("string:{s}"));
    }
    a.version.as_ref().map(|v| format!("version:{v}"))
}

/// A quantity of bytes as people read it (`8Gi`, `1536Mi`).
fn bytes_text(b: i128) -> String {
    const MI: i128 = 1 << 20;
    const GI: i128 = 1 << 30;
    if b != 0 && b % GI == 0 {
        format!("{}Gi", b / GI)
    } else if b % MI == 0 {
        format!("{}Mi", b / MI)
    } else {
        b.to_string()
    }
}

/// A capacity's amount: memory as bytes people read, the rest as numbers.
fn amount_text(capacity: &str, v: i128) -> String {
    if capacity == "memory" {
        bytes_text(v)
    } else {
        v.to_string()
    }
}

/// `memory=8Gi cores=25`: memory first, then the others by name.
fn capacity_text(consumed: &BTreeMap<String, i128>) -> String {
    let memory = consumed.get_key_value("memory");
    memory
        .into_iter()
        .chain(consumed.iter().filter(|(k, _)| *k != "memory"))
        .map(|(k, v)| format!("{k}={}", amount_text(k, *v)))
        .collect::<Vec<_>>()
        .join(" ")
}

impl DraState {
    pub fn new(objects: &DraObjects) -> DraState {
        let mut warnings = Vec::new();
        let mut devices = Vec::new();
        for s in &objects.slices {
            if s.spec.driver != DRIVER {
                continue;
            }
            let Some(node) = s.spec.node_name.clone() else {
                warnings.push(format!(
                    "ResourceSlice {}: no nodeName; simulate models node-local slices only",
                    s.metadata.name.as_deref().unwrap_or_default()
                ));
                continue;
            };
            for d in s.spec.devices.iter().flatten() {
                let mut capacity = BTreeMap::new();
                for (name, c) in d.capacity.iter().flatten() {
                    let Some(total) = whole(&c.value) else {
                        warnings.push(format!(
                            "device {}/{}: capacity {name} {:?} is not a quantity; left out",
                            s.spec.pool.name, d.name, c.value.0
                        ));
                        continue;
                    };
                    let policy = c.request_policy.as_ref();
                    let range = policy.and_then(|p| p.valid_range.as_ref());
                    capacity.insert(
                        name.clone(),
                        Capacity {
                            total,
                            free: total,
                            default: policy.and_then(|p| p.default.as_ref()).and_then(whole),
                            min: range.and_then(|r| whole(&r.min)),
                            max: range.and_then(|r| r.max.as_ref()).and_then(whole),
                            step: range.and_then(|r| r.step.as_ref()).and_then(whole),
                            valid_values: policy
                                .and_then(|p| p.valid_values.as_ref())
                                .map(|v| v.iter().filter_map(whole).collect())
                                .unwrap_or_default(),
                        },
                    );
                }
                let attributes = d
                    .attributes
                    .iter()
                    .flatten()
                    .filter_map(|(k, v)| Some((qualified(k), attribute_text(v)?)))
                    .collect();
                devices.push(DeviceState {
                    node: node.clone(),
                    pool: s.spec.pool.name.clone(),
                    name: d.name.clone(),
                    multiple: d.allow_multiple_allocations == Some(true),
                    allocations: 0,
                    capacity,
                    attributes,
                });
            }
        }
        let classes = if objects.classes.is_empty() {
            [DRIVER.to_owned(), HAMI_CLASS.to_owned()].into()
        } else {
            objects
                .classes
                .iter()
                .filter(|c| {
                    c.spec.selectors.iter().flatten().any(|s| {
                        s.cel
                            .as_ref()
                            .is_some_and(|c| c.expression.contains(&format!("\"{DRIVER}\"")))
                    })
                })
                .filter_map(|c| c.metadata.name.clone())
                .collect()
        };
        let mut state = DraState {
            devices,
            allocated: BTreeMap::new(),
            classes,
            claims: BTreeMap::new(),
            templates: objects
                .templates
                .iter()
                .map(|t| {
                    (
                        key(t.metadata.namespace.as_deref(), t.metadata.name.as_deref()),
                        t.clone(),
                    )
                })
                .collect(),
            warnings,
        };
        for c in &objects.claims {
            let k = key(c.metadata.namespace.as_deref(), c.metadata.name.as_deref());
            state.book_allocated(&k, c);
            state.claims.insert(k, c.clone());
        }
        state
    }

    /// Books what an allocated claim of the input holds.
    fn book_allocated(&mut self, claim_key: &str, claim: &ResourceClaim) {
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        let Some(results) = results else { return };
        for r in results.iter().filter(|r| r.driver == DRIVER) {
            let Some(device) = self
                .devices
                .iter()
                .position(|d| d.pool == r.pool && d.name == r.device)
            else {
                self.warnings.push(format!(
                    "claim {claim_key}: device {}/{} is in no ResourceSlice of the input",
                    r.pool, r.device
                ));
                continue;
            };
            let consumed = r
                .consumed_capacity
                .iter()
                .flatten()
                .filter_map(|(name, q)| {
                    let name = name.strip_prefix(&format!("{DRIVER}/")).unwrap_or(name);
                    Some((name.to_owned(), whole(q)?))
                })
                .collect();
            self.book(&Taken {
                request: r.request.clone(),
                device,
                consumed,
            });
            self.allocated
                .insert(claim_key.to_owned(), self.devices[device].node.clone());
        }
    }

    /// Counts one result against its device.
    fn book(&mut self, t: &Taken) {
        let d = &mut self.devices[t.device];
        d.allocations += 1;
        for (name, v) in &t.consumed {
            if let Some(c) = d.capacity.get_mut(name) {
                c.free = c.free.saturating_sub(*v);
            }
        }
    }

    /// The nodes with the driver's devices, by name.
    fn nodes(&self) -> BTreeSet<String> {
        self.devices.iter().map(|d| d.node.clone()).collect()
    }

    /// Where `pod`'s claims could be allocated; the chosen node's allocation is booked for the
    /// pods after it.
    pub fn place(&mut self, pod: &Pod) -> DraPlacement {
        let mut out = DraPlacement::default();
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let pod_claims = pod
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .cloned()
            .unwrap_or_default();
        // (pod claim name, claim key if named, spec), or already allocated on a node.
        let mut to_allocate: Vec<(String, Option<String>, ResourceClaimSpec)> = Vec::new();
        let mut pinned: Option<(String, String)> = None;
        for pc in &pod_claims {
            if let Some(name) = &pc.resource_claim_name {
                let k = key(Some(ns), Some(name));
                if let Some(node) = self.allocated.get(&k) {
                    if let Some((other, elsewhere)) = pinned.as_ref().filter(|(_, n)| n != node) {
                        out.error = Some(format!(
                            "claim {k} is allocated on {node} and claim {other} on {elsewhere}: no node has both"
                        ));
                        return out;
                    }
                    pinned = Some((k, node.clone()));
                    continue;
                }
                match self.claims.get(&k) {
                    Some(c) => to_allocate.push((pc.name.clone(), Some(k), c.spec.clone())),
                    None => {
                        out.error = Some(format!(
                            "ResourceClaim {k} (claim {}) is not in the input",
                            pc.name
                        ));
                        return out;
                    }
                }
            } else if let Some(t) = &pc.resource_claim_template_name {
                let k = key(Some(ns), Some(t));
                match self.templates.get(&k) {
                    Some(t) => to_allocate.push((pc.name.clone(), None, t.spec.spec.clone())),
                    None => {
                        out.error = Some(format!(
                            "ResourceClaimTemplate {k} (claim {}) is not in the input",
                            pc.name
                        ));
                        return out;
                    }
                }
            }
        }
        // Every request must be for the driver's devices.
        let mut asks: Vec<ClaimAsk> = Vec::new();
        for (pod_claim, claim_key, spec) in &to_allocate {
            let devices = spec.devices.clone().unwrap_or_default();
            let mut requests = Vec::new();
            let listed = devices.requests.as_ref().map_or(0, Vec::len);
            if listed > MAX_RESULTS {
                out.error = Some(format!(
                    "claim {pod_claim}: {listed} requests; a claim has at most {MAX_RESULTS}"
                ));
                return out;
            }
            for r in devices.requests.iter().flatten() {
                match self.alternatives(r, &mut out.notes) {
                    Ok(a) => requests.push(a),
                    Err(e) => {
                        out.error = Some(format!("claim {pod_claim}, request {}: {e}", r.name));
                        return out;
                    }
                }
            }
            asks.push(ClaimAsk {
                pod_claim: pod_claim.clone(),
                claim_key: claim_key.clone(),
                requests,
                constraints: devices.constraints.unwrap_or_default(),
            });
        }
        out.notes.sort();
        out.notes.dedup();
        let nodes: Vec<String> = match &pinned {
            Some((_, node)) => vec![node.clone()],
            None => self.nodes().into_iter().collect(),
        };
        if nodes.is_empty() {
            out.error = Some(format!(
                "no node has {DRIVER} devices in the input's ResourceSlices"
            ));
            return out;
        }
        for node in nodes {
            // The results of the pod's claims so far on this node: booked only if all fit.
            let mut earlier: Vec<Taken> = Vec::new();
            let mut failed = None;
            for ClaimAsk {
                pod_claim,
                requests,
                constraints,
                ..
            } in &asks
            {
                match self.allocate_on(&node, requests, constraints, &earlier) {
                    Ok(taken) => {
                        for t in &taken {
                            let took = if t.consumed.is_empty() {
                                "(the whole device)".to_owned()
                            } else {
                                capacity_text(&t.consumed)
                            };
                            out.devices.push(format!(
                                "claim {pod_claim}, request {}: {} {took}",
                                t.request,
                                self.devices[t.device].label(),
                            ));
                        }
                        earlier.extend(taken);
                    }
                    Err(why) => {
                        failed = Some(format!("claim {pod_claim}: {why}"));
                        break;
                    }
                }
            }
            if let Some(why) = failed {
                out.devices.clear();
                out.reasons.insert(node, why);
                continue;
            }
            for t in &earlier {
                self.book(t);
            }
            for k in asks.iter().filter_map(|a| a.claim_key.as_ref()) {
                self.allocated.insert(k.clone(), node.clone());
            }
            out.node = Some(node);
            return out;
        }
        if let Some((k, node)) = pinned {
            out.reasons
                .entry(node)
                .and_modify(|r| r.push_str(&format!(" (claim {k} is allocated on this node)")));
        }
        out
    }

    /// A request's alternatives (one, or its `firstAvailable` subrequests in order).
    fn alternatives(&self, r: &DeviceRequest, notes: &mut Vec<String>) -> Result<Vec<Ask>, String> {
        let mut out = Vec::new();
        let mut one = |name: String,
                       class: &str,
                       mode: Option<&str>,
                       count: Option<i64>,
                       selectors: bool,
                       admin: bool,
                       capacity: Option<&k8s_openapi::api::resource::v1::CapacityRequirements>|
         -> Result<(), String> {
            if !self.classes.contains(class) {
                return Err(format!(
                    "DeviceClass {class:?} does not select {DRIVER} devices; simulate models {DRIVER} only"
                ));
            }
            if selectors {
                notes.push(format!(
                    "request {name}: CEL selectors are not evaluated; every {DRIVER} device counts as matching"
                ));
            }
            if admin {
                notes.push(format!(
                    "request {name}: adminAccess does not consume capacity in kube-scheduler; simulate counts it like any request"
                ));
            }
            let mut caps = BTreeMap::new();
            for (k, q) in capacity
                .and_then(|c| c.requests.as_ref())
                .into_iter()
                .flatten()
            {
                let v =
                    whole(q).ok_or_else(|| format!("capacity {k} {:?} is not a quantity", q.0))?;
                caps.insert(
                    k.strip_prefix(&format!("{DRIVER}/"))
                        .unwrap_or(k)
                        .to_owned(),
                    v,
                );
            }
            let all = mode == Some("All");
            let count = usize::try_from(count.unwrap_or(1).max(1)).unwrap_or(usize::MAX);
            if count > MAX_RESULTS {
                return Err(format!(
                    "count {count} is more than the {MAX_RESULTS} devices a claim can be allocated"
                ));
            }
            out.push(Ask {
                name,
                parent: r.name.clone(),
                all,
                count,
                capacity: caps,
            });
            Ok(())
        };
        if let Some(e) = &r.exactly {
            one(
                r.name.clone(),
                &e.device_class_name,
                e.allocation_mode.as_deref(),
                e.count,
                e.selectors.as_ref().is_some_and(|s| !s.is_empty()),
                e.admin_access == Some(true),
                e.capacity.as_ref(),
            )?;
        }
        for s in r.first_available.iter().flatten() {
            one(
                format!("{}/{}", r.name, s.name),
                &s.device_class_name,
                s.allocation_mode.as_deref(),
                s.count,
                s.selectors.as_ref().is_some_and(|s| !s.is_empty()),
                false,
                s.capacity.as_ref(),
            )?;
        }
        if out.is_empty() {
            return Err("neither exactly nor firstAvailable".to_owned());
        }
        Ok(out)
    }

    /// What serving `ask` on device `i` would consume, given what the pod's earlier claims and
    /// this claim already took.
    fn fits(
        &self,
        i: usize,
        ask: &Ask,
        earlier: &[Taken],
        taken: &[Taken],
    ) -> Result<BTreeMap<String, i128>, String> {
        let on_device = || earlier.iter().chain(taken).filter(move |t| t.device == i);
        let d = &self.devices[i];
        for k in ask.capacity.keys() {
            if !d.capacity.contains_key(k) {
                return Err(format!("{} has no capacity {k}", d.label()));
            }
        }
        if !d.multiple && d.allocations + on_device().count() > 0 {
            return Err(format!("{} is allocated whole", d.label()));
        }
        let mut consumed = BTreeMap::new();
        for (name, c) in &d.capacity {
            let asked = ask.capacity.get(name).copied();
            if !d.multiple {
                if asked.is_some_and(|v| v > c.total) {
                    return Err(format!("{} has {name} {}", d.label(), c.total));
                }
                continue;
            }
            let Some(use_) = c.consumption(asked) else {
                return Err(format!(
                    "{}: {name} {} is outside its request policy",
                    d.label(),
                    asked.unwrap_or_default()
                ));
            };
            let already = on_device()
                .filter_map(|t| t.consumed.get(name))
                .fold(0i128, |a, b| a.saturating_add(*b));
            let free = c.free.saturating_sub(already);
            if use_ > free {
                return Err(format!(
                    "{} has {} {name} free, needs {}",
                    d.label(),
                    amount_text(name, free.max(0)),
                    amount_text(name, use_)
                ));
            }
            consumed.insert(name.clone(), use_);
        }
        Ok(consumed)
    }

    /// Allocates one claim's requests on `node` (depth first over its results, devices in
    /// slice order), or says why not.
    fn allocate_on(
        &self,
        node: &str,
        requests: &[Vec<Ask>],
        constraints: &[DeviceConstraint],
        earlier: &[Taken],
    ) -> Result<Vec<Taken>, String> {
        let on_node: Vec<usize> = (0..self.devices.len())
            .filter(|&i| self.devices[i].node == node)
            .collect();
        let mut search = Search {
            state: self,
            on_node: &on_node,
            earlier,
            constraints,
            budget: SEARCH_BUDGET,
            why: Vec::new(),
        };
        let mut taken = Vec::new();
        if search.requests(requests, &mut taken) {
            Ok(taken)
        } else if search.budget == 0 {
            Err("the search for an allocation took too many steps; simulate gave up".to_owned())
        } else {
            Err(if search.why.is_empty() {
                "no allocation satisfies the claim's constraints".to_owned()
            } else {
                search.why.join("; ")
            })
        }
    }
}

/// The two attribute constraints.
#[derive(Debug, Clone, Copy)]
enum Rule {
    Match,
    Distinct,
}

impl Rule {
    fn field(self) -> &'static str {
        match self {
            Rule::Match => "matchAttribute",
            Rule::Distinct => "distinctAttribute",
        }
    }

    fn refusal(self, attr: &str) -> String {
        match self {
            Rule::Match => format!("no devices with the same {attr} have room (matchAttribute)"),
            Rule::Distinct => {
                format!("not enough devices with distinct {attr} have room (distinctAttribute)")
            }
        }
    }
}

struct Search<'a> {
    state: &'a DraState,
    on_node: &'a [usize],
    /// Results of the pod's earlier claims on this node (capacity only: constraints are per
    /// claim).
    earlier: &'a [Taken],
    constraints: &'a [DeviceConstraint],
    budget: usize,
    /// The refusals seen, for the reason (the first few, each once).
    why: Vec<String>,
}

/// Refusals a reason lists at most.
const REASONS_SHOWN: usize = 3;

impl Search<'_> {
    fn refused(&mut self, why: String) {
        if self.why.len() < REASONS_SHOWN && !self.why.contains(&why) {
            self.why.push(why);
        }
    }
}

impl Search<'_> {
    fn requests(&mut self, requests: &[Vec<Ask>], taken: &mut Vec<Taken>) -> bool {
        let Some((alternatives, rest)) = requests.split_first() else {
            return true;
        };
        for ask in alternatives {
            let before = taken.len();
            let slots = if ask.all { usize::MAX } else { ask.count };
            if self.results(ask, slots, rest, taken) {
                return true;
            }
            taken.truncate(before);
        }
        false
    }

    /// Places `left` more results of `ask` (all matching devices when `ask.all`), then the
    /// remaining requests.
    fn results(
        &mut self,
        ask: &Ask,
        left: usize,
        rest: &[Vec<Ask>],
        taken: &mut Vec<Taken>,
    ) -> bool {
        if ask.all {
            // Every device of the node, each once.
            if taken.len() + self.on_node.len() > MAX_RESULTS {
                self.refused(format!(
                    "request {}: allocationMode All would take {} devices; a claim has at most {MAX_RESULTS}",
                    ask.name,
                    self.on_node.len()
                ));
                return false;
            }
            for &i in self.on_node {
                match self.state.fits(i, ask, self.earlier, taken) {
                    Ok(consumed) if self.allowed(i, ask, taken) => taken.push(Taken {
                        request: ask.name.clone(),
                        device: i,
                        consumed,
                    }),
                    Ok(_) => return false,
                    Err(e) => {
                        self.refused(format!("request {}: {e}", ask.name));
                        return false;
                    }
                }
            }
            return !self.on_node.is_empty() && self.requests(rest, taken);
        }
        if left == 0 {
            return self.requests(rest, taken);
        }
        if taken.len() >= MAX_RESULTS {
            self.refused(format!(
                "request {}: a claim has at most {MAX_RESULTS} results",
                ask.name
            ));
            return false;
        }
        for &i in self.on_node {
            if self.budget == 0 {
                return false;
            }
            self.budget -= 1;
            let consumed = match self.state.fits(i, ask, self.earlier, taken) {
                Ok(c) => c,
                Err(e) => {
                    self.refused(format!("request {}: {e}", ask.name));
                    continue;
                }
            };
            if !self.allowed(i, ask, taken) {
                continue;
            }
            taken.push(Taken {
                request: ask.name.clone(),
                device: i,
                consumed,
            });
            if self.results(ask, left - 1, rest, taken) {
                return true;
            }
            taken.pop();
        }
        false
    }

    /// Whether device `i` for `ask` keeps every constraint with the results so far.
    fn allowed(&mut self, i: usize, ask: &Ask, taken: &[Taken]) -> bool {
        let applies = |c: &DeviceConstraint, request: &str, parent: &str| {
            c.requests
                .as_ref()
                .is_none_or(|r| r.is_empty() || r.iter().any(|n| n == request || n == parent))
        };
        let parent_of = |t: &Taken| t.request.split('/').next().unwrap_or_default().to_owned();
        let device = &self.state.devices[i];
        for c in self.constraints {
            if !applies(c, &ask.name, &ask.parent) {
                continue;
            }
            let others = taken
                .iter()
                .filter(|t| applies(c, &t.request, &parent_of(t)))
                .map(|t| &self.state.devices[t.device]);
            let checks = [
                (c.match_attribute.as_ref(), Rule::Match),
                (c.distinct_attribute.as_ref(), Rule::Distinct),
            ];
            for (attr, rule) in checks {
                let Some(attr) = attr.map(|a| qualified(a)) else {
                    continue;
                };
                let Some(mine) = device.attributes.get(&attr) else {
                    self.refused(format!(
                        "request {}: {} has no attribute {attr} ({})",
                        ask.name,
                        device.label(),
                        rule.field()
                    ));
                    return false;
                };
                let broken = match rule {
                    Rule::Match => others
                        .clone()
                        .any(|o| o.attributes.get(&attr) != Some(mine)),
                    Rule::Distinct => others
                        .clone()
                        .any(|o| o.attributes.get(&attr) == Some(mine)),
                };
                if broken {
                    self.refused(format!("request {}: {}", ask.name, rule.refusal(&attr)));
                    return false;
                }
            }
        }
        true
    }
}
