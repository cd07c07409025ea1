//! Which pod and container a process belongs to, from the text of its `/proc/<pid>/cgroup`
//! (pure; the read is `tessera_node::gpu_processes::read_proc_cgroup`).
//!
//! The kubelet puts every container in a cgroup under its pod's, whose name carries the pod UID;
//! the container runtime names the container's cgroup after the container ID. The layouts
//! recognised, for cgroup v2 (`0::<path>`) and every v1 hierarchy line
//! (`<id>:<controllers>:<path>`), for the three QoS classes (guaranteed pods sit directly under
//! the root slice):
//!
//! | driver | path |
//! |---|---|
//! | `cgroupfs` | `/kubepods/burstable/pod<uid>/<id>` (`besteffort`, or none for guaranteed); CRI-O: `…/crio-<id>` |
//! | `systemd` | `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope` (also `docker-<id>.scope`, `crio-<id>.scope`) |
//!
//! A prefix before the kubelet's root (`--cgroup-root`, a kind node's `/kubelet.slice/kubelet-…`,
//! Docker-in-Docker's `/docker/<id>/…`) is allowed, and so is a path relative to the reader's
//! cgroup namespace (`/../../kubepods-besteffort-pod<uid>.slice/…`, what a device plugin in its
//! own cgroup namespace sees). The **outermost** pod segment wins: a container with a delegated
//! cgroup subtree may name sub-cgroups after another pod, but only below its own.
//!
//! The text is treated as untrusted (the kernel writes it, but a container chooses the names of
//! cgroups it may create): the parser never panics, looks at no more than [`MAX_LINES`] lines
//! and [`MAX_PATH`] bytes of each path, and accepts only the UID and ID alphabets.
//!
//! Limits: a static pod's cgroup carries the kubelet's hash of its manifest, not the mirror
//! pod's UID the API server shows; such a process maps to a pod UID no booking uses.
//!
//! This file uses `std` only: the fuzz target `pod_cgroup` compiles it on its own.

/// Lines of `/proc/<pid>/cgroup` looked at: one per v1 hierarchy (about 13 on current kernels)
/// plus the v2 line; more is not a kernel's file.
pub const MAX_LINES: usize = 64;

/// Bytes of one cgroup path looked at (the kernel's `PATH_MAX`); a longer path is cut there.
pub const MAX_PATH: usize = 4096;

/// Longest pod UID accepted: a UUID is 36 characters, a static pod's hash 32.
const MAX_UID: usize = 64;

/// Longest container ID accepted: containerd, Docker and CRI-O use 64 hex digits.
const MAX_CONTAINER_ID: usize = 128;

/// The pod (and container) a cgroup path names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodCgroup {
    /// The pod's UID, with dashes (`systemd` slice names carry underscores instead).
    pub pod_uid: String,
    /// The container's ID, without the runtime's prefix (`cri-containerd-`, `docker-`, `crio-`)
    /// or `.scope`; `None` for a process in the pod's own cgroup, or in a runtime helper's
    /// (`crio-conmon-<id>.scope`).
    pub container_id: Option<String>,
}

/// Where `/proc/<pid>/cgroup` puts a process.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CgroupOwner {
    /// In a pod's cgroup.
    Pod(PodCgroup),
    /// In no pod's cgroup: a host service, a user session, a container Kubernetes does not run.
    /// `cgroup` is its path (the v2 one, else the first v1 line's), cut to [`MAX_PATH`] bytes,
    /// without the leading `/..` segments of a path relative to the reader's cgroup namespace,
    /// so an operator can allow it by name.
    Host { cgroup: String },
    /// In a container runtime's cgroup that names no pod (a kubelet with `cgroupsPerQOS: false`
    /// puts containers under the runtime's own parent, e.g. `/k8s.io/<id>`): the pod is the one
    /// whose status names `container_id` (`status.containerStatuses[].containerID`), if any.
    Container {
        container_id: String,
        cgroup: String,
    },
}

