//! From a container's resources to HAMi's `ContainerDeviceRequest` (contract §1.2, §1.3), and
//! the admission webhook's mutation of one container (contract §7).

use std::collections::BTreeMap;
use std::fmt;

use crate::NVIDIA_VENDOR;
use crate::config::{GpuCorePolicy, NvidiaConfig};
use crate::quantity::{self, Quantity};
use crate::resources::MEM_PERCENTAGE_UNSET;

/// Env the webhook sets from `nvidia.com/priority` (HAMi-core: `0` high, `1` low).
pub const ENV_TASK_PRIORITY: &str = "CUDA_TASK_PRIORITY";
/// Env the webhook sets from a non-default `gpuCorePolicy`.
pub const ENV_CORE_UTILIZATION_POLICY: &str = "GPU_CORE_UTILIZATION_POLICY";
/// Env the webhook sets to `none` on GPU-less containers when `overwriteEnv` is on.
pub const ENV_NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// The parts of a Kubernetes container HAMi reads: its name, resource quantities exactly as the
/// API server gives them (`"3000"`, `"16Gi"`), and its plain env values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerResources {
    /// Container name (for messages).
    pub name: String,
    /// `resources.limits`.
    pub limits: BTreeMap<String, String>,
    /// `resources.requests`.
    pub requests: BTreeMap<String, String>,
    /// `env` entries with a literal `value`.
    pub env: BTreeMap<String, String>,
}

impl ContainerResources {
    /// HAMi's lookup order: `limits` first, then `requests`. An empty name is never present.
    pub fn quantity(&self, name: &str) -> Option<&str> {
        if name.is_empty() {
            return None;
        }
        self.limits
            .get(name)
            .or_else(|| self.requests.get(name))
            .map(String::as_str)
    }

    fn in_limits(&self, name: &str) -> bool {
        !name.is_empty() && self.limits.contains_key(name)
    }
}

/// HAMi's `ContainerDeviceRequest`: what one container asks of the NVIDIA vendor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerDeviceRequest {
    /// `Nums`: number of distinct GPUs (always ≥ 1 here).
    pub nums: u32,
    /// `Type`: the vendor key, `NVIDIA`.
    pub vendor: String,
    /// `Memreq`: MiB per GPU, already multiplied by `memoryFactor`; 0 = use the percentage.
    pub memreq: u32,
    /// `MemPercentagereq`: percent of each card's memory, 1..=100, or
    /// [`MEM_PERCENTAGE_UNSET`] (101) when not asked.
    pub mem_percentage_req: u32,
    /// `Coresreq`: percent of SMs per GPU, as asked (Fit clamps values above 100, see
    /// [`ContainerDeviceRequest::cores_on`]).
    pub coresreq: u32,
}

impl ContainerDeviceRequest {
    /// The memory HAMi's Fit books on a device with `device_totalmem` MiB: `memreq` when > 0,
    /// otherwise `floor(totalmem × percentage / 100)` when a percentage is set, otherwise 0.
    pub fn memory_on(&self, device_totalmem: u32) -> u32 {
        if self.memreq > 0 {
            self.memreq
        } else if self.mem_percentage_req != MEM_PERCENTAGE_UNSET {
            let pct = u64::from(self.mem_percentage_req.min(100));
            // ≤ totalmem, so it fits back into u32.
            (u64::from(device_totalmem) * pct / 100) as u32
        } else {
            0
        }
    }

    /// The cores HAMi's Fit books: `coresreq`, clamped to 100.
    pub fn cores_on(&self) -> u32 {
        self.coresreq.min(100)
    }

    /// True for HAMi's "exclusive card" request (`gpucores: 100`).
    pub fn is_exclusive(&self) -> bool {
        self.coresreq >= 100
    }
}

