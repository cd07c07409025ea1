//! Filter latency percentiles (criterion reports medians only): p50/p99/min/max of one `/filter`
//! decision, N nodes × 8 GPUs with P running pods per node,
//!
//! * in-process: `Engine::filter` + the abort that drops the reservation again (the reservation
//!   invalidates one node's cached usage, as in production), at 100 / 1,000 / 5,000 nodes with 10
//!   pods per node; 100 and 1,000 candidates out of the 5,000-node cluster (cost follows the
//!   candidates, not the cluster); 1,000 nodes with 0 and 50 pods per node (cost does not follow
//!   the running pods); 5,000 nodes of which 90 % cannot take the pod (half with every GPU's
//!   only slot taken, half with every GPU's memory taken), the busy cluster where the nodes'
//!   summaries reject most candidates without evaluating them;
//! * loopback HTTP (1,000 nodes): the real `/filter` JSON (`NodeNames` form) over one kept-alive
//!   TCP connection on 127.0.0.1 to the real router served by `tls::serve` (plain HTTP), with
//!   the fake cluster edge taking the pod patch and the events.
//!
//! Rounds are interleaved (every case runs once per round), so load drift on a shared machine
//! hits every case alike; the figures are over all rounds' samples.
//!
//! Run: `cargo bench -p tessera-scheduler --bench filter_latency` (optional argument: iterations
//! per case, default 2000; `TESSERA_BENCH_QUICK=1`: 100). With `TESSERA_BENCH_CSV_DIR` set, rows
//! go to `filter_latency.csv` there (`bench/results.rs`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use tokio::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use tessera_scheduler::engine::{Command, Engine, EngineHandle, Observation};
use tessera_scheduler::http::{App, Auth, router};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::FakeEdge;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod, running_pod};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

fn observations(nodes: usize, pods_per_node: usize) -> (Vec<Observation>, Vec<String>) {
    let mut obs = Vec::with_capacity(nodes * (pods_per_node + 1));
    let mut names = Vec::with_capacity(nodes);
    for n in 0..nodes {
        let name = format!("node-{n:05}");
        obs.push(Observation::NodeUpsert(Box::new(gpu_node(
            &name, 8, 81920, 10,
        ))));
        for p in 0..pods_per_node {
            let gpu = p % 8;
            // 50 pods per node still fit next to the candidate: 8 GPUs x 10 slots, 4096 MiB and
            // 10 cores each at 10 pods, 1024 MiB and 1 core each beyond.
            let (mem, cores) = if pods_per_node <= 10 {
                (4096, 10)
            } else {
                (1024, 1)
            };
            let alloc = format!("GPU-{name}-{gpu},NVIDIA,{mem},{cores}:;");
            obs.push(Observation::PodUpsert(Box::new(running_pod(
                "bench",
                &format!("{name}-p{p}"),
                &name,
                &alloc,
            ))));
        }
        names.push(name);
    }
    (obs, names)
}

/// A cluster of `nodes` nodes × 8 GPUs of which one in ten takes the bench pod (10 pods of
/// 4096 MiB on a node with 10 slots per GPU, as in [`observations`]); of the others, half have
/// one slot per GPU, each taken, and half have every GPU's memory taken (80,000 of 81,920 MiB).
fn busy_observations(nodes: usize) -> (Vec<Observation>, Vec<String>) {
    let mut obs = Vec::new();
    let mut names = Vec::with_capacity(nodes);
    for n in 0..nodes {
        let name = format!("node-{n:05}");
        let (split, pods, mem) = match n % 10 {
            0 => (10, 10, 4096),
            1..=5 => (1, 8, 4096),
            _ => (10, 8, 80_000),
        };
        obs.push(Observation::NodeUpsert(Box::new(gpu_node(
            &name, 8, 81920, split,
        ))));
        for p in 0..pods {
            let gpu = p % 8;
            let alloc = format!("GPU-{name}-{gpu},NVIDIA,{mem},10:;");
            obs.push(Observation::PodUpsert(Box::new(running_pod(
                "bench",
                &format!("{name}-p{p}"),
                &name,
                &alloc,
            ))));
        }
        names.push(name);
    }
    (obs, names)
}

/// One in-process configuration: a loop holding `nodes` nodes, filtering over `candidates` of them.
struct InProcess {
    case: String,
    nodes: usize,
    pods_per_node: usize,
    candidates: usize,
    /// The cluster of [`busy_observations`].
    busy: bool,
    /// The pod fits no node (a whole node of 8 free cards on the busy cluster): every refusal is
    /// then also checked against the node emptied (`FailedAndUnresolvableNodes`).
    nowhere: bool,
    engine: Engine,
    names: Vec<String>,
    pod: Pod,
    samples: Vec<f64>,
}

impl InProcess {
    fn new(nodes: usize, pods_per_node: usize, candidates: usize) -> InProcess {
        Self::build(nodes, pods_per_node, candidates, false)
    }

