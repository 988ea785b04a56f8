//! The sandbox: one wasmtime `Engine` per process (pooling allocator, epoch
//! interruption driven by a ticker), an `AgentPre` cached per plugin digest,
//! compiled code cached on disk keyed by digest and engine compatibility, and
//! one `Store` per run, dropped after it.
//!
//! Enforcement the guest cannot bypass lives here: limits (memory, CPU, wall
//! time, payload bytes, events, tool calls), WASI that grants nothing, and
//! interruption: a guest yields to the host at every epoch tick, so dropping
//! its future (claim lost, drain) stops it within a tick.

pub mod manifest;
mod output;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sqlx::PgPool;
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::agent::{AgentError, FailReason, HostError, RunHost, RunInput};
use crate::db;
use crate::tools::{LlmConfig, ToolCall, ToolRegistry};
pub use manifest::{Limits, Manifest};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "agent",
        imports: { default: async | trappable },
        exports: { default: async },
    });
}

use bindings::agent_host::plugin::{host as wit_host, types as wit_types};
use bindings::{Agent as AgentWorld, AgentPre};

/// How often the engine's epoch advances: the CPU budget's unit and the
/// longest a running guest goes without yielding to the host.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Guest stdout and stderr kept for the host's log, per stream.
pub const GUEST_OUTPUT_BYTES_MAX: usize = 64 * 1024;
/// Concurrent guest instances the pooling allocator is sized for.
pub const INSTANCES_MAX: u32 = 2_000;

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
}

/// The process's sandbox.
pub struct Sandbox {
    engine: Engine,
    linker: Linker<Guest>,
    pool: PgPool,
    cache_dir: Option<PathBuf>,
    /// One cell per digest: concurrent first runs of a plugin compile it once.
    pres: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<AgentPre<Guest>>>>>,
    ticker_stop: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    /// What `call-tool` reaches, behind each plugin's grants.
    tools: ToolRegistry,
}

/// Counts a live guest instance for as long as it is held.
struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

impl Sandbox {
    /// A sandbox whose only tool is the offline model (see [`Sandbox::with_tools`]).
    pub fn new(pool: PgPool, cache_dir: Option<PathBuf>) -> Result<Arc<Sandbox>, SandboxError> {
        let tools = ToolRegistry::from_config(&LlmConfig::default(), &[]).map_err(SandboxError::Engine)?;
        Sandbox::with_tools(pool, cache_dir, tools)
    }

