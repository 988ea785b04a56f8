//! graphile-worker on the same server in the same sitting: its drain (with
//! its defaults, with its batching, and with its batching at equal work:
//! each task writing what a drained no-op run writes, see
//! `bench/graphile/drain.js`) and its pickup, beside ours, and the ratios. Its drain passes are interleaved with ours, one pass of each at
//! a time (`queue::throughput`), and each ratio is of two passes run moments
//! apart: a machine that slows down mid-sitting slows both sides of a pair,
//! and the median of the pairs' ratios says more than a ratio of medians
//! taken minutes apart. Runs only when Node is on PATH (and `--compare graphile`): the
//! pinned package (`bench/graphile/package.json` and its lock) is installed
//! with `npm ci` into a cache outside the clone,
//! `${XDG_CACHE_HOME:-$HOME/.cache}/agent-host/graphile-<lock hash>`, once.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Context;
use serde_json::Value;
use sqlx::PgPool;

use crate::figures::{self, median, PickupP50};
use crate::{sql, BenchArgs};

/// The pinned package, beside this crate.
const PACKAGE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/graphile");
/// Files copied into the install directory.
const FILES: [&str; 3] = ["package.json", "package-lock.json", "drain.js"];

/// What the comparison needs that may be missing: Node and npm.
fn node_present() -> bool {
    let ok = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    ok("node") && ok("npm")
}

