//! A plugin's manifest: the tools it is granted and its limits, pinned on
//! the run at enqueue beside the digest. Every limit has a default and a
//! ceiling; exceeding one at run time ends the run `failed` with reason
//! `limit`. [`crate::run::host::RunHost`] enforces the per-call ones (payload,
//! events, tool calls, tool timeout), the sandbox the rest (memory, CPU, wall).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The manifest's JSON Schema, for an editor (`agent-host new` names
    /// the one this host was built with); the host ignores it.
    #[serde(rename = "$schema", default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// Tools `call-tool` may reach; anything else is `denied`. An MCP
    /// server's tools are `<server>.<tool>`, all of them `<server>.*`.
    #[serde(default)]
    pub tools: Vec<String>,
    /// What one run may take: memory, CPU, time, events, calls, bytes.
    #[serde(default)]
    pub limits: Limits,
    /// What happens to a run whose worker dies: see [`Durability`].
    #[serde(default)]
    pub durability: Durability,
    /// Tools whose calls wait for a person's approval (`always`) or not
    /// (`never`, the default). Needs `"durability": "resume"`: the run is
    /// suspended while it waits and resumed by replay.
    #[serde(default)]
    pub approval: std::collections::BTreeMap<String, Approval>,
    /// What the agent does, for people and other agents (its A2A card's
    /// description; at most 2,000 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// What the agent can be asked to do (its A2A card's skills; at most 50).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skills: Vec<Skill>,
    /// The JSON Schema of a run's `config` (an object schema): what callers
    /// are told to send, as the `config` argument of the agent's MCP tool.
    /// The host passes config through unchecked; the agent reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_schema: Option<serde_json::Map<String, serde_json::Value>>,
}

/// One thing an agent can be asked to do, as its A2A card lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Skill {
    /// Unique among the agent's skills.
    pub id: String,
    /// Its name, for people.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Keywords.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Requests a person or an agent might send for it.
    #[serde(default)]
    pub examples: Vec<String>,
}

/// Characters of a manifest's description (and of each skill's texts).
pub const DESCRIPTION_CHARS_MAX: usize = 2_000;
/// Bytes of a manifest's `config_schema`, as JSON, at most.
pub const CONFIG_SCHEMA_BYTES_MAX: usize = 16 * 1024;
/// Skills a manifest lists at most.
pub const SKILLS_MAX: usize = 50;

/// Whether a tool's calls wait for approval (the tools file says it too).
pub use crate::tools::Approval;

/// What happens to a run whose worker dies (or whose drain budget runs out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema)]
pub enum Durability {
    /// The article's stance: the run ends `failed`; a person may retry it.
    #[default]
    #[serde(rename = "at-most-once")]
    AtMostOnce,
    /// Every host call is recorded; the run goes back to the queue and
    /// another process replays the log and goes on live.
    #[serde(rename = "resume")]
    Resume,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// Bytes one run's journal may hold (event kinds and payloads, streamed
    /// text included); past it the run ends failed with reason `limit`.
    pub journal_bytes_max: u64,
    /// Tool calls one run may make.
    pub tool_calls_max: u64,
    /// One tool call, at most (a tool's own timeout may be shorter).
    pub tool_timeout_ms: u64,
    /// Host calls a resumable run may record (tool calls, cancel checks,
    /// clock readings); past it the run ends failed with reason `limit`.
    pub recorded_calls_max: u64,
    /// How long a call waits for its approval before it is rejected.
    pub approval_timeout_ms: u64,
    /// Calls of the host interface one run may make (events, tool calls,
    /// cancel checks, tool lists): the host's own work a guest can ask for,
    /// beyond the CPU its own code takes. Past it the run ends failed with
    /// reason `limit`.
    pub host_calls_max: u64,
    /// Child runs (sub-agents, `agent:<plugin>`) one run may start.
    pub children_max: u64,
    /// Child runs of one run queued, running or waiting at once (its fan-out).
    pub children_active_max: u64,
    /// How deep a tree of runs may grow under this one's agent: a run at
    /// depth `d` (0: nobody's agent started it) starts a child only while
    /// `d + 1` is at most this.
    pub agent_depth_max: u64,
}

