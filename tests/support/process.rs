//! Real host processes for multi-process tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// One `agent-host serve` process; killed (SIGKILL) when dropped.
pub struct HostProcess {
    pub child: Child,
    pub addr: String,
    pub worker_id: String,
    log: Arc<Mutex<String>>,
}

/// Flags with short leases and ticks, set through configuration.
pub const FAST: &[&str] = &[
    "--lease-ms",
    "1000",
    "--heartbeat-ms",
    "200",
    "--reap-grace-ms",
    "300",
    "--reap-interval-ms",
    "100",
    "--poll-tick-ms",
    "500",
];

impl HostProcess {
    pub fn spawn(database_url: &str, worker_id: &str, args: &[&str]) -> HostProcess {
        HostProcess::spawn_with_env(database_url, worker_id, args, &[])
    }

    /// [`HostProcess::spawn`] with `env` set for the process only (it may
    /// set `AGENT_HOST_LOG`).
    pub fn spawn_with_env(database_url: &str, worker_id: &str, args: &[&str], env: &[(&str, &str)]) -> HostProcess {
        // The tests' built-in agents, and every slot for one tenant (the
        // tests of the tenants' shares spawn with [`HostProcess::spawn_sharing`]).
        HostProcess::spawn_inner(database_url, worker_id, &["--tenant-slot-share-pct", "100"], args, env)
    }

    /// [`HostProcess::spawn`] at the host's default tenant share.
    pub fn spawn_sharing(database_url: &str, worker_id: &str, args: &[&str]) -> HostProcess {
        HostProcess::spawn_inner(database_url, worker_id, &[], args, &[])
    }

    fn spawn_inner(
        database_url: &str,
        worker_id: &str,
        defaults: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
    ) -> HostProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_agent-host"))
            .args(["serve", "--database-url", database_url, "--db-pool-max", "8", "--listen", "127.0.0.1:0"])
            .args(["--worker-id", worker_id, "--builtin-agents"])
            .args(defaults)
            .args(args)
            .env("AGENT_HOST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning agent-host");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("agent-host listening on http://") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => panic!("agent-host did not start; log:\n{}", log.lock().unwrap()),
        };
        HostProcess { child, addr, worker_id: worker_id.to_string(), log }
    }

    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).expect("signalling agent-host");
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits for the process to exit, at most `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let mut status = None;
        let exited = super::poll_until(within, || {
            status = self.child.try_wait().unwrap();
            std::future::ready(status.is_some())
        })
        .await;
        assert!(exited, "agent-host did not exit within {within:?}; log:\n{}", self.log());
        status.expect("the exit status it was seen with")
    }

    /// Waits until the process's log contains `needle`.
    pub async fn wait_log(&self, needle: &str, within: Duration) {
        let said = || async { self.log().contains(needle) };
        assert!(super::poll_until(within, said).await, "log never said {needle:?} within {within:?}:\n{}", self.log());
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
