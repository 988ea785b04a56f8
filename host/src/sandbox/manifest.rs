//! A plugin's manifest: the tools it is granted and its limits. Every limit
//! has a default; exceeding one ends the run `failed` with a named reason.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Tools `call-tool` may reach; anything else is `denied`.
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub limits: Limits,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Linear memory of the guest.
    pub memory_bytes: u64,
    /// CPU time spent executing guest code, counted in epoch ticks.
    pub cpu_ms: u64,
    /// Wall time of one run, host calls included.
    pub wall_ms: u64,
    /// Bytes of one host call's arguments (an event payload, tool arguments).
    pub payload_bytes: u64,
    /// Events one run may emit.
    pub events_max: u64,
    /// Tool calls one run may make.
    pub tool_calls_max: u64,
    /// One tool call, at most (a tool's own timeout may be shorter).
    pub tool_timeout_ms: u64,
}

pub const MEMORY_BYTES_DEFAULT: u64 = 64 << 20;
/// The ceiling an operator's manifest may ask for.
pub const MEMORY_BYTES_CEILING: u64 = 1 << 30;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: MEMORY_BYTES_DEFAULT,
            cpu_ms: 60_000,
            wall_ms: 600_000,
            payload_bytes: 1 << 20,
            events_max: 100_000,
            tool_calls_max: 1_000,
            tool_timeout_ms: 300_000,
        }
    }
}

impl Manifest {
    /// Parses and checks a manifest; the message says what is wrong.
    pub fn parse(value: &serde_json::Value) -> Result<Manifest, String> {
        let m: Manifest = serde_json::from_value(value.clone()).map_err(|e| format!("manifest: {e}"))?;
        let l = &m.limits;
        if l.memory_bytes < (1 << 20) || l.memory_bytes > MEMORY_BYTES_CEILING {
            return Err(format!("manifest: limits.memory_bytes must be 1 MiB to 1 GiB, not {}", l.memory_bytes));
        }
        for (name, v) in [
            ("cpu_ms", l.cpu_ms),
            ("wall_ms", l.wall_ms),
            ("payload_bytes", l.payload_bytes),
            ("events_max", l.events_max),
            ("tool_calls_max", l.tool_calls_max),
            ("tool_timeout_ms", l.tool_timeout_ms),
        ] {
            if v == 0 {
                return Err(format!("manifest: limits.{name} must be greater than zero"));
            }
        }
        Ok(m)
    }
}
