//! How the benchmark reports: percentiles of latencies, medians of rates,
//! the process's resident memory, the CPU a process (and a local database
//! server) spent.

use std::time::Duration;

/// `p50 …, p99 …, max …` of `samples` (sorted in place).
pub fn percentiles(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "no samples".into();
    }
    samples.sort();
    let at = |p: f64| {
        let i = ((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i]
    };
    let fmt = |d: Duration| {
        if d < Duration::from_millis(1) {
            format!("{:.1} µs", d.as_secs_f64() * 1e6)
        } else {
            format!("{:.2} ms", d.as_secs_f64() * 1e3)
        }
    };
    format!("p50 {}, p99 {}, max {}", fmt(at(0.50)), fmt(at(0.99)), fmt(at(1.0)))
}

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    rss_of("self")
}

/// Resident set size of process `pid` (`self`: this one); 0 if unreadable.
pub fn rss_of(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A process's memory as `/proc/<pid>/smaps_rollup` counts it, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    /// Resident: every mapping of a page counts it, so a page of a
    /// component's initial image mapped copy-on-write into n guests counts n times.
    pub rss: u64,
    /// Proportional: a page mapped n times counts 1/n each time (what the
    /// process really holds).
    pub pss: u64,
    /// Written by this process and held by it alone (a guest's own heap).
    pub private_dirty: u64,
}

impl Memory {
    /// What grew from `before` to `self`, per one of `n`, in MiB:
    /// `(resident, proportional, private dirty)`.
    pub fn per(&self, before: &Memory, n: usize) -> (f64, f64, f64) {
        let mib = |a: u64, b: u64| a.saturating_sub(b) as f64 / (1 << 20) as f64 / n.max(1) as f64;
        (mib(self.rss, before.rss), mib(self.pss, before.pss), mib(self.private_dirty, before.private_dirty))
    }
}

/// `pid`'s memory (`self`: this process's); zeros if unreadable.
pub fn memory_of(pid: &str) -> Memory {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let kib = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |k| k * 1024)
    };
    Memory { rss: kib("Rss:"), pss: kib("Pss:"), private_dirty: kib("Private_Dirty:") }
}

/// Linux's unit of CPU time in `/proc/<pid>/stat` (`USER_HZ`, 100 on
/// every architecture Linux exposes to user space).
const TICKS_PER_S: f64 = 100.0;

/// `/proc/<pid>/stat`'s fields from the state on (the name, in parentheses,
/// may hold spaces): field `n` of proc(5) is at index `n - 3`.
fn stat_fields(pid: &str) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// Field `n` of proc(5) as a number.
fn stat_num(fields: &[String], n: usize) -> Option<f64> {
    fields.get(n - 3)?.parse().ok()
}

/// CPU seconds (user and system) this process has spent so far.
pub fn cpu_self() -> f64 {
    cpu_of("self")
}

/// CPU seconds (user and system) process `pid` has spent so far; NaN if unreadable.
pub fn cpu_of(pid: &str) -> f64 {
    stat_fields(pid).and_then(|f| Some(stat_num(&f, 14)? + stat_num(&f, 15)?)).map_or(f64::NAN, |t| t / TICKS_PER_S)
}

/// The PostgreSQL server whose backend has process id `backend`, when it
/// runs on this machine: its postmaster's pid. `None` for a server
/// elsewhere (the pid is then not a `postgres` process here whose parent
/// is one).
pub fn local_postmaster(backend: i32) -> Option<u32> {
    let name = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok();
    if name(&backend.to_string())?.trim() != "postgres" {
        return None;
    }
    let parent = stat_num(&stat_fields(&backend.to_string())?, 4)? as u32;
    (name(&parent.to_string())?.trim() == "postgres").then_some(parent)
}

/// CPU seconds a local server has spent so far: its postmaster's own, its
/// living processes' (backends, WAL writer, checkpointer, ...) and those of
/// the processes that ended (their time moves to the postmaster's
/// children's counters as it reaps them, so a backend that exits between
/// two readings is still counted once).
pub fn server_cpu(postmaster: u32) -> Option<f64> {
    let pm = stat_fields(&postmaster.to_string())?;
    let mut ticks = stat_num(&pm, 14)? + stat_num(&pm, 15)? + stat_num(&pm, 16)? + stat_num(&pm, 17)?;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name();
        let Some(pid) = pid.to_str().filter(|p| p.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let Some(f) = stat_fields(pid) else { continue };
        if stat_num(&f, 4) == Some(f64::from(postmaster)) {
            ticks += stat_num(&f, 14).unwrap_or(0.0) + stat_num(&f, 15).unwrap_or(0.0);
        }
    }
    Some(ticks / TICKS_PER_S)
}

pub fn num_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The URL without its credentials.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(a)) if a > s => format!("{}://…@{}", &url[..s], &url[a + 1..]),
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let mut v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentiles(&mut v), "p50 50.00 ms, p99 99.00 ms, max 100.00 ms");
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(redact("postgres://u:p@h/db"), "postgres://…@h/db");
    }

    #[test]
    fn this_process_cpu_grows_and_is_not_a_server() {
        let t0 = cpu_self();
        assert!(t0.is_finite(), "/proc/self/stat is readable");
        // Spin until the counter moves (a tick is 10 ms), within a bound.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while cpu_self() <= t0 && start.elapsed() < Duration::from_secs(10) {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        assert!(cpu_self() > t0, "spinning shows in /proc/self/stat");
        assert_eq!(local_postmaster(std::process::id() as i32), None, "a test process is not a postgres backend");
    }
}

/// `{own} X µs, database Y µs`: CPU per unit of work of a process (`host`,
/// `node`) and of the server; the database's part is left out when the
/// server is not on this machine.
pub fn cpu_line(own: &str, own_us: f64, server_us: f64) -> String {
    match server_us.is_finite() {
        true => format!("{own} {own_us:.0} µs, database {server_us:.0} µs"),
        false => format!("{own} {own_us:.0} µs, database not on this machine"),
    }
}

/// Pickup p50s in milliseconds: from the enqueue's commit, and from its call.
#[derive(Debug, Clone, Copy)]
pub struct PickupP50 {
    pub from_commit: f64,
    pub from_call: f64,
}