/// Something about a container's GPU resources a user should be told, although the pod is not
/// refused for it (the scheduler surfaces these as events / logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestWarning {
    /// HAMi ignores the container's whole GPU request (treats it as "no HAMi request") because
    /// `gpumem` is not a whole number of MiB that fits int32 after `memoryFactor`.
    MemoryIgnored {
        /// Container name.
        container: String,
        /// Memory resource name (`nvidia.com/gpumem`).
        resource: String,
        /// The quantity as written (`16Gi`).
        value: String,
        /// Why it is not usable.
        reason: String,
    },
    /// `gpumem` had a unit suffix or exponent (`4Ki`, `1e3`): HAMi reads the resulting number as
    /// MiB, which is rarely what the writer meant.
    MemorySuffix {
        /// Container name.
        container: String,
        /// Memory resource name.
        resource: String,
        /// The quantity as written.
        value: String,
        /// The MiB it was read as (before `memoryFactor`).
        mib: u64,
    },
    /// The count is not a positive whole number, so the container has no HAMi request.
    CountIgnored {
        /// Container name.
        container: String,
        /// Count resource name.
        resource: String,
        /// The quantity as written.
        value: String,
    },
    /// A percentage or cores value that HAMi cannot use was replaced by the default.
    ValueIgnored {
        /// Container name.
        container: String,
        /// Resource name.
        resource: String,
        /// The quantity as written.
        value: String,
        /// What was used instead.
        used_instead: String,
    },
}

impl fmt::Display for RequestWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestWarning::MemoryIgnored {
                container,
                resource,
                value,
                reason,
            } => write!(
                f,
                "container {container}: {resource}={value:?} {reason}; HAMi ignores the whole GPU request of this container \
                 ({resource} is a plain integer number of MiB, e.g. 16384 for 16 GiB)"
            ),
            RequestWarning::MemorySuffix {
                container,
                resource,
                value,
                mib,
            } => write!(
                f,
                "container {container}: {resource}={value:?} is read as {mib} MiB ({resource} is a plain integer number of MiB)"
            ),
            RequestWarning::CountIgnored {
                container,
                resource,
                value,
            } => write!(
                f,
                "container {container}: {resource}={value:?} is not a positive whole number of GPUs; the container gets no HAMi GPU"
            ),
            RequestWarning::ValueIgnored {
                container,
                resource,
                value,
                used_instead,
            } => write!(
                f,
                "container {container}: {resource}={value:?} cannot be used; {used_instead} is used instead"
            ),
        }
    }
}

/// The resolution of one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerRequest {
    /// The HAMi request, `None` when the container asks for no NVIDIA GPU (or HAMi would ignore
    /// what it asks, see `warnings`).
    pub request: Option<ContainerDeviceRequest>,
    /// What the user should be told about this container's GPU resources.
    pub warnings: Vec<RequestWarning>,
}

fn parse_integer(text: &str) -> Option<(i128, Quantity)> {
    let q = quantity::parse(text).ok()?;
    Some((q.as_integer()?, q))
}

