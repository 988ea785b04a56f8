//! The sandbox: WebAssembly components as agents. [`WasmAgent`] implements
//! the same [`Agent`] trait as the built-ins and the agent registry finds it
//! through [`Components`]; an `AgentPre` is cached per plugin digest and one
//! `Store` per run, dropped after it.
//!
//! Compile once, run anywhere: a component is compiled by the first process
//! that sees its digest (an upload's validation, or a first run) and the
//! artifact is stored in PostgreSQL (`plugin_artifact`) keyed by digest,
//! the engine's compatibility hash and the artifact key's id, with an HMAC
//! (under the host's secret key, see [`key`]) over digest, engine hash and
//! bytes; a process that never saw the digest checks the MAC and
//! deserializes instead of compiling. Lookup order: memory, the local disk
//! cache (each file starts with the same MAC), the database, then a compile.
//! An artifact whose MAC does not match is never loaded: it is logged,
//! counted, deleted (a cache file) or replaced (a row), and recompiled.
//! Users never hand the host precompiled bytes: uploads are components, and
//! only [`Sandbox`] writes artifacts.
//!
//! Two worlds run side by side: `agent-host:plugin@0.2.0` (a turn is also told
//! the functions its client runs, and may end with calls of them, which the
//! host journals as `function_call` events) and `@0.1.0`, whose components
//! keep running unchanged. A component is prepared as the newest world it
//! fits; the host interface is the same in both.
//!
//! - `engine`: the one place wasmtime is configured (pooling, epochs).
//! - `imports`: the WIT host interface, translated to [`RunHost`] only.
//! - `output`: guest stdout and stderr, capped.
//! - `clocks`: a resumable run's WASI clocks (recorded and replayed through
//!   the run host) and its seeded random generators.
//!
//! Enforcement the guest cannot bypass lives here and in `RunHost`: memory,
//! CPU (epoch ticks) and wall time here; payload bytes, events, tool calls,
//! grants in `RunHost`; WASI grants nothing; and interruption: a guest yields
//! to the host at every epoch tick, so dropping its future (claim lost,
//! drain, a stop past its grace) stops it within a tick.

mod clocks;
mod engine;
mod imports;
pub mod key;
mod output;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgPool;
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Engine, Store, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::agent::registry::{CompileStats, Compiled, Components, InvalidComponent};
use crate::agent::{Agent, AgentError, FailReason, RunHost, RunInput};
use crate::db;
use crate::run::config::RunConfig;
pub use crate::run::manifest::{self as manifest, Limits, Manifest};
pub use engine::{pool_for_runs, EPOCH_TICK, INSTANCES_MAX, MAX_RUNS_MAX};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.1.0",
        world: "agent",
        imports: { default: async | trappable },
        exports: { default: async },
    });
}

mod bindings_v2 {
    wasmtime::component::bindgen!({
        path: "../wit/0.2.0",
        world: "agent",
        imports: { default: async | trappable },
        exports: { default: async },
    });
}

use bindings::agent_host::plugin::types as wit_types;
use bindings::{Agent as AgentWorld, AgentPre};
use bindings_v2::agent_host::plugin::types as wit_types_v2;
use bindings_v2::{Agent as AgentWorldV2, AgentPre as AgentPreV2};

/// A component prepared as the world it was built for.
#[derive(Clone)]
enum Pre {
    V1(AgentPre<Guest>),
    V2(AgentPreV2<Guest>),
}

/// A turn's client functions, as the 0.2.0 world gives them.
fn client_tools(config: &RunConfig) -> Vec<wit_types_v2::ClientTool> {
    let tools = config.client_tools.iter().cloned();
    tools
        .map(|t| wit_types_v2::ClientTool { name: t.name, description: t.description, parameters: t.parameters })
        .collect()
}

/// Bytes of a client call's `call_id`.
pub const CALL_ID_BYTES_MAX: usize = 128;