    /// Builds the engine and starts its epoch ticker. `cache_dir` keeps
    /// compiled components across restarts; `tools` serve `call-tool`.
    pub fn with_tools(
        pool: PgPool,
        cache_dir: Option<PathBuf>,
        tools: ToolRegistry,
    ) -> Result<Arc<Sandbox>, SandboxError> {
        let mut pooling = PoolingAllocationConfig::default();
        pooling.total_component_instances(INSTANCES_MAX);
        pooling.total_core_instances(INSTANCES_MAX * 4);
        pooling.total_memories(INSTANCES_MAX * 2);
        pooling.total_tables(INSTANCES_MAX * 4);
        pooling.max_memory_size(manifest::MEMORY_BYTES_CEILING as usize);
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
        let engine = Engine::new(&config).map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        let mut linker = Linker::<Guest>::new(&engine);
        // WASI is linked so standard guests instantiate, and grants nothing.
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        AgentWorld::add_to_linker::<_, HasSelf<_>>(&mut linker, |g| g)
            .map_err(|e| SandboxError::Engine(format!("{e:#}")))?;
        let ticker_stop = Arc::new(AtomicBool::new(false));
        let (e, stop) = (engine.clone(), ticker_stop.clone());
        std::thread::Builder::new()
            .name("epoch-ticker".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    e.increment_epoch();
                }
            })
            .map_err(|e| SandboxError::Engine(e.to_string()))?;
        if let Some(dir) = &cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| SandboxError::Engine(format!("cache dir {}: {e}", dir.display())))?;
        }
        Ok(Arc::new(Sandbox {
            engine,
            linker,
            pool,
            cache_dir,
            pres: Mutex::new(HashMap::new()),
            ticker_stop,
            live: Arc::new(AtomicUsize::new(0)),
            tools,
        }))
    }

    /// Guest instances alive right now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Checks that `bytes` are a component of this world that imports only
    /// what the host provides. The error says what does not fit.
    pub fn validate(&self, bytes: &[u8]) -> Result<(), SandboxError> {
        let component = Component::new(&self.engine, bytes).map_err(|e| SandboxError::Invalid(format!("{e:#}")))?;
        self.prepare(&component)?;
        Ok(())
    }

    fn prepare(&self, component: &Component) -> Result<AgentPre<Guest>, SandboxError> {
        let pre = self.linker.instantiate_pre(component).map_err(|e| SandboxError::Invalid(format!("{e:#}")))?;
        AgentPre::new(pre).map_err(|e| SandboxError::Invalid(format!("{e:#}")))
    }

    fn cache_path(&self, digest: &str) -> Option<PathBuf> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        let hex = digest.trim_start_matches("sha256:");
        self.cache_dir.as_ref().map(|d| d.join(format!("{hex}-{:016x}.cwasm", h.finish())))
    }

    /// The prepared component for `digest`: memory, then disk, then the
    /// database. Concurrent callers for one digest wait for a single load.
    async fn pre(&self, digest: &str) -> Result<AgentPre<Guest>, SandboxError> {
        let cell = self.pres.lock().unwrap().entry(digest.to_string()).or_default().clone();
        cell.get_or_try_init(|| self.load(digest)).await.cloned()
    }

    async fn load(&self, digest: &str) -> Result<AgentPre<Guest>, SandboxError> {
        let cached = self.cache_path(digest).filter(|p| p.exists());
        let component = match cached.as_ref().and_then(|p| {
            // SAFETY: files in the cache directory are written only by
            // `Component::serialize` of this engine configuration (the name
            // carries the engine's compatibility hash).
            unsafe { Component::deserialize_file(&self.engine, p) }.ok()
        }) {
            Some(c) => c,
            None => {
                let bytes = db::plugins::component(&self.pool, digest)
                    .await?
                    .ok_or_else(|| SandboxError::Missing(digest.into()))?;
                let engine = self.engine.clone();
                let component = tokio::task::spawn_blocking(move || Component::new(&engine, &bytes))
                    .await
                    .map_err(|e| SandboxError::Engine(e.to_string()))?
                    .map_err(|e| SandboxError::Invalid(format!("{e:#}")))?;
                if let (Some(path), Ok(bytes)) = (self.cache_path(digest), component.serialize()) {
                    // Another process may write the same file: a private
                    // temporary name, then an atomic rename.
                    let tmp =
                        path.with_extension(format!("{}.{}.tmp", std::process::id(), uuid::Uuid::new_v4().simple()));
                    if std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, &path)).is_err() {
                        let _ = std::fs::remove_file(&tmp);
                        tracing::warn!(path = %path.display(), "could not cache the compiled component");
                    }
                }
                component
            }
        };
        self.prepare(&component)
    }

    /// Runs one turn of the component `digest` under `manifest`.
    pub async fn run(
        &self,
        host: &RunHost,
        digest: &str,
        manifest: &Manifest,
        input: RunInput,
        history: Vec<(String, String)>,
    ) -> Result<String, AgentError> {
        let pre = self.pre(digest).await.map_err(|e| AgentError::failed(FailReason::Unavailable, e.to_string()))?;
        let limits = manifest.limits.clone();
        let stdout = output::CappedOutput::new(GUEST_OUTPUT_BYTES_MAX);
        let stderr = output::CappedOutput::new(GUEST_OUTPUT_BYTES_MAX);
        // Nothing is granted: no preopens, no environment, no network.
        let wasi = WasiCtx::builder().stdout(stdout.clone()).stderr(stderr.clone()).build();
        let guest = Guest {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter { memory_max: limits.memory_bytes as usize, denied: false },
            host: host.clone(),
            tools: self.tools.clone(),
            manifest: manifest.clone(),
            events: 0,
            tool_calls: 0,
            cpu_ticks: 0,
            failure: None,
        };
        let mut store = Store::new(&self.engine, guest);
        store.limiter(|g| &mut g.limiter);
        let cpu_ms = limits.cpu_ms;
        let cpu_ticks_max = cpu_ms.div_ceil(EPOCH_TICK.as_millis() as u64).max(1);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |mut ctx| {
            let g = ctx.data_mut();
            g.cpu_ticks += 1;
            if g.cpu_ticks > cpu_ticks_max {
                g.failure = Some(format!("cpu time budget of {cpu_ms} ms exceeded"));
                return Ok(UpdateDeadline::Interrupt);
            }
            // Yield to the host every tick: the run's future can then be
            // dropped (claim lost, drain) and other runs get the thread.
            Ok(UpdateDeadline::Yield(1))
        });
        let wit_input = wit_types::RunInput {
            run_id: input.run_id.to_string(),
            conversation_id: input.conversation_id.to_string(),
            content: input.content,
            history: history.into_iter().map(|(role, content)| wit_types::Message { role, content }).collect(),
            config: input.config.to_string(),
        };
        let wall = Duration::from_millis(limits.wall_ms);
        let live = &self.live;
        let outcome = tokio::time::timeout(wall, async {
            let agent = pre.instantiate_async(&mut store).await?;
            live.fetch_add(1, Ordering::Relaxed);
            let _live = LiveGuard(live.clone());
            agent.call_run(&mut store, &wit_input).await
        })
        .await;
        let run_id = input.run_id;
        log_output(run_id, "stdout", &stdout);
        log_output(run_id, "stderr", &stderr);
        let data = store.data();
        let result = match outcome {
            Err(_) => Err(AgentError::failed(FailReason::Limit, format!("wall time of {} ms exceeded", limits.wall_ms))),
            Ok(Err(trap)) => Err(match (&data.failure, data.limiter.denied) {
                (Some(f), _) => AgentError::failed(FailReason::Limit, f.clone()),
                (None, true) => {
                    AgentError::failed(FailReason::Limit, format!("memory of {} bytes exceeded", limits.memory_bytes))
                }
                (None, false) => AgentError::failed(FailReason::Trap, trap.root_cause().to_string()),
            }),
            Ok(Ok(answer)) => match (&data.failure, answer) {
                (Some(f), _) => Err(AgentError::failed(FailReason::Limit, f.clone())),
                (None, Ok(text)) => Ok(text),
                (None, Err(message)) => Err(AgentError::failed(FailReason::Plugin, message)),
            },
        };
        drop(store);
        result
    }
}

