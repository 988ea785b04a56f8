//! Waiting for a condition, the one way the tests wait: polled every 20 ms
//! up to a bound, never a bare sleep. Standard library and tokio only, so
//! the benchmark's tests include this file too (`bench/tests/smoke.rs`).

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(20);

/// Polls `cond` until it holds or `within` passes (then panics with `what`).
pub async fn wait_for<F, Fut>(what: &str, within: Duration, cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    assert!(poll_until(within, cond).await, "timed out after {within:?} waiting for {what}");
}

/// Polls `cond` every 20 ms: `true` once it holds, `false` when `within`
/// passed first (for a wait whose failure says more than [`wait_for`]'s).
pub async fn poll_until<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    let mut tick = tokio::time::interval(POLL);
    loop {
        tick.tick().await;
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

/// [`poll_until`] for a synchronous test: the thread sleeps between polls.
pub fn poll_until_blocking(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}
