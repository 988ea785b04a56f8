//! WASI clocks and random generators for a resumable run: readings go
//! through the run's host, which records them (and replays them on a resumed
//! attempt); the generators are seeded from the run's seed, so every attempt
//! draws the same numbers. Runs that are not resumable keep wasmtime's own.

use std::time::{Duration, Instant, SystemTime};

use rand_wasi::SeedableRng;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtxBuilder};

use crate::agent::RunHost;

struct Wall(RunHost);

impl HostWallClock for Wall {
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }

    fn now(&self) -> Duration {
        let live = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        self.0.wall_clock(live)
    }
}

struct Monotonic {
    host: RunHost,
    start: Instant,
}

impl HostMonotonicClock for Monotonic {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        let live = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.host.monotonic_clock(live)
    }
}

/// Gives `builder` the run's recorded clocks and seeded generators when the
/// run is resumable.
pub fn install(builder: &mut WasiCtxBuilder, host: &RunHost) {
    let Some(seed) = host.random_seed() else {
        return;
    };
    let mut insecure = seed;
    insecure[0] ^= 0xff;
    builder
        .wall_clock(Wall(host.clone()))
        .monotonic_clock(Monotonic { host: host.clone(), start: Instant::now() })
        .secure_random(rand_wasi::rngs::StdRng::from_seed(seed))
        .insecure_random(rand_wasi::rngs::StdRng::from_seed(insecure))
        .insecure_random_seed(u128::from_le_bytes(seed[..16].try_into().expect("16 bytes")));
}
