//! Process assembly: database (given or private), migrations, hub, worker,
//! HTTP, and the ordered shutdown on SIGTERM/SIGINT.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use sqlx::PgPool;

use crate::agent::AgentRegistry;
use crate::api::{self, AppState};
use crate::cli::args::{DbArgs, ServeArgs};
use crate::cluster::{self, Cluster, ClusterOptions};
use crate::db;
use crate::hub::Hub;
use crate::worker::Worker;

/// Bound on closing HTTP connections after the drain.
const HTTP_SHUTDOWN_MAX: Duration = Duration::from_secs(5);

/// The database this process uses, and the private cluster if it started one.
pub struct Database {
    pub url: String,
    pub listen_url: String,
    pub cluster: Option<Cluster>,
}

/// `DATABASE_URL` if given; otherwise a private cluster in the data directory.
pub async fn open_database(args: &DbArgs) -> anyhow::Result<Database> {
    let (url, cluster) = match &args.database_url {
        Some(url) => (url.clone(), None),
        None => {
            let opts = ClusterOptions {
                dir: args.data_dir.clone(),
                ephemeral: args.ephemeral,
                remove_on_exit: args.ephemeral,
            };
            let mut cluster = tokio::task::spawn_blocking(move || Cluster::start(&opts))
                .await?
                .context("starting the private PostgreSQL cluster")?;
            cluster.ensure_database(cluster::DATABASE).await.context("creating the database in the private cluster")?;
            // Not the URL: it holds the password.
            tracing::info!(port = cluster.port(), "private PostgreSQL cluster running on 127.0.0.1");
            (cluster.url(cluster::DATABASE), Some(cluster))
        }
    };
    let listen_url = args.listen_database_url.clone().unwrap_or_else(|| url.clone());
    Ok(Database { url, listen_url, cluster })
}

/// Connects and applies the embedded migrations.
pub async fn connect_and_migrate(url: &str, pool_max: u32) -> anyhow::Result<PgPool> {
    let pool = db::connect(url, pool_max).await.context("connecting to PostgreSQL")?;
    db::migrate(&pool).await.context("applying migrations")?;
    Ok(pool)
}

/// A live run holds a few sockets (its model's stream, its clients' SSE
/// connections, its share of the database's): the soft limit on open files
/// is raised to the hard one, as a long-running server's should be, and a
/// limit still below what the slots may need is said at start.
fn raise_open_files(max_runs: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    let soft = match soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        true => hard,
        false => soft,
    };
    let wanted = (max_runs as u64).saturating_mul(3).saturating_add(256);
    if soft < wanted {
        tracing::warn!(
            open_files = soft,
            max_runs,
            "the limit on open files may be too low for --max-runs: a live run holds about three sockets \
             (raise the hard limit, e.g. LimitNOFILE= or ulimit -Hn)"
        );
    }
}

/// A host running in this process: the database (given or private), the
/// worker and the HTTP API. `serve` runs one until a signal; `dev` runs a
/// private one for an author's loop.
pub struct Host {
    /// Where the HTTP API listens.
    pub addr: std::net::SocketAddr,
    pub pool: PgPool,
    agents: AgentRegistry,
    worker: Worker,
    http: tokio::task::JoinHandle<std::io::Result<()>>,
    http_stop: tokio_util::sync::CancellationToken,
    database: Database,
}

