//! Prometheus text exposition for `/metrics`: counters and gauges read from
//! the process's atomics and a few cheap queries, and a fixed-bucket histogram.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bucket upper bounds (seconds) for latency histograms.
const BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

/// A histogram that records without locks.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let seconds = seconds.max(0.0);
        if let Some(i) = BUCKETS.iter().position(|b| seconds <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add((seconds * 1e6).round() as u64, Ordering::Relaxed);
    }
}

/// Builds one exposition document.
#[derive(Default)]
pub struct Exposition(String);

impl Exposition {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.header(name, "counter", help);
        let _ = writeln!(self.0, "{name} {value}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, "gauge", help);
        let _ = writeln!(self.0, "{name} {value}");
    }

    /// One metric with labelled samples: `samples` are (labels, value), the
    /// labels already rendered as `key="value",...`.
    pub fn labelled(&mut self, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
        self.header(name, kind, help);
        for (labels, value) in samples {
            let _ = writeln!(self.0, "{name}{{{labels}}} {value}");
        }
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        let mut cumulative = 0;
        for (bound, count) in BUCKETS.iter().zip(&h.counts) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(self.0, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = h.count.load(Ordering::Relaxed);
        let _ = writeln!(self.0, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(self.0, "{name}_sum {}", h.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(self.0, "{name}_count {count}");
    }

    pub fn finish(self) -> String {
        self.0
    }
}

/// The sandbox's compile counters (compile once, run anywhere).
pub fn compile_stats(e: &mut Exposition, s: &crate::agent::CompileStats) {
    e.counter("agent_host_component_compiles_total", "Plugin components this process compiled.", s.compiles);
    e.counter(
        "agent_host_component_artifacts_loaded_total",
        "Compiled components this process loaded from the database instead of compiling.",
        s.artifacts_loaded,
    );
    e.counter(
        "agent_host_component_artifacts_rejected_total",
        "Stored compiled components refused (MAC mismatch) and recompiled.",
        s.artifacts_rejected,
    );
    e.counter(
        "agent_host_sandbox_pool_waits_total",
        "Guest instantiations that waited for a slot of the exhausted pooling allocator.",
        s.pool_waits,
    );
}

/// A label value made safe for the text format.
pub fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        for s in [0.0005, 0.003, 0.003, 2.0, 100.0] {
            h.observe(s);
        }
        let mut e = Exposition::default();
        e.histogram("x", "test", &h);
        let text = e.finish();
        assert!(text.contains("x_bucket{le=\"0.001\"} 1\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"0.005\"} 3\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"5\"} 4\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"+Inf\"} 5\nx_sum 102.0065\nx_count 5\n"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label_value("a\"b"), "a\\\"b");
    }
}