/// The owner of a process from the whole text of its `/proc/<pid>/cgroup`. The v2 line is
/// preferred, then the v1 lines in order; a process whose lines name no pod is a host process.
pub fn owner_from_proc_cgroup(text: &str) -> CgroupOwner {
    let lines: Vec<(&str, &str)> = text
        .lines()
        .take(MAX_LINES)
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let hierarchy = fields.next()?;
            let _controllers = fields.next()?;
            let path = fields.next()?;
            Some((hierarchy, cut(path)))
        })
        .collect();
    let v2 = lines.iter().filter(|(h, _)| *h == "0");
    let v1 = lines.iter().filter(|(h, _)| *h != "0");
    let ordered: Vec<&str> = v2.chain(v1).map(|(_, path)| *path).collect();
    if let Some(pod) = ordered.iter().find_map(|path| pod_of_cgroup_path(path)) {
        return CgroupOwner::Pod(pod);
    }
    if let Some((container_id, path)) = ordered.iter().find_map(|path| {
        let last = cut(path).rsplit('/').find(|s| !s.is_empty())?;
        full_container_id(last).map(|id| (id, *path))
    }) {
        return CgroupOwner::Container {
            container_id,
            cgroup: without_parent_segments(path),
        };
    }
    CgroupOwner::Host {
        cgroup: ordered
            .first()
            .map(|path| without_parent_segments(path))
            .unwrap_or_default(),
    }
}

/// The pod and container one cgroup path names, if any (the outermost pod segment).
pub fn pod_of_cgroup_path(path: &str) -> Option<PodCgroup> {
    let segments: Vec<&str> = cut(path).split('/').filter(|s| !s.is_empty()).collect();
    segments.iter().enumerate().find_map(|(i, segment)| {
        let parent = i.checked_sub(1).and_then(|p| segments.get(p)).copied();
        let pod_uid = systemd_pod_uid(segment).or_else(|| cgroupfs_pod_uid(segment, parent))?;
        let container_id = segments.get(i + 1).and_then(|s| container_id(s));
        Some(PodCgroup {
            pod_uid,
            container_id,
        })
    })
}

/// `path` cut to [`MAX_PATH`] bytes, at a character boundary.
fn cut(path: &str) -> &str {
    if path.len() <= MAX_PATH {
        return path;
    }
    let mut end = MAX_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    path.get(..end).unwrap_or_default()
}

/// `/../../system.slice/x.service` → `/system.slice/x.service`.
fn without_parent_segments(path: &str) -> String {
    let mut rest = path;
    while let Some(r) = rest.strip_prefix("/..") {
        if !(r.is_empty() || r.starts_with('/')) {
            break;
        }
        rest = r;
    }
    if rest.is_empty() {
        "/".to_owned()
    } else {
        rest.to_owned()
    }
}

/// `kubepods-burstable-pod<uid_>.slice` (also `kubepods-pod…`, `kubepods-besteffort-pod…` and
/// a prefixed root such as kind's `kubelet-kubepods-…`) → the UID with dashes.
fn systemd_pod_uid(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".slice")?;
    let (qos, uid) = name.rsplit_once("-pod")?;
    let is_pods_slice = ["kubepods", "kubepods-burstable", "kubepods-besteffort"]
        .iter()
        .any(|root| qos == *root || qos.ends_with(&format!("-{root}")));
    if !is_pods_slice {
        return None;
    }
    valid_uid(&uid.replace('_', "-"))
}

/// `pod<uid>` right under `kubepods`, `burstable`, `besteffort` (or a `..` of a relative path,
/// where the QoS level is the reader's own and not shown) → the UID.
fn cgroupfs_pod_uid(segment: &str, parent: Option<&str>) -> Option<String> {
    let uid = segment.strip_prefix("pod")?;
    let under_pods = matches!(parent, Some("kubepods" | "burstable" | "besteffort" | ".."));
    if !under_pods {
        return None;
    }
    valid_uid(uid)
}

/// A pod UID: hex digits and dashes (a UUID, or a static pod's hash), not empty, not too long.
fn valid_uid(uid: &str) -> Option<String> {
    let ok = !uid.is_empty()
        && uid.len() <= MAX_UID
        && uid.chars().any(|c| c.is_ascii_hexdigit())
        && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
    ok.then(|| uid.to_owned())
}