impl Host {
    /// Opens the database, applies migrations, starts the hub, the worker and
    /// the HTTP API; `with_clock` adds the demo's `clock` tool.
    pub async fn start(db_args: &DbArgs, args: &ServeArgs, with_clock: bool) -> anyhow::Result<Host> {
        let config = args.worker.to_config();
        config.validate()?;
        raise_open_files(config.max_runs);
        if let Some(traces) = args.traces.config()? {
            crate::telemetry::install(&traces)?;
        }
        let mut tools = args.tools.registry()?;
        if with_clock {
            tools.insert(DEMO_TOOL, Arc::new(Clock));
        }
        tracing::info!(tools = ?tools.names(), "tools ready");
        let database = open_database(db_args).await?;
        let pool = connect_and_migrate(&database.url, db_args.db_pool_max).await?;
        // The model limits every process shares live in the database.
        tools.attach_database(pool.clone());
        let hub = (!args.worker.no_hub).then(|| Hub::start(database.listen_url.clone()));
        let sandbox = crate::sandbox::Sandbox::for_process(
            pool.clone(),
            &db_args.cache_dir,
            db_args.artifact_key_file.as_deref(),
            crate::sandbox::pool_for_runs(args.worker.max_runs),
        )?;
        // Built-in agents only where the operator offers them (the demo does).
        let agents = match args.builtin_agents || args.demo {
            true => AgentRegistry::with_builtins(),
            false => AgentRegistry::default(),
        };
        let agents = agents.with_sandbox(sandbox).with_tools(tools);
        // One policy (and so one set of quota buckets) for the API and the scheduler.
        let policy = config.policy.clone();
        let worker = Worker::start(pool.clone(), hub.clone(), agents.clone(), config).await?;

        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        let mut state = AppState::new(pool.clone(), agents.clone(), hub).with_sse_tails_max(args.sse_tails_max);
        state.keepalive = std::time::Duration::from_millis(args.sse_keepalive_ms);
        state.sse_stall = std::time::Duration::from_millis(args.sse_stall_ms);
        state.stats = Some(worker.observer());
        state.policy = policy;
        let app = api::router(state);
        let http_stop = tokio_util::sync::CancellationToken::new();
        let stop = http_stop.clone();
        let http =
            tokio::spawn(
                async move { axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await },
            );
        Ok(Host { addr, pool, agents, worker, http, http_stop, database })
    }

    /// Drains the runs in flight, closes the HTTP API and the pool, and stops
    /// the private cluster (removing it if it was ephemeral).
    pub async fn stop(mut self) {
        tracing::info!("shutting down: draining runs");
        let report = self.worker.drain().await;
        tracing::info!(?report, "drain finished");
        self.http_stop.cancel();
        let _ = tokio::time::timeout(HTTP_SHUTDOWN_MAX, &mut self.http).await;
        // The drained runs' last spans.
        crate::telemetry::shutdown().await;
        self.pool.close().await;
        if let Some(c) = self.database.cluster.as_mut() {
            tokio::task::block_in_place(|| c.stop());
        }
    }
}

pub async fn serve(db_args: &DbArgs, args: &ServeArgs) -> anyhow::Result<()> {
    let mut shutdown = ShutdownSignal::install().context("installing signal handlers")?;
    let mut host = Host::start(db_args, args, args.demo).await?;
    // A line scripts and tests read to find the port.
    println!("agent-host listening on http://{}", host.addr);
    if args.demo {
        demo(&host.pool, &host.agents, host.addr).await?;
    }
    tokio::select! {
        _ = shutdown.recv() => {}
        r = &mut host.http => {
            r??;
            anyhow::bail!("the HTTP server stopped unexpectedly");
        }
    }
    host.stop().await;
    Ok(())
}

/// The demo's tool: the host's clock (the offline model calls the first tool
/// it is offered, so the demo turn is a real tool call).
pub(crate) const DEMO_TOOL: &str = "clock";

struct Clock;