/// The client calls a guest's turn ends with, checked before anything is
/// journaled: each names one of the turn's client tools, and has a call id
/// (1-[`CALL_ID_BYTES_MAX`] bytes) no other call of the turn has.
fn check_client_calls(calls: &[wit_types_v2::ClientCall], client_tools: &[String]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for c in calls {
        if !client_tools.contains(&c.name) {
            return Err(format!("the turn ended with a call of {:?}, which is not one of its client tools", c.name));
        }
        if c.call_id.is_empty() || c.call_id.len() > CALL_ID_BYTES_MAX {
            return Err(format!("a client call's call_id must be 1-{CALL_ID_BYTES_MAX} bytes"));
        }
        if !seen.insert(c.call_id.as_str()) {
            return Err(format!("the turn ended with two client calls with call_id {:?}", c.call_id));
        }
    }
    Ok(())
}

/// Guest stdout and stderr kept for the host's log, per stream.
pub const GUEST_OUTPUT_BYTES_MAX: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("not a component of the agent-host:plugin world: {0}")]
    Invalid(String),
    #[error("plugin component {0} not found")]
    Missing(String),
    #[error("sandbox engine: {0}")]
    Engine(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("artifact key: {0}")]
    Key(String),
}

/// How long a run waits between tries for a slot of an exhausted pool.
const POOL_RETRY: Duration = Duration::from_millis(20);

/// The process's sandbox.
pub struct Sandbox {
    engine: engine::SandboxEngine,
    linker: Linker<Guest>,
    pool: PgPool,
    cache_dir: Option<PathBuf>,
    /// The engine's compatibility hash, hex (artifacts' key with the digest).
    engine_hash: String,
    /// MACs under the process's artifact key.
    macs: key::Macs,
    /// One compile at a time (Cranelift already uses every core for one):
    /// upload validations and first runs share it.
    compiling: Arc<Mutex<()>>,
    /// One cell per digest: concurrent first runs of a plugin compile it once.
    pres: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Pre>>>>,
    live: Arc<AtomicUsize>,
    stats: Arc<Counters>,
}

/// What `/metrics` shows of compiling (see [`CompileStats`]).
#[derive(Default)]
struct Counters {
    compiles: AtomicU64,
    artifacts_loaded: AtomicU64,
    artifacts_rejected: AtomicU64,
    pool_waits: AtomicU64,
}

/// A `Hasher` that feeds SHA-256: the engine's compatibility hash as a
/// digest that is the same in every process of this build.
struct Sha256Hasher(sha2::Sha256);

impl Hasher for Sha256Hasher {
    fn write(&mut self, bytes: &[u8]) {
        sha2::Digest::update(&mut self.0, bytes);
    }

    /// Unused: the digest is read with `finalize`.
    fn finish(&self) -> u64 {
        0
    }
}

