//! `agent-host dev` (issue 42): the author's loop in one command, run as a
//! real process from a project made by `agent-host new` outside the
//! checkout. On a private host of its own it builds the project, registers
//! it, runs the turn (through the offline model and the `clock` tool the
//! manifest grants) and prints the stream; an edit of the source is built,
//! registered under a new digest and run again; a broken edit is reported
//! and the watch goes on; Ctrl-C stops it and removes its cluster. With
//! `--url` and a token it uses a running host instead, and `--once` exits
//! by the run's status.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::projects::{agent_host, said, scratch};
use crate::support::process::{HostProcess, FAST};
use crate::support::*;

/// A real `agent-host dev` with its stdout and stderr in one log.
struct Dev {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Dev {
    fn spawn(dir: &Path, args: &[&str]) -> Dev {
        let mut child = Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .current_dir(dir)
            .arg("dev")
            .args(args)
            .env("CARGO_TARGET_DIR", crate::docs::rust_target())
            .env_remove("AGENT_HOST_URL")
            .env_remove("AGENT_HOST_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning agent-host dev");
        let log = Arc::new(Mutex::new(String::new()));
        for out in
            [Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>, Box::new(child.stderr.take().unwrap())]
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        Dev { child, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until `needle` is in the log `n` times.
    async fn wait_count(&self, needle: &str, n: usize, within: Duration) {
        let seen = || async { self.log().matches(needle).count() >= n };
        assert!(poll_until(within, seen).await, "never {n} × {needle:?} within {within:?}:\n{}", self.log());
    }

    /// The digests registered so far, in order.
    fn digests(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter_map(|l| l.strip_prefix("dev: registered "))
            .map(|l| l.split(['(', ')']).nth(1).unwrap().to_string())
            .collect()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The private clusters `dev` made in the temporary directory.
fn clusters() -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("agent-host-dev-"))
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_builds_registers_and_runs_a_turn_then_again_on_each_change_and_ctrl_c_ends_it() {
    let dir = scratch("dev");
    let made = agent_host(&dir, &["new", "hello", "--lang", "python"]);
    assert!(made.status.success(), "{}", said(&made));
    let project = dir.join("hello");
    // The private host has the demo's clock: granted, the offline model calls it.
    let manifest = project.join("manifest.json");
    let mut grants: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    grants["tools"] = serde_json::json!(["llm", "clock"]);
    std::fs::write(&manifest, grants.to_string()).unwrap();

    let before = clusters();
    let mut dev = Dev::spawn(&project, &["--prompt", "What time is it?"]);
    let long = Duration::from_secs(600);
    dev.wait_count("dev: watching", 1, long).await;
    // The answer is on stdout, the narration on stderr: two pipes, read by
    // two threads, so the answer may reach the log after "watching".
    dev.wait_count("Offline reply to: What time is it? Tool clock said: it is ", 1, long).await;
    let log = dev.log();
    assert!(log.contains("dev: host at http://127.0.0.1:"), "{log}");
    assert_eq!(log.matches(" completed\n").count(), 1, "{log}");
    assert_eq!(clusters().len(), before.len() + 1, "its cluster: {:?}", clusters());

    // An edit: built, registered under a new digest, run again.
    let app = project.join("app.py");
    let source = std::fs::read_to_string(&app).unwrap();
    let edited = source.replace(
        r#"{"role": "user", "content": turn.content}"#,
        r#"{"role": "user", "content": "edited: " + turn.content}"#,
    );
    assert_ne!(edited, source, "the template's answer line moved");
    std::fs::write(&app, &edited).unwrap();
    dev.wait_count("dev: watching", 2, long).await;
    dev.wait_count("Offline reply to: edited: What time is it? Tool clock said:", 1, long).await;
    let log = dev.log();
    assert!(log.contains("app.py changed"), "{log}");
    let digests = dev.digests();
    assert_eq!(digests.len(), 2, "{log}");
    assert_ne!(digests[0], digests[1], "{log}");

    // A broken edit: the build's failure is reported, the watch goes on, and
    // the fix is built and run.
    std::fs::write(&app, format!("{edited}\ndef broken(:\n")).unwrap();
    dev.wait_count("dev: watching", 3, long).await;
    let log = dev.log();
    assert!(log.contains("building") && log.contains("failed"), "{log}");
    assert_eq!(dev.digests().len(), 2, "a broken build registered something: {log}");
    std::fs::write(&app, edited.replace("edited: ", "fixed: ")).unwrap();
    dev.wait_count("dev: watching", 4, long).await;
    dev.wait_count("Offline reply to: fixed: What time is it?", 1, long).await;
    assert_eq!(dev.digests().len(), 3, "{}", dev.log());
    assert_eq!(dev.log().matches(" completed\n").count(), 3, "{}", dev.log());

    // Ctrl-C: the host drains and its cluster is removed.
    kill(Pid::from_raw(dev.child.id() as i32), Signal::SIGINT).unwrap();
    let mut status = None;
    let exited = poll_until(Duration::from_secs(60), || {
        status = dev.child.try_wait().unwrap();
        std::future::ready(status.is_some())
    })
    .await;
    assert!(exited, "dev did not exit on SIGINT:\n{}", dev.log());
    assert!(status.unwrap().success(), "{}", dev.log());
    assert!(dev.log().contains("dev: stopped"), "{}", dev.log());
    assert_eq!(clusters(), before, "its cluster was left behind");

    // --url: a running host (a tenant admin's token), one round, exit 0; the
    // run is the host's, pinned to the digest registered.
    let db = TestDb::new().await;
    let host = HostProcess::spawn(&db.url, "dev", FAST);
    let token = agent_host::db::tokens::create(&db.pool, "author", "makers", true).await.unwrap();
    let url = format!("http://{}", host.addr);
    let mut once = Dev::spawn(&project, &["--once", "--url", &url, "--token", &token, "--prompt", "hi"]);
    let mut status = None;
    let exited = poll_until(long, || {
        status = once.child.try_wait().unwrap();
        std::future::ready(status.is_some())
    })
    .await;
    assert!(exited, "dev --once did not end:\n{}", once.log());
    assert!(status.unwrap().success(), "{}", once.log());
    assert!(once.log().contains("Offline reply to: fixed: hi"), "{}", once.log());
    let digest = once.digests().pop().expect("registered");
    let pinned: Vec<(Option<String>, String)> =
        sqlx::query_as("SELECT plugin_digest, status FROM agent_run").fetch_all(&db.pool).await.unwrap();
    assert_eq!(pinned, vec![(Some(digest), "completed".to_string())]);
    // A token the host refuses: said, and exit status 1.
    let refused = agent_host(&project, &["dev", "--once", "--url", &url, "--token", "ah_nope", "--prompt", "hi"]);
    assert!(!refused.status.success());
    assert!(said(&refused).contains("401"), "{}", said(&refused));
    let _ = std::fs::remove_dir_all(&dir);
}