#[async_trait::async_trait]
impl crate::tools::Tool for Clock {
    async fn call(
        &self,
        _call: &crate::tools::ToolCall<'_>,
        _sink: &dyn crate::tools::EventSink,
    ) -> Result<serde_json::Value, crate::error::HostError> {
        Ok(json!(format!("it is {} UTC", chrono::Utc::now().format("%H:%M:%S on %A %-d %B %Y"))))
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn idempotent(&self) -> bool {
        true
    }
}

/// The example plugins the demo registers: (name, directory under the
/// checkout, manifest). Each is built with `scripts/build-plugin`; a language
/// whose toolchain is missing is skipped with a line saying so.
const DEMO_PLUGINS: [(&str, &str); 3] =
    [("chat", "plugins/chat"), ("chat-python", "plugins/chat-python"), ("chat-js", "plugins/chat-js")];

/// What the demo offers the model: the clock.
fn demo_config() -> serde_json::Value {
    json!({ "tools": [{ "name": DEMO_TOOL, "description": "The current date and time on the host", "parameters": { "type": "object", "properties": {} } }] })
}

/// Builds (when missing or changed) and registers one example plugin;
/// `Ok(false)` when it cannot be built here.
async fn demo_plugin(pool: &PgPool, agents: &AgentRegistry, name: &str, dir: &str) -> anyhow::Result<bool> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("scripts/build-plugin");
    if !script.exists() {
        println!("demo: {name} skipped (no checkout at {} to build it from)", root.display());
        return Ok(false);
    }
    let out = tokio::process::Command::new(&script)
        .arg(root.join(dir))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        let last = why.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        println!("demo: {name} skipped: its build failed ({last})");
        return Ok(false);
    }
    let path = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string();
    let bytes = tokio::fs::read(&path).await.with_context(|| format!("reading {path}"))?;
    let manifest_path = root.join(dir).join("manifest.json");
    let manifest = match tokio::fs::read_to_string(&manifest_path).await {
        Ok(text) => serde_json::from_str(&text).with_context(|| format!("{} is not JSON", manifest_path.display()))?,
        Err(_) => json!({ "tools": ["llm", DEMO_TOOL] }),
    };
    let digest = db::plugins::digest_of(&bytes);
    let current = db::plugins::get(pool, name).await?;
    if current.is_some_and(|p| p.digest == digest && p.manifest == manifest) {
        return Ok(true);
    }
    let sandbox = agents.sandbox().context("the demo needs the sandbox")?.clone();
    crate::service::plugins::register(pool, &sandbox, &db::audit::Actor::cli(), None, name, bytes, &manifest).await?;
    println!(
        "demo: registered {name} ({digest}, {} tools: {})",
        manifest["tools"].as_array().map_or(0, |t| t.len()),
        manifest["tools"]
    );
    Ok(true)
}

/// Enqueues one demo turn of `plugin`, pinned to its digest and manifest
/// (a built-in has neither); its run id.
async fn demo_run(pool: &PgPool, plugin: &str, content: &str) -> anyhow::Result<crate::db::RunId> {
    let owner = db::enqueue::Owner { user_id: "demo".into(), tenant_id: "demo".into() };
    let config = demo_config();
    let row = db::plugins::get(pool, plugin).await?;
    let request = json!({ "content": content, "plugin": plugin, "config": config });
    let run = db::enqueue::enqueue(
        pool,
        &db::enqueue::NewRun {
            owner: &owner,
            conversation_id: None,
            content,
            plugin,
            plugin_digest: row.as_ref().map(|r| r.digest.as_str()),
            plugin_manifest: row.as_ref().map(|r| &r.manifest),
            config: &config,
            request: &request,
            idempotency_key: None,
            webhook: None,
            parent: None,
        },
    )
    .await?;
    Ok(run.run_id)
}

/// How long the demo watches one of its runs for its ending.
const DEMO_RUN_WATCH_MAX: Duration = Duration::from_secs(600);