/// HAMi's `GenerateResourceRequests` for one container (contract §1.2):
/// - every value is read from `limits` first, then `requests`;
/// - no count (or a count that is not a positive whole number) ⇒ no request;
/// - `gpumem` must be a whole number of MiB that fits int32 after `memoryFactor`
///   (`16Gi`, `16.0Gi` do not): otherwise HAMi ignores the whole request — reproduced here,
///   with a [`RequestWarning::MemoryIgnored`];
/// - a percentage ≤ 0 is unset (101), > 100 is 100;
/// - neither memory nor a percentage ⇒ `defaultMemory` (not multiplied) if set, else 100 %;
/// - cores default to `defaultCores`.
pub fn resolve_container(c: &ContainerResources, cfg: &NvidiaConfig) -> ContainerRequest {
    let names = &cfg.resources;
    let mut warnings = Vec::new();
    let Some(count_text) = c.quantity(&names.count) else {
        return ContainerRequest::default();
    };
    let nums = match parse_integer(count_text) {
        Some((n, _)) if n > 0 && n <= i128::from(i32::MAX) => n as u32,
        Some((0, _)) => return ContainerRequest::default(),
        _ => {
            warnings.push(RequestWarning::CountIgnored {
                container: c.name.clone(),
                resource: names.count.clone(),
                value: count_text.to_owned(),
            });
            return ContainerRequest {
                request: None,
                warnings,
            };
        }
    };

    let mut memreq: u32 = 0;
    if let Some(mem_text) = c.quantity(&names.memory) {
        let ignored = |reason: &str| RequestWarning::MemoryIgnored {
            container: c.name.clone(),
            resource: names.memory.clone(),
            value: mem_text.to_owned(),
            reason: reason.to_owned(),
        };
        match parse_integer(mem_text) {
            None => {
                warnings.push(ignored("is not a whole number"));
                return ContainerRequest {
                    request: None,
                    warnings,
                };
            }
            Some((v, q)) => {
                let scaled = v.checked_mul(i128::from(cfg.effective_memory_factor()));
                match scaled {
                    Some(s) if (0..=i128::from(i32::MAX)).contains(&s) => {
                        if !q.is_plain_integer() {
                            warnings.push(RequestWarning::MemorySuffix {
                                container: c.name.clone(),
                                resource: names.memory.clone(),
                                value: mem_text.to_owned(),
                                mib: v as u64,
                            });
                        }
                        memreq = s as u32;
                    }
                    Some(s) if s < 0 => {
                        warnings.push(ignored("is negative"));
                        return ContainerRequest {
                            request: None,
                            warnings,
                        };
                    }
                    _ => {
                        warnings.push(ignored(&format!(
                            "is {v} MiB, more than a signed 32-bit integer holds after memoryFactor {}",
                            cfg.effective_memory_factor()
                        )));
                        return ContainerRequest {
                            request: None,
                            warnings,
                        };
                    }
                }
            }
        }
    }

    let mut mem_percentage_req = MEM_PERCENTAGE_UNSET;
    if let Some(pct_text) = c.quantity(&names.memory_percentage) {
        match parse_integer(pct_text) {
            Some((v, _)) if v > 0 => mem_percentage_req = v.min(100) as u32,
            Some((_, _)) => {} // ≤ 0: unset, as in HAMi's table (`gpumem-percentage: 0` ⇒ 100 %).
            None => warnings.push(RequestWarning::ValueIgnored {
                container: c.name.clone(),
                resource: names.memory_percentage.clone(),
                value: pct_text.to_owned(),
                used_instead: "no percentage".into(),
            }),
        }
    }
    if mem_percentage_req == MEM_PERCENTAGE_UNSET && memreq == 0 {
        if cfg.default_memory != 0 {
            memreq = cfg.default_memory;
        } else {
            mem_percentage_req = 100;
        }
    }

    let mut coresreq = cfg.default_cores;
    if let Some(cores_text) = c.quantity(&names.cores) {
        match parse_integer(cores_text) {
            Some((v, _)) if (0..=i128::from(i32::MAX)).contains(&v) => coresreq = v as u32,
            _ => warnings.push(RequestWarning::ValueIgnored {
                container: c.name.clone(),
                resource: names.cores.clone(),
                value: cores_text.to_owned(),
                used_instead: format!("defaultCores {}", cfg.default_cores),
            }),
        }
    }

    ContainerRequest {
        request: Some(ContainerDeviceRequest {
            nums,
            vendor: NVIDIA_VENDOR.to_owned(),
            memreq,
            mem_percentage_req,
            coresreq,
        }),
        warnings,
    }
}

/// The NVIDIA requests of a whole pod, one entry per container, in spec order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodRequests {
    /// Init containers (sidecars included), in spec order.
    pub init: Vec<Option<ContainerDeviceRequest>>,
    /// App containers, in spec order.
    pub app: Vec<Option<ContainerDeviceRequest>>,
    /// Warnings of all containers.
    pub warnings: Vec<RequestWarning>,
}

impl PodRequests {
    /// True when no container asks for an NVIDIA GPU: HAMi leaves the pod alone.
    pub fn is_empty(&self) -> bool {
        self.init.iter().chain(&self.app).all(Option::is_none)
    }

    /// All entries in container device list order: init containers first, then app containers.
    pub fn in_annotation_order(&self) -> impl Iterator<Item = &Option<ContainerDeviceRequest>> {
        self.init.iter().chain(&self.app)
    }
}

