//! graphile-worker on the same server in the same sitting: its drain (with
//! its defaults and with its batching) and its pickup, beside ours, and the
//! ratios. Runs only when Node is on PATH (and `--compare graphile`): the
//! pinned package (`bench/graphile/package.json` and its lock) is installed
//! with `npm ci` into a cache outside the clone,
//! `${XDG_CACHE_HOME:-$HOME/.cache}/agent-host/graphile-<lock hash>`, once.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Context;
use serde_json::Value;

use crate::queue::Drained;
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

/// graphile-worker's drain and pickup on `server_url`'s server (a database
/// of its own beside ours), and the ratios to `ours`.
pub async fn compare(server_url: &str, args: &BenchArgs, ours: &Drained, pickup_p50_ms: f64) -> anyhow::Result<()> {
    if !node_present() {
        println!("graphile-worker comparison: skipped (no node/npm on PATH)");
        return Ok(());
    }
    let dir = tokio::task::spawn_blocking(install).await??;
    let url = sql::fresh_database(server_url, &format!("{}_graphile", args.bench_database)).await?;
    let run = {
        let (url, args) = (url.clone(), args.clone());
        move || {
            Command::new("node")
                .arg("drain.js")
                .args([&url, &args.runs.to_string(), &args.in_flight.to_string(), &args.passes.to_string()])
                .arg(args.samples.to_string())
                .current_dir(&dir)
                .stdin(Stdio::null())
                .output()
        }
    };
    let out = tokio::task::spawn_blocking(run).await??;
    anyhow::ensure!(out.status.success(), "graphile-worker's drain failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(line.lines().last().unwrap_or_default()).context("graphile-worker's answer")?;
    let num = |path: &[&str]| -> anyhow::Result<f64> {
        let mut at = &v;
        for p in path {
            at = &at[*p];
        }
        at.as_f64().with_context(|| format!("graphile-worker's answer has no {}", path.join(".")))
    };
    let (defaults, batched) = (num(&["defaults", "median"])?, num(&["batched", "median"])?);
    let (p50, p99) = (num(&["pickup", "p50_ms"])?, num(&["pickup", "p99_ms"])?);
    let version = v["version"].as_str().unwrap_or("?");
    println!(
        "graphile-worker {version}, same server, drain {} jobs, {} in flight: defaults median {defaults:.0} jobs/s, \
         batched (local queue, batched completions) median {batched:.0} jobs/s over {} passes",
        args.runs, args.in_flight, args.passes
    );
    println!("graphile-worker {version} pickup, addJob to task start, idle worker, {} jobs: p50 {p50:.2} ms, p99 {p99:.2} ms", args.samples);
    println!(
        "ratio agent-host drain / graphile-worker defaults: {:.2}; / batched: {:.2}",
        ours.rate / defaults,
        ours.rate / batched
    );
    println!("ratio agent-host pickup p50 / graphile-worker pickup p50: {:.2}", pickup_p50_ms / p50);
    Ok(())
}