/// The container ID of the segment below a pod's: `cri-containerd-<id>.scope`,
/// `docker-<id>.scope`, `crio-<id>.scope`, `crio-<id>`, or the bare `<id>` of `cgroupfs`.
fn container_id(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    let id = ["cri-containerd-", "docker-", "crio-", "containerd-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
        .unwrap_or(name);
    let ok = !id.is_empty()
        && id.len() <= MAX_CONTAINER_ID
        && id.chars().all(|c| c.is_ascii_alphanumeric());
    ok.then(|| id.to_owned())
}

/// The last PID of the `NSpid:` line of a `/proc/<pid>/status` text: the process's PID in its
/// own (innermost) PID namespace, which is what a shim inside the container records.
pub fn ns_pid_from_status(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("NSpid:"))?
        .split_whitespace()
        .next_back()?
        .parse()
        .ok()
        .filter(|pid| *pid > 0)
}

/// A runtime's full container ID in a cgroup segment (64 hex digits, as containerd, CRI-O and
/// Docker make them): only such a segment is taken for a container outside a pod's cgroup.
fn full_container_id(segment: &str) -> Option<String> {
    container_id(segment).filter(|id| id.len() == 64 && id.chars().all(|c| c.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_outside_pod_cgroups_is_named_by_its_id() {
        let text = format!("4:memory:/process_api/abc/k8s.io/{CID}\n1:cpu:/\n0::/\n");
        assert_eq!(
            owner_from_proc_cgroup(&text),
            CgroupOwner::Container {
                container_id: CID.into(),
                cgroup: format!("/process_api/abc/k8s.io/{CID}"),
            }
        );
        // A short or non-hex last segment is a host cgroup, not a container.
        assert!(matches!(
            owner_from_proc_cgroup("0::/user.slice/user-0.slice/session-1.scope\n"),
            CgroupOwner::Host { .. }
        ));
    }

    const UID: &str = "0b7e3c1a-5d2f-4e6a-9c8b-1a2b3c4d5e6f";
    const UID_: &str = "0b7e3c1a_5d2f_4e6a_9c8b_1a2b3c4d5e6f";
    const CID: &str = "4f9d1c2b3a4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4";

    fn pod(container: Option<&str>) -> CgroupOwner {
        CgroupOwner::Pod(PodCgroup {
            pod_uid: UID.to_owned(),
            container_id: container.map(str::to_owned),
        })
    }

    #[test]
    fn cgroup_v2_systemd_driver_every_qos_and_runtime() {
        for (qos_path, qos) in [
            (
                "/kubepods.slice/kubepods-burstable.slice",
                "kubepods-burstable",
            ),
            (
                "/kubepods.slice/kubepods-besteffort.slice",
                "kubepods-besteffort",
            ),
            // Guaranteed pods sit directly under the root slice.
            ("/kubepods.slice", "kubepods"),
        ] {
            for scope in [
                format!("cri-containerd-{CID}.scope"),
                format!("docker-{CID}.scope"),
                format!("crio-{CID}.scope"),
            ] {
                let text = format!("0::{qos_path}/{qos}-pod{UID_}.slice/{scope}\n");
                assert_eq!(owner_from_proc_cgroup(&text), pod(Some(CID)), "{text}");
            }
        }
    }

    #[test]
    fn cgroup_v2_cgroupfs_driver_every_qos() {
        for qos in ["/kubepods/burstable", "/kubepods/besteffort", "/kubepods"] {
            let text = format!("0::{qos}/pod{UID}/{CID}\n");
            assert_eq!(owner_from_proc_cgroup(&text), pod(Some(CID)), "{text}");
            let text = format!("0::{qos}/pod{UID}/crio-{CID}\n");
            assert_eq!(owner_from_proc_cgroup(&text), pod(Some(CID)), "{text}");
        }
    }

    #[test]
    fn cgroup_v1_with_every_hierarchy_line() {
        // A cgroup v1 node with the systemd driver, as a containerd container sees it.
        let text = format!(
            "12:hugetlb:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope
11:cpuset:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope
10:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope
4:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope
1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope
0::/
"
        );
        assert_eq!(owner_from_proc_cgroup(&text), pod(Some(CID)));
        // And with the cgroupfs driver (Docker).
        let text = format!(
            "11:devices:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n"
        );
        assert_eq!(owner_from_proc_cgroup(&text), pod(Some(CID)));
    }

    #[test]
    fn prefixed_roots_and_paths_relative_to_the_readers_cgroup_namespace() {
        // kind (`--cgroup-root=/kubelet`), Docker-in-Docker, and a reader in its own namespace.
        for path in [
            format!(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
            ),
            format!("/docker/{CID}/kubepods/besteffort/pod{UID}/{CID}"),
            format!("/../../kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"),
            format!("/../../pod{UID}/{CID}"),
        ] {
            assert_eq!(
                owner_from_proc_cgroup(&format!("0::{path}\n")),
                pod(Some(CID)),
                "{path}"
            );
        }
    }

    #[test]
    fn a_process_in_the_pods_own_cgroup_or_a_runtime_helper_has_no_container() {
        let text = format!("0::/kubepods/burstable/pod{UID}\n");
        assert_eq!(owner_from_proc_cgroup(&text), pod(None));
        let text = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{CID}.scope\n"
        );
        assert_eq!(owner_from_proc_cgroup(&text), pod(None));
    }

    #[test]
    fn a_sub_cgroup_named_after_another_pod_does_not_move_the_process() {
        let other = "11111111-2222-3333-4444-555555555555";
        let text =
            format!("0::/kubepods/burstable/pod{UID}/{CID}/kubepods/burstable/pod{other}/{CID}\n");
        assert_eq!(owner_from_proc_cgroup(&text), pod(Some(CID)));
    }

    #[test]
    fn host_processes_keep_their_cgroup_for_the_allow_list() {
        assert_eq!(
            owner_from_proc_cgroup("0::/system.slice/nvidia-persistenced.service\n"),
            CgroupOwner::Host {
                cgroup: "/system.slice/nvidia-persistenced.service".into()
            }
        );
        assert_eq!(
            owner_from_proc_cgroup("0::/../../../system.slice/dcgm.service\n"),
            CgroupOwner::Host {
                cgroup: "/system.slice/dcgm.service".into()
            }
        );
        assert_eq!(
            owner_from_proc_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n"),
            CgroupOwner::Host {
                cgroup: "/user.slice/user-1000.slice/session-3.scope".into()
            }
        );
        // v1: the first line's path when there is no v2 line.
        assert_eq!(
            owner_from_proc_cgroup("12:memory:/system.slice/x.service\n1:name=systemd:/y\n"),
            CgroupOwner::Host {
                cgroup: "/system.slice/x.service".into()
            }
        );
        assert_eq!(
            owner_from_proc_cgroup("0::/\n"),
            CgroupOwner::Host { cgroup: "/".into() }
        );
    }

    #[test]
    fn look_alikes_are_not_pods() {
        for path in [
            // Not under a pods root.
            format!("/system.slice/pod{UID}/{CID}"),
            format!("/user.slice/user-pod{UID_}.slice"),
            // Not a UID.
            "/kubepods/burstable/podxyz/abc".to_owned(),
            "/kubepods/burstable/pod/abc".to_owned(),
            "/kubepods/burstable/pod----/abc".to_owned(),
            "/kubepods.slice/kubepods-burstable-pod.slice".to_owned(),
            format!("/kubepods/burstable/pod{}", "a".repeat(65)),
        ] {
            // Never a pod; a container ID found in it counts only if a pod's status names it.
            assert!(
                !matches!(
                    owner_from_proc_cgroup(&format!("0::{path}\n")),
                    CgroupOwner::Pod(_)
                ),
                "{path}"
            );
        }
    }

    #[test]
    fn hostile_text_is_bounded_and_never_panics() {
        for text in [
            String::new(),
            "\n\n\n".to_owned(),
            ":::::".to_owned(),
            "0:".to_owned(),
            "0::".to_owned(),
            "é:é:é/é/é".to_owned(),
            format!("0::/kubepods/pod{UID}/{}", "é".repeat(5000)),
            format!("0::/{}", "/..".repeat(10_000)),
            "0::/kubepods/burstable/pod\u{0}/x".to_owned(),
        ] {
            let _ = owner_from_proc_cgroup(&text);
        }
        // A pod segment past MAX_PATH is not looked at.
        let long = format!("0::/{}/kubepods/pod{UID}/{CID}\n", "x".repeat(MAX_PATH));
        assert!(matches!(
            owner_from_proc_cgroup(&long),
            CgroupOwner::Host { cgroup } if cgroup.len() <= MAX_PATH
        ));
        // Lines past MAX_LINES are not looked at.
        let mut many = "9:x:/\n".repeat(MAX_LINES);
        many.push_str(&format!("0::/kubepods/pod{UID}/{CID}\n"));
        assert!(matches!(
            owner_from_proc_cgroup(&many),
            CgroupOwner::Host { .. }
        ));
    }
}
