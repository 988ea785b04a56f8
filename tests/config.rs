//! Configuration that would busy-loop or overcommit is refused at start, with
//! a message naming the flag: through the validate function for every such
//! flag, and through the real binary (exit status 2 and stderr) for a few,
//! before it opens any database.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agent_host::config::{Cli, ConfigError};
use agent_host::sandbox::INSTANCES_MAX;
use clap::Parser;

fn parse(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("agent-host").chain(args.iter().copied())).expect("the flags parse")
}

fn refusal(args: &[&str]) -> ConfigError {
    match parse(args).validate() {
        Ok(()) => panic!("{args:?} was accepted"),
        Err(e) => e,
    }
}

#[test]
fn the_defaults_are_accepted() {
    parse(&["serve"]).validate().unwrap();
    parse(&["migrate"]).validate().unwrap();
}

#[test]
fn every_zero_that_would_spin_or_stall_is_refused_naming_its_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["serve", "--sse-keepalive-ms", "0"], "--sse-keepalive-ms"),
        (&["--db-pool-max", "0", "serve"], "--db-pool-max"),
        (&["--db-pool-max", "0", "migrate"], "--db-pool-max"),
        (&["serve", "--max-runs", "0"], "--max-runs"),
        (&["serve", "--lease-ms", "0"], "--lease-ms"),
        (&["serve", "--heartbeat-ms", "0"], "--heartbeat-ms"),
        (&["serve", "--reap-interval-ms", "0"], "--reap-interval-ms"),
        (&["serve", "--poll-tick-ms", "0"], "--poll-tick-ms"),
        (&["serve", "--journal-flush-ms", "0"], "--journal-flush-ms"),
        (&["serve", "--retention-interval-ms", "0"], "--retention-interval-ms"),
        (&["serve", "--tenant-max-running", "0"], "--tenant-max-running"),
        (&["serve", "--llm-timeout-ms", "0"], "--llm-timeout-ms"),
        (&["serve", "--llm-idle-timeout-ms", "0"], "--llm-idle-timeout-ms"),
    ];
    for (args, flag) in cases {
        let e = refusal(args);
        assert!(matches!(e, ConfigError::Zero { flag: f, .. } if f == *flag), "{args:?}: {e:?}");
        let message = e.to_string();
        assert!(message.starts_with(flag), "{args:?}: the message does not name {flag}: {message}");
    }
}

#[test]
fn max_runs_above_the_sandbox_instance_pool_is_refused() {
    let at = INSTANCES_MAX.to_string();
    parse(&["serve", "--max-runs", &at]).validate().unwrap();
    let above = (INSTANCES_MAX + 1).to_string();
    let e = refusal(&["serve", "--max-runs", &above]);
    assert_eq!(
        e,
        ConfigError::MaxRunsAboveInstances { max_runs: INSTANCES_MAX as usize + 1, instances: INSTANCES_MAX }
    );
    let message = e.to_string();
    assert!(message.contains("--max-runs") && message.contains(&at), "{message}");
}

#[test]
fn a_heartbeat_not_below_the_lease_is_still_refused() {
    let e = refusal(&["serve", "--lease-ms", "1000", "--heartbeat-ms", "1000"]);
    assert_eq!(e, ConfigError::HeartbeatNotBelowLease { heartbeat_ms: 1000, lease_ms: 1000 });
    let message = e.to_string();
    assert!(message.contains("--heartbeat-ms") && message.contains("--lease-ms"), "{message}");
    parse(&["serve", "--lease-ms", "1000", "--heartbeat-ms", "999"]).validate().unwrap();
}

/// Runs the real binary with `args` (and `env`) against a database that
/// refuses connections, so that only a refusal made before opening the
/// database can name the flag. Returns (exit code, stderr).
fn run_binary(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_agent-host"));
    cmd.args(["--database-url", "postgres://postgres@127.0.0.1:1/refused"]).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("agent-host {args:?} did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    (status.code(), stderr)
}

#[test]
fn the_binary_refuses_at_start_with_the_flag_in_its_message() {
    let over = (INSTANCES_MAX + 1).to_string();
    let cases: &[(&[&str], &[(&str, &str)], &str)] = &[
        (&["serve", "--sse-keepalive-ms", "0"], &[], "--sse-keepalive-ms"),
        (&["--db-pool-max", "0", "serve"], &[], "--db-pool-max"),
        (&["serve", "--max-runs", &over], &[], "--max-runs"),
        // The environment fallback is checked like the flag.
        (&["serve"], &[("AGENT_HOST_POLL_TICK_MS", "0")], "--poll-tick-ms"),
    ];
    for (args, env, flag) in cases {
        let (code, stderr) = run_binary(args, env);
        assert_eq!(code, Some(2), "{args:?} {env:?}: exit {code:?}, stderr:\n{stderr}");
        assert!(stderr.contains(flag), "{args:?} {env:?}: stderr does not name {flag}:\n{stderr}");
        assert!(!stderr.contains("connecting to PostgreSQL"), "{args:?}: refused only after opening the database");
    }
}
