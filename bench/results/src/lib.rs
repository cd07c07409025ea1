//! Machine-readable results, shared by every benchmark that `bench/run.sh` runs (a
//! dev-dependency of each crate with benchmarks; never shipped).
//!
//! When `TESSERA_BENCH_CSV_DIR` is set, [`Csv::open`] appends rows to `<dir>/<bench>.csv` (the
//! header is written when the file is new), with the commit and machine the runner puts in
//! `TESSERA_BENCH_COMMIT` and `TESSERA_BENCH_MACHINE`. Without it nothing is written and the
//! benchmark only prints, as before. `TESSERA_BENCH_QUICK=1` asks for a run of a few seconds that
//! only shows the benchmark still works (`bench/run.sh --quick`).
//!
//! Columns: `bench,case,metric,unit,n,median,p99,min,max,baseline,ratio,goal,verdict,commit,machine`.
//! `median`/`p99`/`min`/`max` are over `n` samples (or over `n` rounds where a round gives one
//! figure); `baseline` is the same measure without the component under test, taken in the same
//! run, and `ratio` is `median / baseline`.

use std::io::Write;
use std::path::PathBuf;

/// True for `bench/run.sh --quick`: run each benchmark for a few seconds.
pub fn quick() -> bool {
    std::env::var("TESSERA_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Order statistics of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    pub n: usize,
    pub median: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Stats {
    /// Nearest-rank percentiles of `samples` (any order).
    pub fn of(samples: &[f64]) -> Stats {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
            v[i]
        };
        Stats {
            n: v.len(),
            median: at(0.5),
            p99: at(0.99),
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    /// One figure (no spread).
    pub fn single(x: f64) -> Stats {
        Stats::of(&[x])
    }
}

/// One CSV row.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub case: String,
    pub metric: String,
    pub unit: String,
    pub stats: Stats,
    /// The same measure without the component under test, same run.
    pub baseline: Option<f64>,
    /// Overrides `median / baseline` (e.g. a median of per-round ratios).
    pub ratio: Option<f64>,
    pub goal: String,
    /// `met`, `not met`, or empty where there is no goal.
    pub verdict: String,
    /// Whether p99 means anything for this row (false for per-round figures with few rounds).
    pub no_p99: bool,
}

impl Row {
    pub fn new(case: impl Into<String>, metric: impl Into<String>, unit: &str, s: Stats) -> Row {
        Row {
            case: case.into(),
            metric: metric.into(),
            unit: unit.to_owned(),
            stats: s,
            ..Default::default()
        }
    }

    pub fn baseline(mut self, b: f64) -> Row {
        self.baseline = Some(b);
        self
    }

    pub fn ratio(mut self, r: f64) -> Row {
        self.ratio = Some(r);
        self
    }

    pub fn without_p99(mut self) -> Row {
        self.no_p99 = true;
        self
    }

    /// A goal and whether this run met it.
    pub fn goal(mut self, goal: &str, met: bool) -> Row {
        self.goal = goal.to_owned();
        self.verdict = if met { "met" } else { "not met" }.to_owned();
        self
    }
}

/// Where one benchmark's rows go.
#[derive(Debug)]
pub struct Csv {
    bench: String,
    path: Option<PathBuf>,
}

fn field(s: &str) -> String {
    // No quoting needed downstream (bench/report.awk splits on commas).
    s.replace([',', '\n', '\r'], " ")
}

fn num(x: f64) -> String {
    if !x.is_finite() {
        return String::new();
    }
    let a = x.abs();
    if a == 0.0 {
        "0".to_owned()
    } else if a >= 1000.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.4}")
    }
}

impl Csv {
    pub fn open(bench: &str) -> Csv {
        let path = std::env::var_os("TESSERA_BENCH_CSV_DIR").map(|d| {
            let d = PathBuf::from(d);
            let _ = std::fs::create_dir_all(&d);
            d.join(format!("{bench}.csv"))
        });
        Csv {
            bench: bench.to_owned(),
            path,
        }
    }

    /// Prints the row and appends it to the CSV (if any).
    pub fn row(&self, r: &Row) {
        let s = &r.stats;
        let ratio = r
            .ratio
            .or_else(|| r.baseline.filter(|b| *b != 0.0).map(|b| s.median / b));
        println!(
            "[{}] {} | {}: median {} {u}, p99 {} {u}, min {} max {} (n={}){}{}{}",
            self.bench,
            r.case,
            r.metric,
            num(s.median),
            if r.no_p99 { "-".to_owned() } else { num(s.p99) },
            num(s.min),
            num(s.max),
            s.n,
            r.baseline
                .map(|b| format!(", baseline {} {}", num(b), r.unit))
                .unwrap_or_default(),
            ratio.map(|x| format!(", ratio {x:.3}")).unwrap_or_default(),
            if r.goal.is_empty() {
                String::new()
            } else {
                format!(", goal {}: {}", r.goal, r.verdict)
            },
            u = r.unit,
        );
        let Some(path) = &self.path else { return };
        let new = !path.exists();
        let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        else {
            eprintln!("cannot write {}", path.display());
            return;
        };
        if new {
            let _ = writeln!(
                f,
                "bench,case,metric,unit,n,median,p99,min,max,baseline,ratio,goal,verdict,commit,machine"
            );
        }
        let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "unknown".to_owned());
        let _ = writeln!(
            f,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            field(&self.bench),
            field(&r.case),
            field(&r.metric),
            field(&r.unit),
            s.n,
            num(s.median),
            if r.no_p99 { String::new() } else { num(s.p99) },
            num(s.min),
            num(s.max),
            r.baseline.map(num).unwrap_or_default(),
            ratio.map(|x| format!("{x:.3}")).unwrap_or_default(),
            field(&r.goal),
            field(&r.verdict),
            field(&env("TESSERA_BENCH_COMMIT")),
            field(&env("TESSERA_BENCH_MACHINE")),
        );
    }
}