/// Counts a live guest instance for as long as it is held.
struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Sandbox {
    /// Builds the engine and starts its epoch ticker. `cache_dir` keeps
    /// compiled components across restarts; artifacts' MACs use its
    /// generated key (`<cache-dir>/artifact.key`), or a random one without it.
    pub fn new(pool: PgPool, cache_dir: Option<PathBuf>) -> Result<Arc<Sandbox>, SandboxError> {
        let key = match &cache_dir {
            Some(dir) => key::ArtifactKey::in_cache_dir(dir),
            None => key::ArtifactKey::random(),
        }
        .map_err(SandboxError::Key)?;
        Sandbox::build(pool, cache_dir, key, INSTANCES_MAX)
    }

    /// The sandbox of a process with `cache_dir` (`--cache-dir`) and its
    /// artifact key (`AGENT_HOST_ARTIFACT_KEY`, `key_file`
    /// (`--artifact-key-file`) or the cache directory's), its pool holding
    /// `instances` guests at once ([`pool_for_runs`] of its slots).
    pub fn for_process(
        pool: PgPool,
        cache_dir: &std::path::Path,
        key_file: Option<&std::path::Path>,
        instances: u32,
    ) -> Result<Arc<Sandbox>, SandboxError> {
        let key = key::ArtifactKey::resolve(key_file, Some(cache_dir)).map_err(SandboxError::Key)?;
        Sandbox::build(pool, Some(cache_dir.to_path_buf()), key, instances)
    }

    /// [`Sandbox::new`] with `key` for artifacts' MACs.
    pub fn with_key(
        pool: PgPool,
        cache_dir: Option<PathBuf>,
        key: key::ArtifactKey,
    ) -> Result<Arc<Sandbox>, SandboxError> {
        Sandbox::build(pool, cache_dir, key, INSTANCES_MAX)
    }

    /// [`Sandbox::new`] whose pool holds only `instances` guests at once (a
    /// test's way to exhaust it).
    pub fn with_pool_size(
        pool: PgPool,
        cache_dir: Option<PathBuf>,
        instances: u32,
    ) -> Result<Arc<Sandbox>, SandboxError> {
        Sandbox::build(pool, cache_dir, key::ArtifactKey::random().map_err(SandboxError::Key)?, instances)
    }

    fn build(
        pool: PgPool,
        cache_dir: Option<PathBuf>,
        key: key::ArtifactKey,
        instances: u32,
    ) -> Result<Arc<Sandbox>, SandboxError> {
        let engine = engine::SandboxEngine::new(instances).map_err(SandboxError::Engine)?;
        let mut linker = Linker::<Guest>::new(&engine.engine);
        // WASI is linked so standard guests instantiate, and grants nothing.
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        AgentWorld::add_to_linker::<_, HasSelf<_>>(&mut linker, |g| g)
            .map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        AgentWorldV2::add_to_linker::<_, HasSelf<_>>(&mut linker, |g| g)
            .map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        if let Some(dir) = &cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| SandboxError::Engine(format!("cache dir {}: {e}", dir.display())))?;
        }
        let mut hasher = Sha256Hasher(sha2::Sha256::default());
        engine.engine.precompile_compatibility_hash().hash(&mut hasher);
        let engine_hash = hex::encode(sha2::Digest::finalize(hasher.0));
        tracing::info!(key_id = key.id(), engine = %engine_hash, "sandbox ready");
        Ok(Arc::new(Sandbox {
            macs: key::Macs::new(key, &engine_hash),
            compiling: Arc::default(),
            engine,
            linker,
            pool,
            cache_dir,
            engine_hash,
            pres: Mutex::new(HashMap::new()),
            live: Arc::new(AtomicUsize::new(0)),
            stats: Arc::default(),
        }))
    }

    /// The engine's compatibility hash (hex): artifacts of another are not loaded.
    pub fn engine_hash(&self) -> &str {
        &self.engine_hash
    }

    /// The artifact key's id (artifacts of other keys are neither loaded nor replaced).
    pub fn key_id(&self) -> &str {
        self.macs.key_id()
    }

    /// Compiles `bytes` (CPU work: call it off the async threads), counted
    /// and logged.
    fn compile(&self, digest: &str, bytes: &[u8]) -> Result<Component, SandboxError> {
        self.clone_for_compile().compile(digest, bytes)
    }

    /// Stores `component`'s artifact where every process finds it (the
    /// database) and in the local cache. A failure costs only a later
    /// compile, so it is logged, not returned.
    async fn keep_artifact(&self, digest: &str, artifact: Vec<u8>) {
        // Hashing and writing tens of MB: off the async threads.
        let (macs, path, owned) = (self.macs.clone(), self.cache_path(digest), digest.to_string());
        let kept = tokio::task::spawn_blocking(move || {
            let mac = macs.mac(&owned, &artifact);
            if let Some(path) = path {
                write_cache_file(&path, &mac, &artifact);
            }
            (artifact, mac)
        })
        .await;
        let Ok((artifact, mac)) = kept else { return };
        if let Err(e) = db::artifacts::put(&self.pool, digest, &self.engine_hash, self.key_id(), &artifact, &mac).await
        {
            tracing::warn!(digest, error = %e, "could not store the compiled component");
        }
    }

    fn wasm(&self) -> &Engine {
        &self.engine.engine
    }

    /// Guest instances alive right now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Checks that `bytes` are a component of this world that imports only
    /// what the host provides. The error says what does not fit.
    pub fn validate(&self, bytes: &[u8]) -> Result<(), SandboxError> {
        self.compile_checked(bytes).map(|_| ())
    }

    /// Compiles and checks `bytes`; the compiled artifact, for
    /// [`Components::keep`] once the component is stored.
    /// A digest whose artifact the local cache already has (MAC checked; a
    /// re-upload, the demo's registrations on a restart) is deserialized
    /// and prepared instead of compiled.
    pub fn compile_checked(&self, bytes: &[u8]) -> Result<Compiled, SandboxError> {
        let digest = db::plugins::digest_of(bytes);
        if let Some(path) = self.cache_path(&digest) {
            match read_cache_file(self.wasm(), &self.macs, &digest, &path) {
                Cached::Loaded(component, file) => {
                    self.prepare(&component)?;
                    let artifact = file[key::MAC_BYTES..].to_vec();
                    return Ok(Compiled { digest, artifact });
                }
                Cached::Rejected => {
                    self.stats.artifacts_rejected.fetch_add(1, Ordering::Relaxed);
                }
                Cached::Absent => {}
            }
        }
        let component = self.compile(&digest, bytes)?;
        self.prepare(&component)?;
        let artifact = component.serialize().map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        Ok(Compiled { digest, artifact })
    }

    /// Compiles, artifacts loaded from the database and refused, and waits
    /// for an exhausted pool, since start.
    pub fn compile_stats(&self) -> CompileStats {
        let s = &self.stats;
        CompileStats {
            compiles: s.compiles.load(Ordering::Relaxed),
            artifacts_loaded: s.artifacts_loaded.load(Ordering::Relaxed),
            artifacts_rejected: s.artifacts_rejected.load(Ordering::Relaxed),
            pool_waits: s.pool_waits.load(Ordering::Relaxed),
        }
    }

    /// The component as the newest world whose `run` it exports.
    fn prepare(&self, component: &Component) -> Result<Pre, SandboxError> {
        let pre = self.linker.instantiate_pre(component).map_err(|e| SandboxError::Invalid(format!("{e:#}")))?;
        if let Ok(v2) = AgentPreV2::new(pre.clone()) {
            return Ok(Pre::V2(v2));
        }
        AgentPre::new(pre).map(Pre::V1).map_err(|e| SandboxError::Invalid(format!("{e:#}")))
    }

    fn cache_path(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.trim_start_matches("sha256:");
        let (engine, key) = (&self.engine_hash[..16], &self.key_id()[..16]);
        self.cache_dir.as_ref().map(|d| d.join(format!("{hex}-{engine}-{key}.cwasm")))
    }

    /// The prepared component for `digest`: memory, then disk, then the
    /// database. Concurrent callers for one digest wait for a single load.
    async fn pre(&self, digest: &str) -> Result<Pre, SandboxError> {
        let cell = self.pres.lock().unwrap().entry(digest.to_string()).or_default().clone();
        cell.get_or_try_init(|| self.load(digest)).await.cloned()
    }

    async fn load(&self, digest: &str) -> Result<Pre, SandboxError> {
        if let Some(path) = self.cache_path(digest) {
            let (engine, macs, owned) = (self.wasm().clone(), self.macs.clone(), digest.to_string());
            let cached = tokio::task::spawn_blocking(move || read_cache_file(&engine, &macs, &owned, &path))
                .await
                .map_err(|e| SandboxError::Engine(e.to_string()))?;
            match cached {
                Cached::Loaded(c, _) => return self.prepare(&c),
                Cached::Rejected => {
                    self.stats.artifacts_rejected.fetch_add(1, Ordering::Relaxed);
                }
                Cached::Absent => {}
            }
        }
        if let Some(stored) = db::artifacts::get(&self.pool, digest, &self.engine_hash, self.key_id()).await? {
            if self.macs.ok(digest, &stored.artifact, &stored.mac) {
                // SAFETY: the MAC, under this host's secret key, proves this
                // host wrote these bytes for this digest and engine
                // (`keep_artifact`, from `serialize`).
                match unsafe { Component::deserialize(self.wasm(), &stored.artifact) } {
                    Ok(c) => {
                        self.stats.artifacts_loaded.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(digest, bytes = stored.artifact.len(), "loaded a stored compiled component");
                        // Tens of MB to disk: off the first run's path.
                        if let Some(path) = self.cache_path(digest) {
                            let (mac, artifact) = (stored.mac, stored.artifact);
                            tokio::task::spawn_blocking(move || write_cache_file(&path, &mac, &artifact));
                        }
                        return self.prepare(&c);
                    }
                    Err(e) => {
                        tracing::warn!(digest, error = %format!("{e:#}"), "a stored compiled component did not load; recompiling")
                    }
                }
            } else {
                self.stats.artifacts_rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(digest, engine = %self.engine_hash, "a stored compiled component failed its MAC check: not loaded; recompiling");
            }
        }
        let bytes =
            db::plugins::component(&self.pool, digest).await?.ok_or_else(|| SandboxError::Missing(digest.into()))?;
        let this = self.clone_for_compile();
        let owned = digest.to_string();
        let component = tokio::task::spawn_blocking(move || this.compile(&owned, &bytes))
            .await
            .map_err(|e| SandboxError::Engine(e.to_string()))??;
        if let Ok(artifact) = component.serialize() {
            self.keep_artifact(digest, artifact).await;
        }
        self.prepare(&component)
    }

    /// What compiling on a blocking thread needs (the engine and counters).
    fn clone_for_compile(&self) -> Compiler {
        Compiler { engine: self.wasm().clone(), stats: self.stats.clone(), compiling: self.compiling.clone() }
    }
}

