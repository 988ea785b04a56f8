//! `agent-host dev [DIR]`: the author's loop in one command. Builds the
//! project (`project::build`), registers the component on a host over HTTP
//! (`POST /v1/plugins`, as `plugins upload` does), runs a turn with the
//! prompt (`POST /v1/runs`, pinned to the digest just registered) and prints
//! its stream as `runs create` does; then watches the project's sources and
//! does it all again on each change. A build that fails is reported and the
//! watch goes on; the next change tries again.
//!
//! The host is `--url` (with a tenant admin's token), or a private one this
//! process starts: the same [`Host`] `serve` runs, on a PostgreSQL cluster
//! in a temporary directory (fsync off, removed on exit), with a token of
//! its own, the model and tools its flags describe and the demo's `clock`.
//! Ctrl-C asks the run in flight to stop, then stops the host.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::{json, Value};

use crate::cli::args::{Cli, Command, DevArgs, ServeArgs, TenantTools};
use crate::cli::client::{self, Api};
use crate::cli::serve::{Host, ShutdownSignal};

/// The private host's tenant and user.
const DEV_TENANT: &str = "dev";
/// How often the sources are looked at for a change.
const WATCH_TICK: Duration = Duration::from_millis(300);
/// Files a project may hold and still be watched (past it, the rest are not).
const WATCHED_FILES_MAX: usize = 20_000;
/// How long a stop asked for at Ctrl-C may take to be accepted.
const STOP_REQUEST_MAX: Duration = Duration::from_secs(5);

/// Runs the loop; `Ok(false)` when `--once` and the run did not complete.
pub async fn run(args: &DevArgs) -> anyhow::Result<bool> {
    let dir = std::path::absolute(&args.dir)?;
    if !dir.is_dir() {
        bail!("{} is not a directory (a project made by `agent-host new`)", dir.display());
    }
    let name = match &args.name {
        Some(n) => n.clone(),
        None => dir.file_name().and_then(|n| n.to_str()).context("the project's directory has no name")?.to_string(),
    };
    if !crate::db::plugins::valid_name(&name) {
        bail!("{name:?} is not a plugin name (a-z, 0-9, _ and -, starting with a letter): give --name");
    }
    let config: Option<Value> = match &args.config {
        Some(c) => Some(serde_json::from_str(c).context("--config is not JSON")?),
        None => None,
    };
    let mut shutdown = ShutdownSignal::install().context("installing signal handlers")?;
    let (api, host) = match &args.url {
        Some(url) => {
            let token = args.token.clone().context("--url needs a token: give --token or set AGENT_HOST_TOKEN")?;
            let url = url.trim_end_matches('/').to_string();
            (Api { http: reqwest::Client::new(), url, token }, None)
        }
        None => {
            eprintln!("dev: starting a private host (its own PostgreSQL cluster, removed on exit)");
            let serve = private_host_args(args, &dir)?;
            let host = Host::start(&serve.db, &serve, true).await?;
            let token = crate::db::tokens::create(&host.pool, DEV_TENANT, DEV_TENANT, true).await?;
            let url = format!("http://{}", host.addr);
            eprintln!("dev: host at {url} (console: sign in with {token})");
            (Api { http: reqwest::Client::new(), url, token }, Some(host))
        }
    };
    let round = Round { api: &api, dir: &dir, name: &name, prompt: &args.prompt, config, in_flight: Arc::default() };
    let in_flight = round.in_flight.clone();
    let outcome = tokio::select! {
        r = round.repeat(args.once) => r,
        _ = shutdown.recv() => {
            let run = in_flight.lock().expect("in flight").take();
            if let Some(id) = run {
                let path = format!("/v1/runs/{id}/cancel");
                match tokio::time::timeout(STOP_REQUEST_MAX, api.call(reqwest::Method::POST, &path, None)).await {
                    Ok(Ok(_)) => eprintln!("\ndev: asked run {id} to stop"),
                    Ok(Err(e)) => eprintln!("\ndev: stopping run {id}: {e:#}"),
                    Err(_) => eprintln!("\ndev: stopping run {id}: no answer within {STOP_REQUEST_MAX:?}"),
                }
            }
            eprintln!("dev: stopped");
            Ok(true)
        }
    };
    if let Some(host) = host {
        host.stop().await;
    }
    outcome
}

