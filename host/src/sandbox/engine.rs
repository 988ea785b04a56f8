//! The one place that narrows wasmtime to what the host uses: one `Engine`
//! per process with the component model, the pooling allocator sized for
//! [`INSTANCES_MAX`] concurrent guests, and epoch interruption driven by a
//! ticker thread. Nothing else in the host builds a `Config`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::run::manifest::MEMORY_BYTES_CEILING;

/// How often the engine's epoch advances: the CPU budget's unit and the
/// longest a running guest goes without yielding to the host.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Concurrent guest instances of a sandbox built for no process's slots
/// (tests, the benchmark's library use); a `serve` process sizes its pool
/// by its `--max-runs` instead ([`pool_for_runs`]).
pub const INSTANCES_MAX: u32 = 2_000;
/// The most slots (`--max-runs`) one process may have. Each slot's guest
/// takes a pool slot: two linear-memory reservations of 4 GiB of address
/// space (nothing resident until touched) and a fiber stack, so 10,000
/// runs reserve about 90 TiB of the 128 TiB a process can address, and
/// their stacks' guard pages about 25,000 of Linux's 65,530 memory maps.
pub const MAX_RUNS_MAX: usize = 10_000;

/// The pool a process with `max_runs` slots needs: a guest per slot, and
/// an eighth more (a run's guest is given back to the pool as its run
/// ends, while the next run may already be taking one).
pub fn pool_for_runs(max_runs: usize) -> u32 {
    let runs = max_runs.clamp(1, MAX_RUNS_MAX) as u32;
    runs + runs / 8 + 16
}
/// Core instances one guest may use, on average, before the pool runs out:
/// a Rust guest makes 3, a componentize-js one 4, a componentize-py one 14
/// (CPython, its libc and the WASI adapter are separate core modules).
/// A pool exhausted anyway makes a new guest wait for a slot, never fail.
pub const CORE_INSTANCES_PER_GUEST: u32 = 16;
/// Core instances, memories and tables one component may have (a
/// componentize-py guest, the largest example, has 14 core instances).
pub const CORE_INSTANCES_PER_COMPONENT_MAX: u32 = 64;
pub const MEMORIES_PER_COMPONENT_MAX: u32 = 8;
pub const TABLES_PER_COMPONENT_MAX: u32 = 16;
/// Elements of one table: a componentize-py guest's largest table has
/// about 7,700, a componentize-js one 5,700 (wasmtime's default, 20,000).
pub const TABLE_ELEMENTS_MAX: usize = 20_000;

/// The engine and its epoch ticker; the ticker stops when this is dropped.
pub struct SandboxEngine {
    pub engine: Engine,
    ticker_stop: Arc<AtomicBool>,
}

impl Drop for SandboxEngine {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

impl SandboxEngine {
    /// The engine with a pool for `instances` concurrent guests
    /// ([`INSTANCES_MAX`] in a host; tests exhaust a smaller one).
    pub fn new(instances: u32) -> Result<SandboxEngine, String> {
        let mut pooling = PoolingAllocationConfig::default();
        let (core, memories, tables) = (instances * CORE_INSTANCES_PER_GUEST, instances * 2, instances * 4);
        pooling.total_component_instances(instances);
        pooling.total_core_instances(core);
        pooling.total_memories(memories);
        pooling.total_tables(tables);
        // What one component may need, checked when it is compiled (so at
        // upload): a component past them is refused with the count it
        // needs, instead of waiting forever for a pool that can never fit it.
        pooling.max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT_MAX.min(core));
        pooling.max_memories_per_component(MEMORIES_PER_COMPONENT_MAX.min(memories));
        pooling.max_tables_per_component(TABLES_PER_COMPONENT_MAX.min(tables));
        // Each guest's async call runs on a fiber stack from the pool; a
        // quarter more than the instances, so runs waiting for an instance
        // (whose stores may hold a stack) never leave a running guest
        // without one. (Each stack's guard page is a memory map of its own:
        // twice the instances would pass Linux's map count at 10,000 runs.)
        pooling.total_stacks(instances + instances / 4 + 16);
        pooling.table_elements(TABLE_ELEMENTS_MAX);
        pooling.max_memory_size(MEMORY_BYTES_CEILING as usize);
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
        let engine = Engine::new(&config).map_err(|e| format!("{e:#}"))?;
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
            .map_err(|e| e.to_string())?;
        Ok(SandboxEngine { engine, ticker_stop })
    }
}