/// Compiles off the async threads: the engine and the counters.
struct Compiler {
    engine: Engine,
    stats: Arc<Counters>,
    compiling: Arc<Mutex<()>>,
}

impl Compiler {
    fn compile(&self, digest: &str, bytes: &[u8]) -> Result<Component, SandboxError> {
        let _one_at_a_time = self.compiling.lock().unwrap_or_else(|e| e.into_inner());
        let started = std::time::Instant::now();
        let component = Component::new(&self.engine, bytes).map_err(|e| SandboxError::Invalid(format!("{e:#}")))?;
        self.stats.compiles.fetch_add(1, Ordering::Relaxed);
        let took_ms = started.elapsed().as_millis() as u64;
        tracing::info!(digest, bytes = bytes.len(), took_ms, "compiled a plugin component");
        Ok(component)
    }
}

/// Writes a local cache file: the artifact's MAC, then the artifact
/// (another process may write the same one: a private temporary name, then
/// an atomic rename).
fn write_cache_file(path: &std::path::Path, mac: &[u8], artifact: &[u8]) {
    let tmp = path.with_extension(format!("{}.{}.tmp", std::process::id(), uuid::Uuid::new_v4().simple()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        use std::io::Write;
        f.write_all(mac)?;
        f.write_all(artifact)
    });
    if written.and_then(|_| std::fs::rename(&tmp, path)).is_err() {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!(path = %path.display(), "could not cache the compiled component");
    }
}