/// What a pod counts against its namespace's HAMi ResourceQuota at admission (contract §5.7):
/// per field, the larger of the app containers' sum and the largest init container. Memory is
/// `memreq × nums` (a percentage request counts 0 here: the card is not known yet), cores
/// `coresreq × nums`. Compare memory with the quota's `limits.<resourceMemoryName>` multiplied
/// by `memoryFactor` (`memreq` already is).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaRequest {
    /// MiB.
    pub memory: u64,
    /// Percent of one GPU's SMs, summed over GPUs.
    pub cores: u64,
}

impl PodRequests {
    /// The pod's [`QuotaRequest`].
    pub fn quota_request(&self) -> QuotaRequest {
        let of = |r: &ContainerDeviceRequest| {
            (
                u64::from(r.memreq) * u64::from(r.nums),
                u64::from(r.coresreq) * u64::from(r.nums),
            )
        };
        let (mut app_mem, mut app_cores, mut init_mem, mut init_cores) = (0u64, 0u64, 0u64, 0u64);
        for (m, c) in self.app.iter().flatten().map(of) {
            app_mem = app_mem.saturating_add(m);
            app_cores = app_cores.saturating_add(c);
        }
        for (m, c) in self.init.iter().flatten().map(of) {
            init_mem = init_mem.max(m);
            init_cores = init_cores.max(c);
        }
        QuotaRequest {
            memory: app_mem.max(init_mem),
            cores: app_cores.max(init_cores),
        }
    }
}

/// [`resolve_container`] over every container of a pod.
pub fn resolve_pod(
    init: &[ContainerResources],
    app: &[ContainerResources],
    cfg: &NvidiaConfig,
) -> PodRequests {
    let mut out = PodRequests::default();
    for (containers, into) in [(init, &mut out.init), (app, &mut out.app)] {
        for c in containers {
            let r = resolve_container(c, cfg);
            into.push(r.request);
            out.warnings.extend(r.warnings);
        }
    }
    out
}

/// What the webhook changes in one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerMutation {
    /// The container uses HAMi GPUs (after the changes below). When true for any container, the
    /// webhook sets `schedulerName` (and `runtimeClassName` if configured and unset).
    pub has_resource: bool,
    /// Limits to add, `(resource name, quantity)`, in the order HAMi adds them.
    pub add_limits: Vec<(String, String)>,
    /// Env vars to append, `(name, value)`, in the order HAMi appends them.
    pub add_env: Vec<(String, String)>,
}

/// Why the webhook refuses a container.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// HAMi's exact message for a percentage outside 0..=100 (or not an integer).
    #[error(
        "invalid {resource} value {value} in container {container}: must be an integer between 0 and 100"
    )]
    PercentageOutOfRange {
        /// Resource name (`nvidia.com/gpumem-percentage`).
        resource: String,
        /// As written.
        value: String,
        /// Container name.
        container: String,
    },
    /// Tessera only: cores above 100 (HAMi silently clamps them to 100 in Fit).
    #[error(
        "invalid {resource} value {value} in container {container}: must be an integer between 0 and 100 (percent of one GPU's SMs)"
    )]
    CoresOutOfRange {
        /// Resource name (`nvidia.com/gpucores`).
        resource: String,
        /// As written.
        value: String,
        /// Container name.
        container: String,
    },
    /// Tessera only: memory that HAMi would silently ignore (`16Gi`, overflow).
    #[error(
        "invalid {resource} value {value} in container {container}: must be a plain integer number of MiB that fits a signed 32-bit integer after memoryFactor {factor} (e.g. 16384 for 16 GiB); HAMi would ignore this container's GPU request"
    )]
    MemoryNotMib {
        /// Resource name (`nvidia.com/gpumem`).
        resource: String,
        /// As written.
        value: String,
        /// Container name.
        container: String,
        /// The configured memory factor.
        factor: u32,
    },
}