fn log_output(run_id: crate::db::RunId, stream: &str, out: &output::CappedOutput) {
    let (kept, dropped) = out.contents();
    if !kept.is_empty() {
        let text = String::from_utf8_lossy(&kept);
        tracing::info!(%run_id, stream, bytes = kept.len(), dropped_bytes = dropped, "guest output:\n{text}");
    }
}

struct MemoryLimiter {
    memory_max: usize,
    denied: bool,
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_max {
            self.denied = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// A run's store data: WASI (granting nothing), limits, and the run's host.
pub struct Guest {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: MemoryLimiter,
    host: RunHost,
    tools: ToolRegistry,
    manifest: Manifest,
    events: u64,
    tool_calls: u64,
    cpu_ticks: u64,
    /// What limit was hit: the run must fail with it (reason `limit`).
    failure: Option<String>,
}

impl WasiView for Guest {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

fn to_wit(e: HostError) -> wit_types::HostError {
    match e {
        HostError::Cancelled => wit_types::HostError::Cancelled,
        HostError::Fenced => wit_types::HostError::Fenced,
        HostError::Denied(m) => wit_types::HostError::Denied(m),
        HostError::Invalid(m) => wit_types::HostError::Invalid(m),
        HostError::Limit(m) => wit_types::HostError::Limit(m),
        HostError::ToolFailed(m) | HostError::Unavailable(m) => wit_types::HostError::ToolFailed(m),
    }
}

impl Guest {
    /// A limit refusal: the guest gets the typed error, and the run will end
    /// failed with the reason whatever the guest does next.
    fn limit(&mut self, reason: String) -> wit_types::HostError {
        if self.failure.is_none() {
            self.failure = Some(reason.clone());
        }
        wit_types::HostError::Limit(reason)
    }
}

impl wit_types::Host for Guest {}

impl wit_host::Host for Guest {
    async fn emit_event(
        &mut self,
        kind: String,
        payload: String,
    ) -> wasmtime::Result<Result<(), wit_types::HostError>> {
        let max = self.manifest.limits.payload_bytes;
        if payload.len() as u64 > max {
            return Ok(Err(self.limit(format!("event payload of {} bytes exceeds {max}", payload.len()))));
        }
        self.events += 1;
        if self.events > self.manifest.limits.events_max {
            return Ok(Err(self.limit(format!("more than {} events", self.manifest.limits.events_max))));
        }
        let value: Value = match serde_json::from_str(&payload) {
            Ok(v @ Value::Object(_)) => v,
            _ => return Ok(Err(wit_types::HostError::Invalid("payload must be a JSON object".into()))),
        };
        Ok(self.host.emit_event(&kind, value).await.map_err(to_wit))
    }

    async fn call_tool(
        &mut self,
        name: String,
        args: String,
    ) -> wasmtime::Result<Result<String, wit_types::HostError>> {
        if self.host.check_cancel() {
            return Ok(Err(wit_types::HostError::Cancelled));
        }
        let max = self.manifest.limits.payload_bytes;
        if args.len() as u64 > max {
            return Ok(Err(self.limit(format!("tool arguments of {} bytes exceed {max}", args.len()))));
        }
        if !self.manifest.tools.iter().any(|t| t == &name) {
            return Ok(Err(wit_types::HostError::Denied(format!("tool {name:?} is not granted to this plugin"))));
        }
        self.tool_calls += 1;
        if self.tool_calls > self.manifest.limits.tool_calls_max {
            return Ok(Err(self.limit(format!("more than {} tool calls", self.manifest.limits.tool_calls_max))));
        }
        let args: Value = match serde_json::from_str(&args) {
            Ok(v) => v,
            Err(e) => return Ok(Err(wit_types::HostError::Invalid(format!("tool arguments are not JSON: {e}")))),
        };
        // With the run id, the call's index is the webhook's Idempotency-Key:
        // 1-based, never repeated within a run.
        let call = ToolCall {
            run_id: self.host.run_id(),
            call_index: self.tool_calls as u32,
            name: &name,
            args,
            timeout_max: Some(Duration::from_millis(self.manifest.limits.tool_timeout_ms)),
        };
        let answer = self.tools.invoke(call, &self.host, self.host.cancelled()).await;
        match answer {
            Ok(text) if text.len() as u64 > max => {
                Ok(Err(self.limit(format!("tool answer of {} bytes exceeds {max}", text.len()))))
            }
            Ok(text) => Ok(Ok(text)),
            Err(e) => Ok(Err(to_wit(e))),
        }
    }

    async fn check_cancel(&mut self) -> wasmtime::Result<bool> {
        Ok(self.host.check_cancel())
    }
}