/// What the local cache had for a digest.
enum Cached {
    /// The component and the file's bytes (MAC, then artifact).
    Loaded(Component, Vec<u8>),
    /// A file whose MAC did not match: deleted, not loaded.
    Rejected,
    Absent,
}

/// Reads, checks and deserializes a local cache file (blocking).
fn read_cache_file(engine: &Engine, macs: &key::Macs, digest: &str, path: &std::path::Path) -> Cached {
    let Ok(bytes) = std::fs::read(path) else { return Cached::Absent };
    let (mac, artifact) = bytes.split_at(key::MAC_BYTES.min(bytes.len()));
    if !macs.ok(digest, artifact, mac) {
        let _ = std::fs::remove_file(path);
        tracing::warn!(digest, path = %path.display(), "a cached compiled component failed its MAC check: deleted, not loaded");
        return Cached::Rejected;
    }
    // SAFETY: the MAC, under this host's secret key, proves this host wrote
    // these bytes (`Component::serialize` output) for this digest and engine.
    match unsafe { Component::deserialize(engine, artifact) } {
        Ok(c) => Cached::Loaded(c, bytes),
        Err(e) => {
            let _ = std::fs::remove_file(path);
            tracing::warn!(digest, error = %format!("{e:#}"), "a cached compiled component did not load: deleted");
            Cached::Absent
        }
    }
}

/// A stored component as an [`Agent`]: one turn is one fresh instance.
pub struct WasmAgent {
    engine: Engine,
    live: Arc<AtomicUsize>,
    pool_waits: Arc<Counters>,
    pre: Pre,
    limits: Limits,
}