pub const MEMORY_BYTES_DEFAULT: u64 = 64 << 20;
/// The ceiling an operator's manifest may ask for.
pub const MEMORY_BYTES_CEILING: u64 = 1 << 30;
/// The least memory a manifest may ask for.
pub const MEMORY_BYTES_FLOOR: u64 = 1 << 20;
/// Ceilings of the other limits: a manifest asking for more is refused.
pub const CPU_MS_CEILING: u64 = 3_600_000;
pub const WALL_MS_CEILING: u64 = 24 * 3_600_000;
pub const PAYLOAD_BYTES_CEILING: u64 = 16 << 20;
pub const EVENTS_CEILING: u64 = 10_000_000;
pub const JOURNAL_BYTES_CEILING: u64 = 1 << 30;
pub const HOST_CALLS_CEILING: u64 = 100_000_000;
pub const TOOL_CALLS_CEILING: u64 = 100_000;
pub const TOOL_TIMEOUT_MS_CEILING: u64 = 3_600_000;
pub const RECORDED_CALLS_CEILING: u64 = 1_000_000;
pub const APPROVAL_TIMEOUT_MS_CEILING: u64 = 30 * 24 * 3_600_000;
pub const CHILDREN_CEILING: u64 = 1_000;
pub const CHILDREN_ACTIVE_CEILING: u64 = 100;
/// The deepest tree of runs (the schema holds `depth` to 16).
pub const AGENT_DEPTH_CEILING: u64 = 8;
/// Tools one manifest may name, and the length of a name.
pub const TOOLS_MAX: usize = 256;
pub const TOOL_NAME_BYTES_MAX: usize = 64;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: MEMORY_BYTES_DEFAULT,
            cpu_ms: 60_000,
            wall_ms: 600_000,
            payload_bytes: 1 << 20,
            events_max: 100_000,
            journal_bytes_max: 64 << 20,
            tool_calls_max: 1_000,
            tool_timeout_ms: 300_000,
            recorded_calls_max: 100_000,
            approval_timeout_ms: 24 * 3_600_000,
            host_calls_max: 1_000_000,
            children_max: 16,
            children_active_max: 8,
            agent_depth_max: 2,
        }
    }
}

/// An operator's ceilings for one tenant's own plugins (`agent-host tenants
/// ceiling`): limit name to the most a manifest may ask for.
pub use crate::db::tenants::Ceilings;