/// The private host's configuration: `serve`'s defaults (and `AGENT_HOST_*`
/// from the environment), on an ephemeral cluster of its own, never
/// DATABASE_URL (its worker would run whatever is queued there), with this
/// command's model and tools flags, every tools-file entry open to the
/// author's tenant, and the project's compiled components cached in its
/// `target/`.
fn private_host_args(args: &DevArgs, dir: &Path) -> anyhow::Result<ServeArgs> {
    let cli = Cli::try_parse_from(["agent-host", "serve"]).context("the private host's defaults")?;
    let Command::Serve(mut serve) = cli.command else { unreachable!("parsed as serve") };
    serve.db.database_url = None;
    serve.db.listen_database_url = None;
    serve.db.data_dir = std::env::temp_dir().join(format!("agent-host-dev-{}", uuid::Uuid::new_v4().simple()));
    serve.db.ephemeral = true;
    serve.db.cache_dir = dir.join("target").join("agent-host-cache");
    serve.db.db_pool_max = 8;
    serve.listen = args.listen;
    serve.demo = false;
    serve.builtin_agents = false;
    serve.tools = args.tools.clone();
    serve.tools.tenant_tools = TenantTools::All;
    Ok(*serve)
}

/// What one round does, and the run it is following (for Ctrl-C).
struct Round<'a> {
    api: &'a Api,
    dir: &'a Path,
    name: &'a str,
    prompt: &'a str,
    config: Option<Value>,
    in_flight: Arc<Mutex<Option<String>>>,
}

impl Round<'_> {
    /// Rounds until Ctrl-C (or one, with `once`).
    async fn repeat(&self, once: bool) -> anyhow::Result<bool> {
        loop {
            // Taken before the build: a change made while it builds or runs
            // starts the next round at once.
            let seen = Sources::read(self.dir);
            let outcome = self.once().await;
            if once {
                return outcome;
            }
            if let Err(e) = outcome {
                eprintln!("dev: {e:#}");
            }
            eprintln!("dev: watching {} for changes (Ctrl-C to stop)", self.dir.display());
            let changed = seen.wait_for_change(self.dir).await;
            eprintln!("dev: {} changed", changed.display());
        }
    }

    /// Build, register, run; `Ok(true)` when the run completed.
    async fn once(&self) -> anyhow::Result<bool> {
        eprintln!("dev: building {}", self.dir.display());
        let dir = self.dir.to_path_buf();
        let wasm = tokio::task::spawn_blocking(move || super::project::build(&dir, None)).await??;
        let bytes = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
        let manifest_path = self.dir.join("manifest.json");
        let manifest = match manifest_path.exists() {
            true => Some(
                std::fs::read_to_string(&manifest_path)
                    .with_context(|| format!("reading {}", manifest_path.display()))?,
            ),
            false => None,
        };
        let plugin = client::upload(self.api, self.name, bytes, manifest)
            .await
            .with_context(|| format!("registering {} on {}", self.name, self.api.url))?;
        let digest = plugin["digest"].as_str().unwrap_or("?").to_string();
        eprintln!("dev: registered {} ({digest}) on {}", self.name, self.api.url);
        let mut body = json!({ "content": self.prompt, "plugin": self.name });
        if let Some(c) = &self.config {
            body["config"] = c.clone();
        }
        let run = self.api.call(reqwest::Method::POST, "/v1/runs", Some(body)).await?;
        let id = run["run_id"].as_str().context("the answer has no run_id")?.to_string();
        eprintln!("dev: run {id} ({digest}): {:?}", self.prompt);
        *self.in_flight.lock().expect("in flight") = Some(id.clone());
        let status = client::follow_to_end(self.api, &id, 0).await;
        self.in_flight.lock().expect("in flight").take();
        // The answer's text has no newline of its own.
        println!();
        let status = status?;
        eprintln!("dev: run {id} {status}");
        Ok(status == "completed")
    }
}

/// The project's sources as last seen: each file's path, size and
/// modification time (what a build reads; not its outputs, its
/// dependencies or hidden files).
#[derive(PartialEq, Eq)]
struct Sources(Vec<(PathBuf, u64, Option<SystemTime>)>);

impl Sources {
    fn read(dir: &Path) -> Sources {
        let mut files = Vec::new();
        let mut dirs = vec![dir.to_path_buf()];
        while let Some(d) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else { continue };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name.starts_with('.') || ["target", "node_modules", "__pycache__", "Cargo.lock"].contains(&&*name) {
                    continue;
                }
                let Ok(meta) = entry.metadata() else { continue };
                if meta.is_dir() {
                    dirs.push(entry.path());
                } else if files.len() < WATCHED_FILES_MAX {
                    files.push((entry.path(), meta.len(), meta.modified().ok()));
                }
            }
        }
        files.sort();
        Sources(files)
    }

    /// Waits until the sources differ from these; a file that changed (or
    /// the project's directory when only a removal tells).
    async fn wait_for_change(&self, dir: &Path) -> PathBuf {
        loop {
            let now = Sources::read(dir);
            if now != *self {
                let changed = now.0.iter().find(|f| !self.0.contains(f)).map(|f| f.0.clone());
                return changed.unwrap_or_else(|| dir.to_path_buf());
            }
            tokio::time::sleep(WATCH_TICK).await;
        }
    }
}
