//! Filter latency percentiles (criterion reports medians only): p50/p99/max of one `/filter`
//! decision at 100 / 1,000 / 5,000 nodes × 8 GPUs with 10 running pods per node,
//!
//! * in-process: `Engine::filter` + the abort that drops the reservation again (the reservation
//!   invalidates one node's cached usage, as in production);
//! * loopback HTTP (1,000 nodes): the real `/filter` JSON (`NodeNames` form) over one kept-alive
//!   TCP connection on 127.0.0.1 to the real router served by `tls::serve` (plain HTTP), with
//!   the fake cluster edge taking the pod patch and the events.
//!
//! Run: `cargo bench -p tessera-scheduler --bench filter_latency` (optional argument: iterations,
//! default 2000).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tessera_scheduler::decide::DecisionConfig;
use tessera_scheduler::engine::{Command, Engine, EngineHandle, Observation};
use tessera_scheduler::http::{App, Auth, router};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::{FakeEdge, gpu_node, gpu_pod, running_pod};

fn observations(nodes: usize) -> (Vec<Observation>, Vec<String>) {
    let mut obs = Vec::with_capacity(nodes * 11);
    let mut names = Vec::with_capacity(nodes);
    for n in 0..nodes {
        let name = format!("node-{n:05}");
        obs.push(Observation::NodeUpsert(Box::new(gpu_node(
            &name, 8, 81920, 10,
        ))));
        for p in 0..10 {
            let gpu = p % 8;
            let alloc = format!("GPU-{name}-{gpu},NVIDIA,4096,10:;");
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

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i].as_secs_f64() * 1e6
    };
    println!(
        "{what:<32} n={:<6} p50={:>9.1}µs  p99={:>9.1}µs  max={:>9.1}µs",
        samples.len(),
        at(0.50),
        at(0.99),
        at(1.0)
    );
}

fn in_process(nodes: usize, iterations: usize) {
    let mut engine = Engine::standalone(DecisionConfig::default());
    let (obs, names) = observations(nodes);
    for o in obs {
        engine.observe(o);
    }
    let pod = gpu_pod("bench", "candidate", 1, 8192, 20);
    let mut run = || {
        let t = Instant::now();
        let v = engine.filter(&pod, &names);
        engine.filter_abort("uid-bench-candidate");
        let d = t.elapsed();
        assert!(
            matches!(v, Ok(tessera_scheduler::decide::Verdict::Placed(_))),
            "the bench pod must be placed"
        );
        d
    };
    for _ in 0..iterations / 10 {
        run();
    }
    let samples = (0..iterations).map(|_| run()).collect();
    report(&format!("in-process {nodes} nodes"), samples);
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

fn loopback_http(nodes: usize, iterations: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (obs, names) = observations(nodes);
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
        tokio::spawn(tessera_scheduler::tls::serve(addr, router(app), None));
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
    let mut stream = BufReader::new(stream);
    let mut run = || {
        let t = Instant::now();
        let out = post(&mut stream, addr, "/filter", body.as_bytes()).expect("filter call");
        let d = t.elapsed();
        assert!(
            out.contains("\"NodeNames\":[\"node-"),
            "the bench pod must be placed: {out:.300}"
        );
        d
    };
    for _ in 0..iterations / 10 {
        run();
    }
    let samples = (0..iterations).map(|_| run()).collect();
    report(&format!("loopback HTTP {nodes} nodes"), samples);
    drop(rt);
}

fn main() {
    // `cargo bench` passes `--bench`; an optional plain number sets the iterations.
    let iterations = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(2000);
    for nodes in [100, 1_000, 5_000] {
        in_process(
            nodes,
            if nodes > 1_000 {
                iterations / 4
            } else {
                iterations
            },
        );
    }
    loopback_http(1_000, iterations);
}