impl Limits {
    /// Every limit as (name, value, least, most a manifest may ask for).
    pub fn fields(&self) -> [(&'static str, u64, u64, u64); 14] {
        [
            ("memory_bytes", self.memory_bytes, MEMORY_BYTES_FLOOR, MEMORY_BYTES_CEILING),
            ("cpu_ms", self.cpu_ms, 1, CPU_MS_CEILING),
            ("wall_ms", self.wall_ms, 1, WALL_MS_CEILING),
            ("payload_bytes", self.payload_bytes, 1, PAYLOAD_BYTES_CEILING),
            ("events_max", self.events_max, 1, EVENTS_CEILING),
            ("journal_bytes_max", self.journal_bytes_max, 1, JOURNAL_BYTES_CEILING),
            ("host_calls_max", self.host_calls_max, 1, HOST_CALLS_CEILING),
            ("tool_calls_max", self.tool_calls_max, 1, TOOL_CALLS_CEILING),
            ("tool_timeout_ms", self.tool_timeout_ms, 1, TOOL_TIMEOUT_MS_CEILING),
            ("recorded_calls_max", self.recorded_calls_max, 1, RECORDED_CALLS_CEILING),
            ("approval_timeout_ms", self.approval_timeout_ms, 1, APPROVAL_TIMEOUT_MS_CEILING),
            ("children_max", self.children_max, 0, CHILDREN_CEILING),
            ("children_active_max", self.children_active_max, 1, CHILDREN_ACTIVE_CEILING),
            ("agent_depth_max", self.agent_depth_max, 1, AGENT_DEPTH_CEILING),
        ]
    }

    /// Checks ceilings an operator sets for a tenant: known names, each
    /// within what a manifest may ask for at all.
    pub fn check_ceilings(ceilings: &Ceilings) -> Result<(), String> {
        let fields = Limits::default().fields();
        for (name, &v) in ceilings {
            let Some(&(_, _, floor, most)) = fields.iter().find(|f| f.0 == name) else {
                let names: Vec<&str> = fields.iter().map(|f| f.0).collect();
                return Err(format!("no limit named {name:?}; limits are {}", names.join(", ")));
            };
            if v < floor || v > most {
                return Err(format!("the ceiling of {name} must be {floor} to {most}, not {v}"));
            }
        }
        Ok(())
    }

    /// The limits above `ceilings`, each as `name value > ceiling`.
    pub fn above(&self, ceilings: &Ceilings) -> Vec<String> {
        self.fields()
            .into_iter()
            .filter_map(|(name, v, _, _)| {
                let c = *ceilings.get(name)?;
                (v > c).then(|| format!("{name} {v} > {c}"))
            })
            .collect()
    }
}

impl Manifest {
    /// Parses and checks a manifest; the message says what is wrong.
    pub fn parse(value: &serde_json::Value) -> Result<Manifest, String> {
        let m: Manifest = serde_json::from_value(value.clone()).map_err(|e| format!("manifest: {e}"))?;
        for (name, v, floor, ceiling) in m.limits.fields() {
            if v < floor || v > ceiling {
                return Err(format!("manifest: limits.{name} must be {floor} to {ceiling}, not {v}"));
            }
        }
        if m.tools.len() > TOOLS_MAX {
            return Err(format!("manifest: at most {TOOLS_MAX} tools, not {}", m.tools.len()));
        }
        if let Some(t) = m.tools.iter().find(|t| t.is_empty() || t.len() > TOOL_NAME_BYTES_MAX) {
            return Err(format!("manifest: tool name {t:?} must be 1-{TOOL_NAME_BYTES_MAX} bytes"));
        }
        if m.approval.len() > TOOLS_MAX {
            return Err(format!("manifest: at most {TOOLS_MAX} approval entries, not {}", m.approval.len()));
        }
        let long = |t: &String| t.chars().count() > DESCRIPTION_CHARS_MAX;
        if m.description.as_ref().is_some_and(long) {
            return Err(format!("manifest: description is at most {DESCRIPTION_CHARS_MAX} characters"));
        }
        if m.skills.len() > SKILLS_MAX {
            return Err(format!("manifest: at most {SKILLS_MAX} skills, not {}", m.skills.len()));
        }
        for skill in &m.skills {
            let texts =
                [&skill.id, &skill.name, &skill.description].into_iter().chain(&skill.tags).chain(&skill.examples);
            if skill.id.is_empty() || skill.tags.len() + skill.examples.len() > SKILLS_MAX || texts.clone().any(long) {
                return Err(format!(
                    "manifest: skill {:?} needs an id, texts of at most {DESCRIPTION_CHARS_MAX} characters and at \
                     most {SKILLS_MAX} tags and examples",
                    skill.id
                ));
            }
        }
        if let Some(schema) = &m.config_schema {
            let object = schema.get("type").is_none_or(|t| t == "object");
            if !object || serde_json::Value::Object(schema.clone()).to_string().len() > CONFIG_SCHEMA_BYTES_MAX {
                return Err(format!(
                    "manifest: config_schema must be a JSON Schema of an object (type \"object\"), at most \
                     {CONFIG_SCHEMA_BYTES_MAX} bytes"
                ));
            }
        }
        if let Some(t) = m.tools.iter().find(|t| t.starts_with(crate::tools::AGENT_TOOL_PREFIX)) {
            if t.len() == crate::tools::AGENT_TOOL_PREFIX.len() {
                return Err(format!("manifest: {t:?} names no agent: grant \"agent:<plugin>\""));
            }
            if !m.resumable() {
                return Err(format!(
                    "manifest: {t:?} (a sub-agent) needs \"durability\": \"resume\" (a run awaiting its \
                     children waits with nothing held and is resumed by replay)"
                ));
            }
        }
        if m.approval.values().any(|a| *a == Approval::Always) && !m.resumable() {
            return Err(
                "manifest: approval needs \"durability\": \"resume\" (a waiting run is resumed by replay)".into()
            );
        }
        Ok(m)
    }

    /// Whether the manifest says calls of `tool` wait for approval.
    pub fn needs_approval(&self, tool: &str) -> bool {
        self.approval.get(tool) == Some(&Approval::Always)
    }

    /// Whether runs of this plugin are recorded and resumed.
    pub fn resumable(&self) -> bool {
        self.durability == Durability::Resume
    }

    /// Whether the manifest grants any sub-agent (`agent:<plugin>`): its
    /// agent may then await the children it starts (`await-agents`).
    pub fn grants_agents(&self) -> bool {
        self.tools.iter().any(|t| t.starts_with(crate::tools::AGENT_TOOL_PREFIX))
    }