/// The webhook's `MutateAdmission` for one container (contract §1.3, §7), as data:
/// 1. refuse a percentage outside 0..=100, cores above 100, and memory that is not a plain
///    number of MiB fitting int32 after `memoryFactor` (the last two are Tessera's: HAMi admits
///    them and then clamps / ignores them);
/// 2. env `CUDA_TASK_PRIORITY=<priority limit, rounded up>` when the priority limit exists;
/// 3. env `GPU_CORE_UTILIZATION_POLICY=<policy>` when `gpuCorePolicy` is not `default`;
/// 4. count defaulting: count not in limits but memory / percentage / cores in limits and
///    `defaultGPUNum > 0` ⇒ add `<count>: <defaultGPUNum>`;
/// 5. exclusive-core defaulting: count present (limits or requests, or just added), no cores,
///    and the percentage is 100, or there is no percentage and no memory ⇒ add `<cores>: 100`;
/// 6. no resource and `overwriteEnv` ⇒ env `NVIDIA_VISIBLE_DEVICES=none`.
///
/// A count given only in `requests` together with `gpumem` is not detected (HAMi quirk B.10).
pub fn webhook_mutation(
    c: &ContainerResources,
    cfg: &NvidiaConfig,
) -> Result<ContainerMutation, RequestError> {
    let names = &cfg.resources;
    if let Some(v) = c.quantity(&names.memory_percentage) {
        let ok = parse_integer(v).is_some_and(|(p, _)| (0..=100).contains(&p));
        if !ok {
            return Err(RequestError::PercentageOutOfRange {
                resource: names.memory_percentage.clone(),
                value: v.to_owned(),
                container: c.name.clone(),
            });
        }
    }
    if let Some(v) = c.quantity(&names.cores) {
        let ok = parse_integer(v).is_some_and(|(p, _)| (0..=100).contains(&p));
        if !ok {
            return Err(RequestError::CoresOutOfRange {
                resource: names.cores.clone(),
                value: v.to_owned(),
                container: c.name.clone(),
            });
        }
    }
    if let Some(v) = c.quantity(&names.memory) {
        let factor = cfg.effective_memory_factor();
        let ok = quantity::parse(v).is_ok_and(|q| {
            q.is_plain_integer()
                && q.as_integer()
                    .and_then(|m| m.checked_mul(i128::from(factor)))
                    .is_some_and(|m| (0..=i128::from(i32::MAX)).contains(&m))
        });
        if !ok {
            return Err(RequestError::MemoryNotMib {
                resource: names.memory.clone(),
                value: v.to_owned(),
                container: c.name.clone(),
                factor,
            });
        }
    }

    let mut m = ContainerMutation::default();
    if !names.priority.is_empty()
        && let Some(p) = c.limits.get(&names.priority)
    {
        // Go's `Quantity.Value()`; an unparsable quantity cannot reach the webhook (the API
        // server validates quantities), so it is simply skipped.
        if let Ok(q) = quantity::parse(p) {
            m.add_env
                .push((ENV_TASK_PRIORITY.to_owned(), q.ceil().to_string()));
        }
    }
    if cfg.gpu_core_policy != GpuCorePolicy::Default {
        m.add_env.push((
            ENV_CORE_UTILIZATION_POLICY.to_owned(),
            cfg.gpu_core_policy.as_str().to_owned(),
        ));
    }

    let mut count_present = !names.count.is_empty() && c.quantity(&names.count).is_some();
    if c.in_limits(&names.count) {
        m.has_resource = true;
    } else if (c.in_limits(&names.cores)
        || c.in_limits(&names.memory)
        || c.in_limits(&names.memory_percentage))
        && cfg.default_gpu_num > 0
        && !names.count.is_empty()
    {
        m.add_limits
            .push((names.count.clone(), cfg.default_gpu_num.to_string()));
        m.has_resource = true;
        count_present = true;
    }

    if count_present && !names.cores.is_empty() && c.quantity(&names.cores).is_none() {
        let exclusive = match c.quantity(&names.memory_percentage) {
            Some(p) => quantity::parse(p).is_ok_and(|q| q.ceil() == 100),
            None => c.quantity(&names.memory).is_none(),
        };
        if exclusive {
            m.add_limits.push((names.cores.clone(), "100".to_owned()));
            m.has_resource = true;
        }
    }

    if !m.has_resource && cfg.overwrite_env {
        m.add_env
            .push((ENV_NVIDIA_VISIBLE_DEVICES.to_owned(), "none".to_owned()));
    }
    Ok(m)
}
