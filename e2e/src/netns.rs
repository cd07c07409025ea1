//! The network a real-node cluster lives in: a network namespace of its own, made by the test.
//!
//! A kubelet refuses a loopback node address, and the API server must reach each kubelet (logs,
//! exec) and each webhook pod at a routable address. So the test thread moves into a fresh network
//! namespace ([`ClusterNetwork::enter`]) before it starts anything; every process it spawns
//! inherits it. In there a port-less bridge carries the API server's address, the `kubernetes`
//! Service's ClusterIP and one address per node; each node's CNI bridge carries its pod subnet.
//! Nothing in it is reachable from, or reaches, any address outside the namespace: it dies with
//! the test thread and its processes.
//!
//! Service routing: the API server reaches webhook Services through their endpoints
//! (`--enable-aggregator-routing`), and pods reach the API server at the `kubernetes` Service's
//! ClusterIP because that address is local to the namespace and the API server listens on 443
//! there. Those are the two Service paths the chart needs; no kube-proxy runs (docs/e2e.md).

use std::net::Ipv4Addr;
use std::process::Command;

use crate::{Error, Result};

/// The interface that carries the cluster's addresses: a bridge with no ports, used as a dummy
/// interface (this kernel has no `dummy` driver).
const DUMMY: &str = "te2e0";

/// The API server's advertised address (the `kubernetes` Service's endpoint).
pub const APISERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
/// The Service CIDR; its first address is the `kubernetes` Service's ClusterIP.
pub const SERVICE_CIDR: &str = "10.96.0.0/24";
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);

/// Node `i`'s address.
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 201, 0, 10 + u8::try_from(i % 200).unwrap_or(0))
}

/// Node `i`'s pod subnet (its CNI bridge holds the first address).
pub fn pod_subnet(i: usize) -> String {
    format!("10.210.{}.0/24", i % 250)
}

/// Proof that the calling thread is in the cluster's own network namespace.
#[derive(Debug)]
pub struct ClusterNetwork {
    _private: (),
}

fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::msg(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

impl ClusterNetwork {
    /// Moves the calling thread into a new network namespace and lays out the cluster's
    /// addresses. Call it on the thread that will start the cluster, before any socket or child
    /// process is made (a current-thread runtime keeps every task on it). Needs root
    /// (CAP_SYS_ADMIN and CAP_NET_ADMIN), as the real nodes do.
    pub fn enter(nodes: usize) -> Result<ClusterNetwork> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
            Error::msg(format!(
                "unshare(CLONE_NEWNET): {e} (real-node e2e tests run as root)"
            ))
        })?;
        run(&["ip", "link", "set", "lo", "up"])?;
        run(&["ip", "link", "add", DUMMY, "type", "bridge"])?;
        run(&["ip", "link", "set", DUMMY, "up"])?;
        let mut addrs = vec![APISERVER_IP, KUBERNETES_SERVICE_IP];
        addrs.extend((0..nodes).map(node_ip));
        for a in addrs {
            run(&["ip", "addr", "add", &format!("{a}/32"), "dev", DUMMY])?;
        }
        // Pods on one node's bridge reach pods on another's through this namespace.
        run(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
        Ok(ClusterNetwork { _private: () })
    }
}
