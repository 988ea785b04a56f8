//! How the benchmark reports: percentiles of latencies, medians of rates,
//! the process's resident memory.

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
}
