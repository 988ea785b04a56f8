//! The benchmark still runs: its `--help`, and one whole run at the smallest
//! settings against real PostgreSQL (DATABASE_URL's server, or a private
//! cluster), printing every figure in the documented format.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The integration tests' wait helpers (standard library and tokio only).
#[allow(dead_code)]
#[path = "../../tests/support/wait.rs"]
mod wait;

const BENCH: &str = env!("CARGO_BIN_EXE_agent-host-bench");
/// Bound on the whole small run.
const RUN_MAX: Duration = Duration::from_secs(600);

#[test]
fn help_lists_the_benchmark_flags() {
    let out = Command::new(BENCH).arg("--help").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--runs",
        "--in-flight",
        "--passes",
        "--samples",
        "--plugin-dir",
        "--parked",
        "--resume-runs",
        "--replays",
        "--replay-calls",
        "--decisions",
        "--waiting",
        "--database-url",
        "--compare",
        "--queue-only",
        "--live",
    ] {
        assert!(help.contains(flag), "--help does not list {flag}:\n{help}");
    }
}

#[test]
fn zero_counts_are_refused() {
    let out = Command::new(BENCH).args(["--passes", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--passes"), "{out:?}");
}

/// The repository's root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One run of the benchmark with `args` (split at white space), on a
/// throwaway database and scratch directory named after `name`: its
/// standard output, once it has exited successfully.
fn small_run(name: &str, args: &str) -> String {
    let root = root();
    let scratch = std::env::temp_dir().join(format!("agent-host-bench-{name}-{}", std::process::id()));
    let database = format!("agent_host_bench_{name}_{}", std::process::id());
    let mut cmd = Command::new(BENCH);
    cmd.args(args.split_whitespace())
        .args(["--bench-database", &database])
        .arg("--plugin-dir")
        .arg(root.join("plugins/target/wasm32-wasip2/release"))
        .arg("--cache-dir")
        .arg(scratch.join("cache"))
        .arg("--data-dir")
        .arg(scratch.join("pg"))
        .env_remove("AGENT_HOST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut status = None;
    let exited = wait::poll_until_blocking(RUN_MAX, || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the small benchmark run took over {RUN_MAX:?}");
    }
    let status = status.expect("the exit status it was seen with");
    let mut stdout = String::new();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut stdout).unwrap();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    if let Ok(url) = std::env::var("DATABASE_URL") {
        drop_database(&url, &database);
        drop_database(&url, &format!("{database}_graphile"));
    }
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(status.success(), "exit {status:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    stdout
}

/// Asserts that `stdout` has a line starting with each of `expected`, in order.
fn assert_lines_in_order(stdout: &str, expected: &[&str]) {
    let lines: Vec<&str> = stdout.lines().collect();
    let mut at = 0;
    for want in expected {
        let Some(i) = lines[at..].iter().position(|l| l.starts_with(want)) else {
            panic!("no line starting {want:?} (in order) in:\n{stdout}");
        };
        at += i + 1;
    }
}

#[test]
fn a_small_run_prints_every_figure() {
    // The comparison has a test of its own.
    let stdout = small_run(
        "smoke",
        "--runs 40 --in-flight 4 --passes 1 --samples 3 --parked 3 --kills 1 --resume-runs 40 --replays 2 \
         --replay-calls 20 --decisions 3 --waiting 5 --compare none",
    );
    let mut expected = vec![
        "agent-host bench: ",
        "enqueue over HTTP, 3 sequential POST /v1/runs: p50 ",
        "pickup, idle worker, claimed, hub up, 3 runs:",
        "  enqueue commit to agent start: p50 ",
        "  enqueue call to agent start:   p50 ",
        "pickup, idle worker, eager start (",
        "  enqueue commit to agent start: p50 ",
        "  enqueue call to agent start:   p50 ",
        "pickup, idle worker, claimed, hub down, poll tick 100ms, 3 runs:",
        "  enqueue commit to agent start: p50 ",
        "  pass 1: end to end ",
        "drain 40 pre-enqueued no-op runs, 4 in flight: median ",
        "drain costs per run (medians): ",
        "SQL floor, 4 connections each claiming one run and finishing it: median ",
        "batched SQL floor, one claim of up to 4 runs, finished on 4 connections: median ",
        "ratio end to end / SQL floor: ",
        "emit to SSE client (a structural event, through journal, NOTIFY and HTTP), 200 events: p50 ",
        "journal rows for 1000 content deltas emitted back to back: ",
        "SIGKILL to failed (lease 1 s, reap grace 0.3 s, reaper every 100 ms), 1 kills: p50 ",
        "call-tool round trip, no-op tool, at-most-once, 3 calls: p50 ",
        "call-tool round trip, no-op tool, resumable (recorded), 3 calls: p50 ",
        "ratio call-tool p50 resumable / at-most-once: ",
        "  pass 1: at-most-once ",
        "drain 40 no-op runs, 4 in flight, at-most-once: median ",
        "ratio drain resumable / at-most-once: ",
        "SIGKILL to run_resumed by another worker (lease 1 s, reap grace 0.3 s, reaper every 100 ms), 1 kills: p50 ",
        "replay of 20 recorded calls, resumed attempt's claim to agent live after the last, 2 runs: p50 ",
        "replay of 20 recorded calls, run_resumed row to agent live after the last, 2 runs: p50 ",
        "approval decision, POST /v1/runs/{id}/approvals/{call_id} answered, 3 decisions: p50 ",
        "approval decision to run_resumed row (hub up), 3 decisions: p50 ",
        "approval decision to the approved tool's call starting (hub up), 3 decisions: p50 ",
        "5 runs waiting for approval, one host (32 slots): RSS idle ",
    ];
    if root().join("plugins/target/wasm32-wasip2/release/echo.wasm").exists() {
        expected.extend([
            "sandbox: store + instantiate + trivial run, 3 runs: p50 ",
            "sandbox: one emit-event (content_delta) host call: p50 ",
            "cancel to terminal, cooperative guest, 3 runs: p50 ",
            "cancel to terminal, guest ignoring cancel, grace 500 ms, 3 runs: p50 ",
            "sandbox: 3 guests parked in a host call: process RSS ",
        ]);
    }
    assert_lines_in_order(&stdout, &expected);
    // The eager path started runs in their enqueue (not one fell back to a claim).
    let eager = stdout.lines().find(|l| l.starts_with("pickup, idle worker, eager start (")).unwrap();
    assert!(!eager.contains("(0 of"), "{eager}");
    let waiting = stdout.lines().find(|l| l.contains("runs waiting for approval")).unwrap();
    assert!(waiting.contains("slots held 0, runs running 0"), "a waiting run holds a slot: {waiting}");
}

/// The comparison with graphile-worker (pinned in bench/graphile, installed
/// from the npm registry into the cache once; the test command makes sure
/// Node is present): one pass of it interleaved with each of ours, its
/// first on even passes, and a ratio per pair, with each preset's, the
/// equal-work one (its tasks writing what a no-op run writes) among them.
#[test]
fn the_comparison_interleaves_graphile_workers_passes_with_ours() {
    let stdout = small_run("compare", "--queue-only --runs 40 --in-flight 4 --passes 2 --samples 3 --compare graphile");
    assert_lines_in_order(
        &stdout,
        &[
            "  pass 1: end to end ",
            "  pass 1: graphile-worker defaults ",
            "  pass 2: end to end ",
            "  pass 2: graphile-worker defaults ",
            "drain 40 pre-enqueued no-op runs, 4 in flight: median ",
            "graphile-worker 0.18.",
            "graphile-worker 0.18.0 costs per job (medians): defaults ",
            "graphile-worker 0.18.0 pickup, idle worker, 3 jobs: addJob resolved to task start p50 ",
            "ratio agent-host drain / graphile-worker defaults, pass by pass: median ",
            "ratio agent-host pickup p50 / graphile-worker pickup p50, from the commit: claimed ",
        ],
    );
    // Each pass's ratio is of that pass's two rates, and the median is of
    // those ratios.
    let number = |l: &str, after: &str| -> f64 {
        let rest = &l[l.find(after).unwrap_or_else(|| panic!("no {after:?} in {l:?}")) + after.len()..];
        rest.split(|c: char| !(c.is_ascii_digit() || c == '.')).next().unwrap().parse().unwrap()
    };
    let mut ratios = Vec::new();
    for pass in 1..=2 {
        let line = |what: &str| {
            let start = format!("  pass {pass}: {what}");
            stdout.lines().find(|l| l.starts_with(&start)).unwrap_or_else(|| panic!("no {start:?} in:\n{stdout}"))
        };
        let ours = number(line("end to end"), "end to end ");
        let theirs = line("graphile-worker");
        let (defaults, ratio) = (number(theirs, "defaults "), number(theirs, "(ratios "));
        assert!(ours > 0.0 && defaults > 0.0, "{theirs}");
        assert!(
            (ratio - ours / defaults).abs() <= 0.01 + 0.005 * ours / defaults,
            "{ours} / {defaults} is not {ratio}"
        );
        ratios.push(ratio);
        // The equal-work preset's ratio is the third.
        let equal = number(theirs, "equal work ");
        let third = &theirs[theirs.find("(ratios ").unwrap()..];
        let third: f64 = third.trim_end_matches(')').rsplit(", ").next().unwrap().parse().unwrap();
        assert!(equal > 0.0, "{theirs}");
        assert!((third - ours / equal).abs() <= 0.01 + 0.005 * ours / equal, "{ours} / {equal} is not {third}");
    }
    // Its costs per job are read as ours are: every job wrote at least one
    // commit, and Node and the (local) server each spent CPU on it.
    let costs = stdout.lines().find(|l| l.contains(" costs per job (medians): defaults ")).unwrap();
    for preset in ["defaults ", "batched ", "equal work "] {
        let part = &costs[costs.find(preset).unwrap()..];
        assert!(number(part, preset) > 0.0, "no commits per job: {costs}");
        assert!(number(part, "CPU node ") > 0.0 && number(part, "database ") > 0.0, "{costs}");
    }
    let summary = stdout.lines().find(|l| l.starts_with("ratio agent-host drain / graphile-worker")).unwrap();
    let median = number(summary, "pass by pass: median ");
    assert!((median - (ratios[0] + ratios[1]) / 2.0).abs() <= 0.011, "{summary}: not the median of {ratios:?}");
    assert!(number(summary, "/ equal work: median ") > 0.0, "{summary}");
}

/// Drops the run's throwaway database on DATABASE_URL's server.
fn drop_database(url: &str, name: &str) {
    let base = url.rsplit_once('/').map(|(b, _)| b).unwrap_or(url);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use sqlx::Connection;
        let mut admin = sqlx::PgConnection::connect(&format!("{base}/postgres")).await.unwrap();
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut admin).await.unwrap();
        admin.close().await.unwrap();
    });
}