impl WasmAgent {
    /// A fresh store for one guest: nothing granted (no preopens, no
    /// environment, no network), its memories limited, its CPU counted in
    /// epoch ticks (interrupted past `cpu_ticks_max`, yielding every tick).
    fn store(
        &self,
        host: &RunHost,
        stdout: &output::CappedOutput,
        stderr: &output::CappedOutput,
        cpu_ticks_max: u64,
    ) -> Store<Guest> {
        let limits = &self.limits;
        let mut wasi = WasiCtx::builder();
        wasi.stdout(stdout.clone()).stderr(stderr.clone());
        // One call's random bytes are an allocation of the host's.
        wasi.max_random_size(RANDOM_BYTES_MAX);
        // A resumable run's clocks and random numbers replay on resume.
        clocks::install(&mut wasi, host);
        let guest = Guest {
            wasi: wasi.build(),
            table: resource_table(),
            limiter: MemoryLimiter::new(limits.memory_bytes as usize),
            host: host.clone(),
            cpu_ticks: 0,
            cpu_exceeded: false,
        };
        let mut store = Store::new(&self.engine, guest);
        store.limiter(|g| &mut g.limiter);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |mut ctx| {
            let g = ctx.data_mut();
            g.cpu_ticks += 1;
            if g.cpu_ticks > cpu_ticks_max {
                g.cpu_exceeded = true;
                return Ok(UpdateDeadline::Interrupt);
            }
            // Yield to the host every tick: the run's future can then be
            // dropped (claim lost, drain) and other runs get the thread.
            Ok(UpdateDeadline::Yield(1))
        });
        store
    }

    /// Runs one turn of the prepared component under `limits`.
    async fn execute(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        let limits = &self.limits;
        let stdout = output::CappedOutput::new(GUEST_OUTPUT_BYTES_MAX);
        let stderr = output::CappedOutput::new(GUEST_OUTPUT_BYTES_MAX);
        let cpu_ticks_max = limits.cpu_ms.div_ceil(EPOCH_TICK.as_millis() as u64).max(1);
        let new_store = || self.store(host, &stdout, &stderr, cpu_ticks_max);
        let mut store = new_store();
        let tools = client_tools(&input.config);
        let names: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
        let run_id = input.run_id;
        let wall = Duration::from_millis(limits.wall_ms);
        let outcome = tokio::time::timeout(wall, self.call_guest(&mut store, &new_store, input, tools)).await;
        log_output(run_id, "stdout", &stdout);
        log_output(run_id, "stderr", &stderr);
        let result = guest_verdict(outcome, store.data(), limits);
        drop(store);
        let (text, calls) = result?;
        // A run the host failed ends with that failure: its client calls
        // are not journaled.
        if let Some(failure) = host.failure() {
            return Err(failure);
        }
        journal_client_calls(host, calls, &names).await?;
        Ok(text)
    }

    /// The guest's input in the world it was built for (0.1: no client
    /// tools, no client calls back), a fresh instance in `store`, and its
    /// `run` called: its text and client calls, or its own error.
    async fn call_guest(
        &self,
        store: &mut Store<Guest>,
        new_store: &(dyn Fn() -> Store<Guest> + Sync),
        input: RunInput,
        tools: Vec<wit_types_v2::ClientTool>,
    ) -> wasmtime::Result<Result<(String, Vec<wit_types_v2::ClientCall>), String>> {
        let pool_waits = &self.pool_waits.pool_waits;
        // An exhausted pooling allocator (every slot of some kind in use by
        // other guests) is waited out, never a failure: a fresh store (the
        // failed one may hold slots of the instances it did make) and
        // another try, until a guest ends and frees one.
        macro_rules! instantiate {
            ($pre:expr) => {
                loop {
                    match $pre.instantiate_async(&mut *store).await {
                        Err(e) if e.chain().any(|c| c.is::<wasmtime::PoolConcurrencyLimitError>()) => {
                            pool_waits.fetch_add(1, Ordering::Relaxed);
                            *store = new_store();
                            tokio::time::sleep(POOL_RETRY).await;
                        }
                        other => break other,
                    }
                }
            };
        }
        let (run_id, conversation_id, config) =
            (input.run_id.to_string(), input.conversation_id.to_string(), input.config.to_string());
        let (content, history) = (input.content, input.history.into_iter().map(|m| (m.role, m.content)));
        let live = &self.live;
        match &self.pre {
            Pre::V1(pre) => {
                let history = history.map(|(role, content)| wit_types::Message { role, content }).collect();
                let wit_input = wit_types::RunInput { run_id, conversation_id, content, history, config };
                let agent = instantiate!(pre)?;
                live.fetch_add(1, Ordering::Relaxed);
                let _live = LiveGuard(live.clone());
                Ok(agent.call_run(&mut *store, &wit_input).await?.map(|text| (text, Vec::new())))
            }
            Pre::V2(pre) => {
                let history = history.map(|(role, content)| wit_types_v2::Message { role, content }).collect();
                let wit_input =
                    wit_types_v2::RunInput { run_id, conversation_id, content, history, config, client_tools: tools };
                let agent = instantiate!(pre)?;
                live.fetch_add(1, Ordering::Relaxed);
                let _live = LiveGuard(live.clone());
                let answer = agent.call_run(&mut *store, &wit_input).await?;
                Ok(answer.map(|out| (out.text, out.client_calls)))
            }
        }
    }
}