    /// Whether `call-tool` may reach `tool`: named, or one of an MCP
    /// server's tools granted as `<server>.*`, or `await-agents` with any
    /// sub-agent granted.
    pub fn grants(&self, tool: &str) -> bool {
        if tool == crate::tools::AWAIT_AGENTS {
            return self.grants_agents();
        }
        self.tools.iter().any(|t| match t.strip_suffix(".*") {
            Some(server) => tool.split_once('.').is_some_and(|(s, rest)| s == server && !rest.is_empty()),
            None => t == tool,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn limits_have_ceilings() {
        assert!(Manifest::parse(&json!({})).is_ok());
        let e = Manifest::parse(&json!({ "limits": { "cpu_ms": CPU_MS_CEILING + 1 } })).unwrap_err();
        assert_eq!(e, format!("manifest: limits.cpu_ms must be 1 to {CPU_MS_CEILING}, not {}", CPU_MS_CEILING + 1));
        let e = Manifest::parse(&json!({ "limits": { "events_max": 0 } })).unwrap_err();
        assert!(e.contains("limits.events_max must be 1 to"), "{e}");
        let e = Manifest::parse(&json!({ "limits": { "memory_bytes": 2u64 << 30 } })).unwrap_err();
        assert!(e.contains("memory_bytes"), "{e}");
        let many: Vec<String> = (0..=TOOLS_MAX).map(|i| format!("t{i}")).collect();
        assert!(Manifest::parse(&json!({ "tools": many })).unwrap_err().contains("at most"));
        assert!(Manifest::parse(&json!({ "tools": [""] })).unwrap_err().contains("tool name"));
        assert!(Manifest::parse(&json!({ "durability": "resume" })).unwrap().resumable());
        let m = Manifest::parse(&json!({ "tools": ["docs.*", "py.echo", "llm"] })).unwrap();
        assert!(m.grants("docs.search") && m.grants("py.echo") && m.grants("llm"));
        assert!(!m.grants("py.slow") && !m.grants("docs.") && !m.grants("docs") && !m.grants("docsx.a"));
        assert!(!Manifest::parse(&json!({ "durability": "at-most-once" })).unwrap().resumable());
        assert!(!Manifest::parse(&json!({})).unwrap().resumable());
        let m = Manifest::parse(&json!({ "durability": "resume", "approval": { "send": "always", "look": "never" } }));
        let m = m.unwrap();
        assert!(m.needs_approval("send") && !m.needs_approval("look") && !m.needs_approval("other"));
        let e = Manifest::parse(&json!({ "approval": { "send": "always" } })).unwrap_err();
        assert!(e.contains("approval needs"), "{e}");
        let e = Manifest::parse(&json!({ "durability": "sometimes" })).unwrap_err();
        assert!(e.contains("expected `at-most-once` or `resume`"), "{e}");
    }

    #[test]
    fn a_config_schema_is_an_object_schema_of_bounded_size() {
        let schema = json!({ "type": "object", "properties": { "steps": { "type": "integer" } } });
        let m = Manifest::parse(&json!({ "config_schema": schema })).unwrap();
        assert_eq!(m.config_schema.map(serde_json::Value::Object), Some(schema));
        assert!(Manifest::parse(&json!({ "config_schema": {} })).is_ok());
        for bad in [
            json!({ "type": "string" }),
            json!("object"),
            json!({ "description": "x".repeat(CONFIG_SCHEMA_BYTES_MAX) }),
        ] {
            assert!(Manifest::parse(&json!({ "config_schema": bad })).is_err(), "{bad}");
        }
    }

    #[test]
    fn ceilings_name_the_limits_above_them() {
        let ceilings: Ceilings = [("wall_ms".to_string(), 60_000), ("memory_bytes".to_string(), 32 << 20)].into();
        assert!(Limits::check_ceilings(&ceilings).is_ok());
        let m = Manifest::parse(&json!({ "limits": { "wall_ms": 120_000, "cpu_ms": 1_000 } })).unwrap();
        assert_eq!(m.limits.above(&ceilings), ["memory_bytes 67108864 > 33554432", "wall_ms 120000 > 60000"]);
        let m = Manifest::parse(&json!({ "limits": { "wall_ms": 60_000, "memory_bytes": 16 << 20 } })).unwrap();
        assert!(m.limits.above(&ceilings).is_empty());
        let e = Limits::check_ceilings(&[("wall".to_string(), 1)].into()).unwrap_err();
        assert!(e.starts_with("no limit named \"wall\"; limits are memory_bytes, cpu_ms"), "{e}");
        let e = Limits::check_ceilings(&[("cpu_ms".to_string(), 0)].into()).unwrap_err();
        assert_eq!(e, format!("the ceiling of cpu_ms must be 1 to {CPU_MS_CEILING}, not 0"));
    }
}