    /// All `nodes` nodes of [`busy_observations`] as candidates.
    fn busy(nodes: usize) -> InProcess {
        Self::build(nodes, 0, nodes, true)
    }

    /// [`Self::busy`] with a pod no node can take now: 8 whole cards.
    fn nowhere(nodes: usize) -> InProcess {
        let mut me = Self::build(nodes, 0, nodes, true);
        me.nowhere = true;
        me.pod = gpu_pod("bench", "candidate", 8, 81920, 100);
        me.case = format!(
            "{nodes} nodes x 8 GPUs; 90 % of nodes full; a pod that fits nowhere (8 whole cards)"
        );
        me.samples.clear();
        me.once();
        me
    }

    fn build(nodes: usize, pods_per_node: usize, candidates: usize, busy: bool) -> InProcess {
        let mut engine = Engine::standalone(DecisionConfig::default());
        let (obs, mut names) = if busy {
            busy_observations(nodes)
        } else {
            observations(nodes, pods_per_node)
        };
        for o in obs {
            engine.observe(o);
        }
        names.truncate(candidates);
        let case = if busy {
            format!("{nodes} nodes x 8 GPUs; 90 % of nodes full (no free slot or no free memory)")
        } else if candidates == nodes {
            format!("{nodes} nodes x 8 GPUs; {pods_per_node} pods/node")
        } else {
            format!("{candidates} of {nodes} nodes as candidates; {pods_per_node} pods/node")
        };
        let mut me = InProcess {
            case,
            nodes,
            pods_per_node,
            candidates,
            busy,
            nowhere: false,
            engine,
            names,
            pod: gpu_pod("bench", "candidate", 1, 8192, 20),
            samples: Vec::new(),
        };
        // The first filter builds every node's usage cache; not part of the steady state.
        me.once();
        me
    }

    fn once(&mut self) -> f64 {
        let t = Instant::now();
        let v = self.engine.filter(&self.pod, &self.names);
        self.engine.filter_abort("uid-bench-candidate");
        let d = t.elapsed();
        if self.nowhere {
            assert!(
                matches!(v, Ok(tessera_scheduler_core::decide::Verdict::NoFit { .. })),
                "the bench pod must fit nowhere"
            );
        } else {
            assert!(
                matches!(v, Ok(tessera_scheduler_core::decide::Verdict::Placed(_))),
                "the bench pod must be placed"
            );
        }
        d.as_secs_f64() * 1e6
    }

    fn run(&mut self, iterations: usize, record: bool) {
        for _ in 0..iterations {
            let us = self.once();
            if record {
                self.samples.push(us);
            }
        }
    }
}