/// The calls of client functions a turn ends with, checked, then journaled
/// in order (the Responses API shows them as `function_call` items).
async fn journal_client_calls(
    host: &RunHost,
    calls: Vec<wit_types_v2::ClientCall>,
    names: &[String],
) -> Result<(), AgentError> {
    check_client_calls(&calls, names).map_err(|m| AgentError::failed(FailReason::Plugin, m))?;
    for call in calls {
        let payload = serde_json::json!({ "call_id": call.call_id, "name": call.name, "arguments": call.arguments });
        host.journal_function_call(payload).await?;
    }
    Ok(())
}

/// What a guest's turn came to, as the sandbox saw it: a limit it hit here
/// (CPU first, then memory) wins over whatever it did next; a trap or its
/// own error fails the run. The host's own verdict (a limit of its calls, a
/// divergence) is weighed once, by the run task's `settle`.
fn guest_verdict<T>(
    outcome: Result<Result<Result<T, String>, wasmtime::Error>, tokio::time::error::Elapsed>,
    data: &Guest,
    limits: &Limits,
) -> Result<T, AgentError> {
    let limit = |what: String| AgentError::failed(FailReason::Limit, what);
    let memory = || limit(format!("memory of {} bytes exceeded", limits.memory_bytes));
    let hit = data.cpu_exceeded.then(|| limit(format!("cpu time budget of {} ms exceeded", limits.cpu_ms)));
    match outcome {
        Err(_) => Err(limit(format!("wall time of {} ms exceeded", limits.wall_ms))),
        Ok(Err(trap)) => Err(match (hit, data.limiter.denied) {
            (Some(f), _) => f,
            (None, true) => memory(),
            (None, false) => AgentError::failed(FailReason::Trap, trap.root_cause().to_string()),
        }),
        Ok(Ok(answer)) => match (hit, answer) {
            (Some(f), _) => Err(f),
            (None, Ok(answer)) => Ok(answer),
            // A runtime that turns a refused growth into its own error
            // (Python's MemoryError, a JS RangeError) hit the limit all the same.
            (None, Err(_)) if data.limiter.denied => Err(memory()),
            (None, Err(message)) => Err(AgentError::failed(FailReason::Plugin, message)),
        },
    }
}

#[async_trait]
impl Agent for WasmAgent {
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError> {
        self.execute(host, input).await
    }

    fn keeps_wall_time(&self) -> bool {
        true
    }
}

/// The sandbox is where the agent registry finds components.
#[async_trait]
impl Components for Sandbox {
    async fn agent(&self, digest: &str, manifest: &Manifest) -> Result<Arc<dyn Agent>, AgentError> {
        let pre = self.pre(digest).await.map_err(|e| {
            // A run's error is shown to its client: the database's words go to the log.
            // The database or the engine failing is the host's fault (and may
            // pass: a resumable run is handed back); the component's is not.
            match &e {
                SandboxError::Db(_) | SandboxError::Engine(_) | SandboxError::Key(_) => {
                    tracing::error!(error = %e, digest, "loading a plugin component failed");
                    AgentError::failed(FailReason::Host, format!("the component {digest} could not be loaded"))
                }
                SandboxError::Invalid(_) | SandboxError::Missing(_) => {
                    AgentError::failed(FailReason::Unavailable, e.to_string())
                }
            }
        })?;
        let (engine, live, pool_waits) = (self.wasm().clone(), self.live.clone(), self.stats.clone());
        Ok(Arc::new(WasmAgent { engine, live, pool_waits, pre, limits: manifest.limits.clone() }))
    }