/// The install directory for this lock file, installed if it is not yet.
fn install() -> anyhow::Result<PathBuf> {
    let lock =
        std::fs::read(Path::new(PACKAGE_DIR).join("package-lock.json")).context("bench/graphile/package-lock.json")?;
    // FNV-1a of the lock: a new pin installs beside the old one.
    let hash = lock.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set")?;
    let dir = cache.join("agent-host").join(format!("graphile-{hash:016x}"));
    std::fs::create_dir_all(&dir)?;
    for f in FILES {
        std::fs::copy(Path::new(PACKAGE_DIR).join(f), dir.join(f)).with_context(|| format!("copying {f}"))?;
    }
    if !dir.join("node_modules/graphile-worker").exists() {
        let out = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel", "error"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .output()?;
        anyhow::ensure!(out.status.success(), "npm ci failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(dir)
}

/// graphile-worker installed, with a database of its own beside ours on
/// the same server.
pub struct Graphile {
    dir: PathBuf,
    url: String,
    version: String,
}

/// One drain pass of graphile-worker: jobs/s with its defaults, with its
/// batching, and with its batching at equal work (each job's task writes
/// what a drained no-op run writes: its user message's status, one
/// assistant message and three journal events, in one transaction, into
/// tables shaped like ours), and what each cost per job.
#[derive(Debug, Clone, Copy)]
pub struct Pass {
    pub defaults: f64,
    pub batched: f64,
    pub equal: f64,
    pub defaults_costs: Costs,
    pub batched_costs: Costs,
    pub equal_costs: Costs,
}

/// What one of its drain passes cost per job, read as our drain's are
/// (`queue::Drained`): the server's counters and CPU around the pass, and
/// Node's own CPU over it (`process.cpuUsage`).
#[derive(Debug, Clone, Copy)]
pub struct Costs {
    /// Transactions that wrote, per job.
    pub commits_per_job: f64,
    pub wal_bytes_per_job: f64,
    /// Node's CPU per job, in µs.
    pub node_cpu_us: f64,
    /// The server's CPU per job, in µs; NaN for a server not on this machine.
    pub server_cpu_us: f64,
}

impl Costs {
    /// `X commits, Y WAL bytes; CPU node A µs, database B µs`.
    pub fn line(&self) -> String {
        format!(
            "{:.2} commits, {:.0} WAL bytes; CPU {}",
            self.commits_per_job,
            self.wal_bytes_per_job,
            figures::cpu_line("node", self.node_cpu_us, self.server_cpu_us)
        )
    }

    /// The median of each cost over `passes`.
    pub fn medians(passes: impl Iterator<Item = Costs>) -> Costs {
        let passes: Vec<Costs> = passes.collect();
        let m = |f: fn(&Costs) -> f64| median(&mut passes.iter().map(f).collect::<Vec<_>>());
        Costs {
            commits_per_job: m(|c| c.commits_per_job),
            wal_bytes_per_job: m(|c| c.wal_bytes_per_job),
            node_cpu_us: m(|c| c.node_cpu_us),
            server_cpu_us: m(|c| c.server_cpu_us),
        }
    }
}

impl Graphile {
    /// graphile-worker on `server_url`'s server, installed if it is not yet;
    /// `None` (and a line saying so) without Node.
    pub async fn prepare(server_url: &str, args: &BenchArgs) -> anyhow::Result<Option<Graphile>> {
        if !node_present() {
            println!("graphile-worker comparison: skipped (no node/npm on PATH)");
            return Ok(None);
        }
        let dir = tokio::task::spawn_blocking(install).await??;
        let url = sql::fresh_database(server_url, &format!("{}_graphile", args.bench_database)).await?;
        Ok(Some(Graphile { dir, url, version: "?".into() }))
    }

    /// `drain.js` in `mode` (one step of one pass for `prepare`,
    /// `defaults` and `batched`, or `prepare-equal` and `equal`), its answer.
    async fn node(&mut self, args: &BenchArgs, mode: &str) -> anyhow::Result<Value> {
        let (dir, url, args, mode) = (self.dir.clone(), self.url.clone(), args.clone(), mode.to_string());
        let run = move || {
            Command::new("node")
                .arg("drain.js")
                .args([&url, &args.runs.to_string(), &args.in_flight.to_string(), "1"])
                .args([args.samples.to_string(), mode])
                .current_dir(&dir)
                .stdin(Stdio::null())
                .output()
        };
        let out = tokio::task::spawn_blocking(run).await??;
        anyhow::ensure!(out.status.success(), "graphile-worker failed: {}", String::from_utf8_lossy(&out.stderr));
        let line = String::from_utf8_lossy(&out.stdout);
        let v: Value =
            serde_json::from_str(line.lines().last().unwrap_or_default()).context("graphile-worker's answer")?;
        if let Some(version) = v["version"].as_str() {
            self.version = version.to_string();
        }
        Ok(v)
    }

    /// One drain pass with its defaults, then one with its batching, then
    /// one with its batching at equal work, each of freshly enqueued jobs;
    /// `pool` is any database of the same server (its counters and CPU are
    /// the server's).
    pub async fn drain_pass(&mut self, pool: &PgPool, args: &BenchArgs) -> anyhow::Result<Pass> {
        let (defaults, defaults_costs) = self.drain_one(pool, args, "defaults").await?;
        let (batched, batched_costs) = self.drain_one(pool, args, "batched").await?;
        let (equal, equal_costs) = self.drain_one(pool, args, "equal").await?;
        Ok(Pass { defaults, batched, equal, defaults_costs, batched_costs, equal_costs })
    }

    /// One drain pass with `preset`: jobs/s and its costs per job. The
    /// server's counters and CPU are read around the pass's process (its
    /// start and its connection's few statements are in them too: a few
    /// milliseconds against the pass's seconds).
    async fn drain_one(&mut self, pool: &PgPool, args: &BenchArgs, preset: &str) -> anyhow::Result<(f64, Costs)> {
        self.node(args, if preset == "equal" { "prepare-equal" } else { "prepare" }).await?;
        let server = sql::ServerMarks::read(pool).await?;
        let v = self.node(args, preset).await?;
        let server = server.per(pool, args.runs as f64).await?;
        let costs = Costs {
            commits_per_job: server.commits,
            wal_bytes_per_job: server.wal_bytes,
            node_cpu_us: num(&v, &["pass", "cpu_us_per_job"])?,
            server_cpu_us: server.cpu_us,
        };
        Ok((num(&v, &["pass", "rate"])?, costs))
    }

    /// Pickup latency, addJob resolved to task start: p50 and p99 in ms;
    /// and the p50 from addJob's call.
    pub async fn pickup(&mut self, args: &BenchArgs) -> anyhow::Result<(f64, f64, f64)> {
        let v = self.node(args, "pickup").await?;
        Ok((
            num(&v, &["pickup", "p50_ms"])?,
            num(&v, &["pickup", "p99_ms"])?,
            num(&v, &["pickup", "from_call_p50_ms"])?,
        ))
    }

    /// graphile-worker's figures beside ours and the ratios: `ours` and
    /// `theirs` are the drain passes, interleaved one by one in the same
    /// sitting, so each ratio is of two passes run moments apart.
    pub async fn compare(
        &mut self,
        args: &BenchArgs,
        ours: &[f64],
        theirs: &[Pass],
        claimed: PickupP50,
        eager: PickupP50,
    ) -> anyhow::Result<()> {
        let (p50, p99, call_p50) = self.pickup(args).await?;
        let version = &self.version;
        let mut defaults: Vec<f64> = theirs.iter().map(|p| p.defaults).collect();
        let mut batched: Vec<f64> = theirs.iter().map(|p| p.batched).collect();
        let mut equal: Vec<f64> = theirs.iter().map(|p| p.equal).collect();
        let mut to_defaults: Vec<f64> = ours.iter().zip(theirs).map(|(o, t)| o / t.defaults).collect();
        let mut to_batched: Vec<f64> = ours.iter().zip(theirs).map(|(o, t)| o / t.batched).collect();
        let mut to_equal: Vec<f64> = ours.iter().zip(theirs).map(|(o, t)| o / t.equal).collect();
        let list = |v: &[f64]| v.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ");
        let (d_list, b_list, e_list) = (list(&to_defaults), list(&to_batched), list(&to_equal));
        println!(
            "graphile-worker {version}, same server, drain {} jobs, {} in flight: defaults median {:.0} jobs/s, \
             batched (local queue, batched completions) median {:.0} jobs/s, \
             equal work (batched, each task writing what a no-op run writes) median {:.0} jobs/s over {} passes",
            args.runs,
            args.in_flight,
            median(&mut defaults),
            median(&mut batched),
            median(&mut equal),
            theirs.len()
        );
        println!(
            "graphile-worker {version} costs per job (medians): defaults {}; batched {}; equal work {}",
            Costs::medians(theirs.iter().map(|p| p.defaults_costs)).line(),
            Costs::medians(theirs.iter().map(|p| p.batched_costs)).line(),
            Costs::medians(theirs.iter().map(|p| p.equal_costs)).line()
        );
        println!(
            "graphile-worker {version} pickup, idle worker, {} jobs: addJob resolved to task start p50 {p50:.2} ms, \
             p99 {p99:.2} ms; addJob called to task start p50 {call_p50:.2} ms",
            args.samples
        );
        println!(
            "ratio agent-host drain / graphile-worker defaults, pass by pass: median {:.2} ({d_list}); \
             / batched: median {:.2} ({b_list}); / equal work: median {:.2} ({e_list})",
            median(&mut to_defaults),
            median(&mut to_batched),
            median(&mut to_equal)
        );
        println!(
            "ratio agent-host pickup p50 / graphile-worker pickup p50, from the commit: claimed {:.2}, eager start {:.2}; \
             from the call: claimed {:.2}, eager start {:.2}",
            claimed.from_commit / p50,
            eager.from_commit / p50,
            claimed.from_call / call_p50,
            eager.from_call / call_p50
        );
        Ok(())
    }
}

/// The number at `path` in graphile-worker's answer.
fn num(v: &Value, path: &[&str]) -> anyhow::Result<f64> {
    let mut at = v;
    for p in path {
        at = &at[*p];
    }
    at.as_f64().with_context(|| format!("graphile-worker's answer has no {}", path.join(".")))
}