/// Prints a demo run's ending when it comes (`demo: chat run ... completed:
/// "..."`): the line a person (and the test of the README's first command)
/// waits for.
async fn demo_ending(pool: PgPool, plugin: &'static str, run: crate::db::RunId) {
    let deadline = tokio::time::Instant::now() + DEMO_RUN_WATCH_MAX;
    while tokio::time::Instant::now() < deadline {
        match db::runs::get_run(&pool, run, "demo").await {
            Ok(Some(v)) if v.status.is_terminal() => {
                let said = db::conversations::messages(&pool, v.conversation_id, "demo", None, 100)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|m| m.into_iter().rev().find(|m| m.role == "assistant"))
                    .map(|m| m.content)
                    .unwrap_or_default();
                let error = v.error.map(|e| format!(" ({e})")).unwrap_or_default();
                println!("demo: {plugin} run {run} {}{error}: {said:?}", v.status.as_str());
                return;
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "reading the demo run"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The demo: the example plugins built and registered (Rust `chat` first,
/// then Python and JavaScript when their toolchains are here), a token, and
/// a sandboxed `chat` turn that calls the clock tool.
async fn demo(pool: &PgPool, agents: &AgentRegistry, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    let token = db::tokens::create(pool, "demo", "demo", true).await?;
    let content = "What time is it?";
    let (plugin, what) = if demo_plugin(pool, agents, "chat", "plugins/chat").await? {
        ("chat", "the Rust chat plugin, sandboxed: a model call, a clock tool call, the answer")
    } else {
        ("sleep", "the built-in sleep agent: build the plugins for the real thing")
    };
    let run_id = demo_run(pool, plugin, content).await?;
    tokio::spawn(demo_ending(pool.clone(), plugin, run_id));
    // The plugin registered now (the Python and JavaScript ones follow when built).
    let body = json!({ "content": content, "plugin": plugin, "config": demo_config() }).to_string();
    println!(
        "\nconsole:    http://{addr}/ (sign in with the demo token)\n\
         demo token: {token}\n\
         demo run:   {run_id} ({what})\n\n\
         watch it:   curl -s -H 'Authorization: Bearer {token}' http://{addr}/v1/runs/{run_id}\n\
         stream it:  curl -sN -H 'Authorization: Bearer {token}' -H 'Accept: text/event-stream' http://{addr}/v1/runs/{run_id}/events\n\
         start one:  curl -s -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' \\\n\
         \x20           -d '{body}' http://{addr}/v1/runs\n\
         \x20           (plugin chat-python or chat-js too, once ready below)\n"
    );
    // The Python and JavaScript examples take a while to build the first
    // time: the host serves meanwhile, and each says when it is ready.
    let (pool, agents) = (pool.clone(), agents.clone());
    tokio::spawn(async move {
        for (name, dir) in DEMO_PLUGINS.iter().skip(1) {
            match demo_plugin(&pool, &agents, name, dir).await {
                Ok(true) => match demo_run(&pool, name, content).await {
                    Ok(run) => {
                        println!("demo: {name} is ready; its demo run is {run}");
                        tokio::spawn(demo_ending(pool.clone(), *name, run));
                    }
                    Err(e) => println!("demo: {name}: enqueueing its run failed: {e:#}"),
                },
                Ok(false) => {}
                Err(e) => println!("demo: {name} skipped: {e:#}"),
            }
        }
    });
    Ok(())
}

/// SIGTERM (the orchestrator) or SIGINT (Ctrl-C). Installed when created, so
/// a signal that arrives before anyone awaits it still drains instead of
/// killing the process.
pub struct ShutdownSignal {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    pub fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(ShutdownSignal { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// `plugins add`: the registration `POST /v1/plugins` does (`service::plugins`).
pub async fn plugins_add(
    db_args: &DbArgs,
    name: &str,
    file: &std::path::Path,
    manifest: Option<&std::path::Path>,
    tenant: Option<&str>,
) -> anyhow::Result<()> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let manifest: serde_json::Value = match manifest {
        Some(path) => {
            serde_json::from_str(&std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)
                .with_context(|| format!("{} is not JSON", path.display()))?
        }
        None => json!({}),
    };
    // Before a database is opened (or a private cluster started).
    crate::service::plugins::check(name, &manifest)?;
    with_pool(db_args, |pool| async move {
        // Registering compiles the plugin; it runs no guest.
        let sandbox: Arc<dyn crate::agent::Components> = crate::sandbox::Sandbox::for_process(
            pool.clone(),
            &db_args.cache_dir,
            db_args.artifact_key_file.as_deref(),
            crate::sandbox::pool_for_runs(1),
        )?;
        let actor = db::audit::Actor::cli();
        let row = crate::service::plugins::register(&pool, &sandbox, &actor, tenant, name, bytes, &manifest).await?;
        let scope = tenant.map_or("published".to_string(), |t| format!("tenant {t}"));
        println!("{} -> {} ({} bytes, {scope})", row.name, row.digest, row.size_bytes);
        Ok(())
    })
    .await
}

/// Plugins one `plugins list` read fetches.
const PLUGINS_LIST_PAGE: i64 = 1000;

/// `plugins list`: every published plugin (or every one `tenant` may run),
/// a page at a time.
pub async fn plugins_list(db_args: &DbArgs, tenant: Option<&str>, json: bool) -> anyhow::Result<()> {
    with_pool(db_args, |pool| async move {
        let mut after: Option<String> = None;
        loop {
            let page = db::plugins::list(&pool, tenant, after.as_deref(), PLUGINS_LIST_PAGE).await?;
            for p in &page {
                if json {
                    println!("{}", serde_json::to_string(p)?);
                    continue;
                }
                let scope = p.tenant_id.as_deref().unwrap_or("published");
                println!("{}\t{}\t{} bytes\t{scope}\t{}", p.name, p.digest, p.size_bytes, p.manifest);
            }
            match page.last() {
                Some(last) if page.len() as i64 == PLUGINS_LIST_PAGE => after = Some(last.name.clone()),
                _ => return Ok(()),
            }
        }
    })
    .await
}

/// `tokens create | list | revoke`: the operator's command line, audited
/// as `cli`. A list never prints a secret; only `create` prints one, once.
/// `tenants`: the operator's settings per tenant, audited.
pub async fn tenants(db_args: &DbArgs, command: crate::cli::args::TenantsCommand) -> anyhow::Result<()> {
    use crate::cli::args::TenantsCommand;
    with_pool(db_args, |pool| async move {
        match command {
            TenantsCommand::Share { tenant, pct, clear: _ } => {
                let pct = pct.map(i32::from);
                let mut tx = pool.begin().await?;
                db::tenants::set_share(&mut tx, &tenant, pct).await?;
                let detail = json!({ "slot_share_pct": pct });
                let action = db::audit::action::TENANT_SHARE_SET;
                db::audit::record(&mut *tx, &db::audit::Actor::cli(), action, Some(&tenant), &tenant, detail).await?;
                tx.commit().await?;
                match pct {
                    Some(p) => println!("tenant {tenant}: at most {p}% of each process's run slots"),
                    None => println!("tenant {tenant}: the processes' default share (--tenant-slot-share-pct)"),
                }
            }
            TenantsCommand::Ceiling { tenant, ceilings, clear: _ } => {
                let ceilings: db::tenants::Ceilings = ceilings.into_iter().collect();
                crate::run::manifest::Limits::check_ceilings(&ceilings).map_err(anyhow::Error::msg)?;
                let mut tx = pool.begin().await?;
                db::tenants::set_ceilings(&mut tx, &tenant, &ceilings).await?;
                let detail = json!({ "ceilings": ceilings });
                let action = db::audit::action::TENANT_CEILINGS_SET;
                db::audit::record(&mut *tx, &db::audit::Actor::cli(), action, Some(&tenant), &tenant, detail).await?;
                tx.commit().await?;
                match ceilings.is_empty() {
                    true => println!("tenant {tenant}: the host's own ceilings"),
                    false => {
                        let set: Vec<String> = ceilings.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        println!("tenant {tenant}: its plugins may ask for at most {}", set.join(" "));
                    }
                }
            }
            TenantsCommand::List { json } => {
                if !json {
                    println!("tenant\tslot_share_pct\tceilings");
                }
                for (tenant, pct, ceilings) in db::tenants::list(&pool).await? {
                    if json {
                        let row = json!({ "tenant": tenant, "slot_share_pct": pct, "ceilings": ceilings.0 });
                        println!("{row}");
                        continue;
                    }
                    let pct = pct.map_or("-".to_string(), |p| p.to_string());
                    let set: Vec<String> = ceilings.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    println!("{tenant}\t{pct}\t{}", if set.is_empty() { "-".to_string() } else { set.join(" ") });
                }
            }
        }
        Ok(())
    })
    .await
}

pub async fn tokens(db_args: &DbArgs, command: crate::cli::args::TokensCommand) -> anyhow::Result<()> {
    use crate::cli::args::TokensCommand;
    with_pool(db_args, |pool| async move {
        let actor = db::audit::Actor::cli();
        match command {
            TokensCommand::Create { user, tenant, admin, operator, expires_in } => {
                let new = db::tokens::NewToken {
                    user_id: &user,
                    tenant_id: &tenant,
                    admin,
                    operator,
                    expires_in_s: expires_in,
                    expires_by: None,
                };
                let (info, secret) =
                    crate::service::tokens::create(&pool, &actor, &new).await.context("creating the token")?;
                eprintln!("token {} for {}/{}", info.id, info.tenant_id, info.user_id);
                println!("{secret}");
            }
            TokensCommand::List { tenant, json } => {
                if !json {
                    println!("id\tuser\ttenant\tadmin\tcreated\tlast_used\texpires\trevoked");
                }
                let when = |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".to_string(), |t| t.to_rfc3339());
                let scope = db::tokens::Scope { tenant: tenant.as_deref(), ..Default::default() };
                let mut rows = db::tokens::list(&pool, scope, db::tokens::LIST_MAX + 1).await?;
                if rows.len() as i64 > db::tokens::LIST_MAX {
                    rows.truncate(db::tokens::LIST_MAX as usize);
                    eprintln!("(the first {} tokens only: narrow with --tenant)", db::tokens::LIST_MAX);
                }
                for t in rows {
                    if json {
                        println!("{}", serde_json::to_string(&t)?);
                        continue;
                    }
                    let role = if t.operator {
                        "operator"
                    } else if t.admin {
                        "admin"
                    } else {
                        "no"
                    };
                    println!(
                        "{}\t{}\t{}\t{role}\t{}\t{}\t{}\t{}",
                        t.id,
                        t.user_id,
                        t.tenant_id,
                        t.created_at.to_rfc3339(),
                        when(t.last_used_at),
                        when(t.expires_at),
                        when(t.revoked_at)
                    );
                }
            }
            TokensCommand::Revoke { id } => {
                match crate::service::tokens::revoke(&pool, &actor, id, db::tokens::Scope::default()).await? {
                    Some(true) => println!("token {id} revoked"),
                    Some(false) => println!("token {id} was already revoked"),
                    None => anyhow::bail!("no token {id}"),
                }
            }
        }
        Ok(())
    })
    .await
}

/// `audit`: the trail as JSON lines, oldest first.
pub async fn audit(db_args: &DbArgs, tenant: Option<&str>, after: Option<i64>, limit: i64) -> anyhow::Result<()> {
    with_pool(db_args, |pool| async move {
        for row in db::audit::list(&pool, tenant, after, limit).await? {
            println!("{}", serde_json::to_string(&row)?);
        }
        Ok(())
    })
    .await
}

/// Where a one-shot command's database is, for a person: the server and
/// database of `DATABASE_URL` (never its password), or the private cluster's
/// directory.
pub fn describe_database(db_args: &DbArgs) -> String {
    match &db_args.database_url {
        Some(url) => match url::Url::parse(url) {
            Ok(u) => format!(
                "{}:{}{} (DATABASE_URL)",
                u.host_str().unwrap_or("localhost"),
                u.port().unwrap_or(5432),
                u.path()
            ),
            Err(_) => "DATABASE_URL".to_string(),
        },
        None => format!("the private cluster in {}", absolute(&db_args.data_dir).display()),
    }
}

/// `path` made absolute against the working directory (as given when that fails).
fn absolute(path: &std::path::Path) -> std::path::PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A one-shot command's database: opened and migrated, handed to `work`,
/// then closed and the private cluster stopped, whatever `work` returned.
/// It says on stderr which database it used. A one-shot command never makes
/// a private cluster: run from another directory, the default relative
/// `--data-dir` would name an empty one, and whatever the command wrote
/// there the serving host would never see; so without `DATABASE_URL` the
/// data directory must hold a cluster `serve` made, or the command refuses
/// and names the directory it looked in.
pub async fn with_pool<T, F, Fut>(db_args: &DbArgs, work: F) -> anyhow::Result<T>
where
    F: FnOnce(PgPool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    if db_args.database_url.is_none() {
        let dir = absolute(&db_args.data_dir);
        if !dir.join("pg/PG_VERSION").exists() {
            anyhow::bail!(
                "no agent-host database in {}: this command does not make one. Run it with the --data-dir \
                 (or AGENT_HOST_DATA_DIR) of the host it is for (`agent-host serve` made its cluster there), \
                 or set DATABASE_URL",
                dir.display()
            );
        }
    }
    eprintln!("agent-host: database: {}", describe_database(db_args));
    let mut database = open_database(db_args).await?;
    let pool = connect_and_migrate(&database.url, 2).await?;
    let result = work(pool.clone()).await;
    pool.close().await;
    if let Some(c) = database.cluster.as_mut() {
        c.stop();
    }
    result
}