    fn validate(&self, bytes: &[u8]) -> Result<(), InvalidComponent> {
        Sandbox::validate(self, bytes).map_err(|e| InvalidComponent(e.to_string()))
    }

    fn compile(&self, bytes: &[u8]) -> Result<Compiled, InvalidComponent> {
        self.compile_checked(bytes).map_err(|e| InvalidComponent(e.to_string()))
    }

    async fn keep(&self, compiled: Compiled) {
        self.keep_artifact(&compiled.digest, compiled.artifact).await;
    }

    fn compile_stats(&self) -> CompileStats {
        Sandbox::compile_stats(self)
    }

    fn live(&self) -> usize {
        Sandbox::live(self)
    }
}

/// A guest's output in the host's log: one field, escaped (its line
/// breaks and control characters written as `\n`, `\u{1b}`, ...), so a guest
/// cannot forge log lines of its own.
fn log_output(run_id: crate::db::RunId, stream: &str, out: &output::CappedOutput) {
    let (kept, dropped) = out.contents();
    if !kept.is_empty() {
        let text = String::from_utf8_lossy(&kept);
        let output = text.escape_debug().to_string();
        tracing::info!(%run_id, stream, bytes = kept.len(), dropped_bytes = dropped, %output, "guest output");
    }
}

/// Bytes one `get-random-bytes` call may ask for (WASI's default is 64 MiB).
pub const RANDOM_BYTES_MAX: u64 = 1 << 20;
/// Resources (streams, pollables, ...) one guest may hold at once (wasmtime's
/// default is a million).
pub const RESOURCES_MAX: usize = 10_000;

fn resource_table() -> ResourceTable {
    let mut table = ResourceTable::new();
    table.set_max_capacity(RESOURCES_MAX);
    table
}

/// The manifest's `memory_bytes` over every linear memory of the guest
/// together: a component may have several, and each is counted.
struct MemoryLimiter {
    memory_max: usize,
    /// The memories' sizes together, as granted so far.
    total: usize,
    denied: bool,
}

impl MemoryLimiter {
    fn new(memory_max: usize) -> Self {
        MemoryLimiter { memory_max, total: 0, denied: false }
    }
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let total = self.total.saturating_sub(current).saturating_add(desired);
        if total > self.memory_max {
            self.denied = true;
            return Ok(false);
        }
        self.total = total;
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// A run's store data: WASI (granting nothing), the memory limiter, the CPU
/// budget's count, and the run's host (which owns every other limit).
pub struct Guest {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: MemoryLimiter,
    host: RunHost,
    cpu_ticks: u64,
    cpu_exceeded: bool,
}

impl WasiView for Guest {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str) -> wit_types_v2::ClientCall {
        wit_types_v2::ClientCall { call_id: id.into(), name: name.into(), arguments: "{}".into() }
    }

    #[test]
    fn the_memory_limit_holds_for_every_memory_together() {
        use wasmtime::ResourceLimiter;
        let mut l = MemoryLimiter::new(10 << 20);
        assert!(l.memory_growing(0, 6 << 20, None).unwrap(), "a first memory of 6 MiB");
        assert!(!l.memory_growing(0, 6 << 20, None).unwrap(), "a second of 6 MiB passes 10 together");
        assert!(l.denied);
        assert!(l.memory_growing(0, 4 << 20, None).unwrap(), "a second of 4 MiB fits");
        assert!(!l.memory_growing(6 << 20, 7 << 20, None).unwrap(), "the first may not grow past the sum");
    }

    #[test]
    fn a_turns_client_calls_name_its_client_tools_with_unique_ids() {
        let tools = ["get_weather".to_string()];
        assert!(check_client_calls(&[call("c1", "get_weather"), call("c2", "get_weather")], &tools).is_ok());
        for bad in [
            vec![call("c1", "rm_rf")],
            vec![call("", "get_weather")],
            vec![call(&"x".repeat(CALL_ID_BYTES_MAX + 1), "get_weather")],
            vec![call("c1", "get_weather"), call("c1", "get_weather")],
        ] {
            assert!(
                check_client_calls(&bad, &tools).is_err(),
                "{:?}",
                bad.iter().map(|c| &c.call_id).collect::<Vec<_>>()
            );
        }
        assert!(crate::db::events::RESERVED.contains(&crate::db::events::FUNCTION_CALL), "guests cannot forge calls");
    }
}