/// One HTTP/1.1 POST on a kept-alive connection; returns the response body.
fn post(
    stream: &mut BufReader<TcpStream>,
    addr: SocketAddr,
    path: &str,
    body: &[u8],
) -> std::io::Result<String> {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let s = stream.get_mut();
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut len = 0usize;
    let mut line = String::new();
    loop {
        line.clear();
        stream.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The real router over loopback TCP at `nodes` nodes x 10 pods.
struct Http {
    rt: tokio::runtime::Runtime,
    stream: BufReader<TcpStream>,
    addr: SocketAddr,
    body: String,
    samples: Vec<f64>,
}

impl Http {
    fn new(nodes: usize) -> Http {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let (obs, names) = observations(nodes, 10);
        let pod = gpu_pod("bench", "candidate", 1, 8192, 20);
        let addr: SocketAddr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        rt.block_on(async {
            let engine = EngineHandle::spawn(Engine::standalone(DecisionConfig::default()));
            for o in obs {
                engine.send(Command::Observe(o)).await;
            }
            let edge = Arc::new(FakeEdge::new());
            edge.add_pod(pod.clone());
            let app = Arc::new(App {
                engine,
                edge,
                auth: Arc::new(Auth::default()),
                decision: DecisionConfig::default(),
                webhook: Default::default(),
                facts: Default::default(),
                metrics: Metrics::default(),
                ready: Arc::new(AtomicBool::new(true)),
            });
            tokio::spawn(tessera_http::tls::serve(addr, router(app), None));
        });
        let body = serde_json::json!({"Pod": pod, "Nodes": null, "NodeNames": names}).to_string();
        let mut conn = None;
        for _ in 0..100 {
            if let Ok(s) = TcpStream::connect(addr) {
                conn = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let stream = conn.expect("the server listens");
        stream.set_nodelay(true).expect("nodelay");
        let mut me = Http {
            rt,
            stream: BufReader::new(stream),
            addr,
            body,
            samples: Vec::new(),
        };
        me.once();
        me
    }

    fn once(&mut self) -> f64 {
        for attempt in 0..2 {
            let t = Instant::now();
            let out = post(&mut self.stream, self.addr, "/filter", self.body.as_bytes());
            let d = t.elapsed();
            match out {
                Ok(out) if !out.is_empty() => {
                    assert!(
                        out.contains("\"NodeNames\":[\"node-"),
                        "the bench pod must be placed: {out:.300}"
                    );
                    return d.as_secs_f64() * 1e6;
                }
                // The server closes a keep-alive connection left idle past its header timeout
                // (10 s; building the other clusters can take longer on a loaded machine):
                // reconnect, as kube-scheduler's client does, and do not count that attempt.
                other if attempt == 0 => {
                    eprintln!("filter_latency: reconnecting after {other:?}");
                    let fresh = TcpStream::connect(self.addr).expect("reconnect");
                    fresh.set_nodelay(true).expect("nodelay");
                    self.stream = BufReader::new(fresh);
                }
                other => panic!("filter call: {other:?}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    fn run(&mut self, iterations: usize, record: bool) {
        for _ in 0..iterations {
            let us = self.once();
            if record {
                self.samples.push(us);
            }
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; an optional plain number sets the iterations per case.
    let quick = results::quick();
    let iterations = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(if quick { 100 } else { 2000 });
    let rounds = if quick { 2 } else { 5 };
    let per_round = (iterations / rounds).max(1);
    let t = Instant::now();
    let mut cases = vec![
        InProcess::new(100, 10, 100),
        InProcess::new(1_000, 10, 1_000),
        InProcess::new(5_000, 10, 5_000),
        InProcess::new(5_000, 10, 100),
        InProcess::new(5_000, 10, 1_000),
        InProcess::new(1_000, 0, 1_000),
        InProcess::new(1_000, 50, 1_000),
        InProcess::busy(5_000),
        InProcess::nowhere(5_000),
    ];
    let mut http = Http::new(1_000);
    eprintln!("clusters built in {:.1} s", t.elapsed().as_secs_f64());
    // Warm-up (a tenth), then interleaved rounds.
    for c in cases.iter_mut() {
        let n = if c.candidates > 1_000 {
            per_round / 4
        } else {
            per_round
        };
        c.run((n / 10).max(1), false);
    }
    http.run((per_round / 10).max(1), false);
    for _ in 0..rounds {
        for c in cases.iter_mut() {
            let n = if c.candidates > 1_000 {
                per_round / 4
            } else {
                per_round
            };
            c.run(n.max(1), true);
        }
        http.run(per_round, true);
    }
    let csv = Csv::open("filter_latency");
    let mut median_at = std::collections::BTreeMap::new();
    // A pod that fits nowhere, against one that fits on the same busy cluster (same run).
    let placed_on_busy = cases
        .iter()
        .find(|c| c.busy && !c.nowhere)
        .map(|c| Stats::of(&c.samples).median);
    for c in &cases {
        let s = Stats::of(&c.samples);
        let mut row = Row::new(c.case.clone(), "filter+score in-process", "us", s);
        if let (true, Some(b)) = (c.nowhere, placed_on_busy) {
            row = row.baseline(b).ratio(s.median / b);
        }
        if c.nodes == 1_000 && c.candidates == 1_000 && c.pods_per_node == 10 {
            row = row.goal("p99 < 1000 us", s.p99 < 1_000.0);
        }
        if c.nodes == 5_000 && c.candidates == 5_000 && c.pods_per_node == 10 && !c.busy {
            row = row.goal("p99 < 2000 us", s.p99 < 2_000.0);
        }
        csv.row(&row);
        if !c.busy {
            median_at.insert((c.nodes, c.pods_per_node, c.candidates), s.median);
        }
    }
    let s = Stats::of(&http.samples);
    csv.row(
        &Row::new(
            "1000 nodes x 8 GPUs; 10 pods/node",
            "/filter over loopback HTTP (real JSON)",
            "us",
            s,
        )
        .baseline(median_at[&(1_000, 10, 1_000)])
        .goal("p99 < 2000 us", s.p99 < 2_000.0),
    );
    // How the cost grows: per candidate node (slope between 100 and 5,000 candidates of the
    // 5,000-node cluster), and the ratios that show what it does not depend on.
    let slope = (median_at[&(5_000, 10, 5_000)] - median_at[&(5_000, 10, 100)]) / 4_900.0;
    csv.row(
        &Row::new(
            "5000-node cluster; 100 -> 5000 candidates",
            "cost per candidate node (slope of medians)",
            "us",
            Stats::single(slope),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            "1000 candidates: 5000-node cluster vs 1000-node cluster",
            "median ratio (1.0 = cluster size does not matter)",
            "x",
            Stats::single(median_at[&(5_000, 10, 1_000)] / median_at[&(1_000, 10, 1_000)]),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            "1000 nodes: 50 vs 0 running pods per node",
            "median ratio (1.0 = running pods do not matter)",
            "x",
            Stats::single(median_at[&(1_000, 50, 1_000)] / median_at[&(1_000, 0, 1_000)]),
        )
        .without_p99(),
    );
    drop(http.rt);
}
