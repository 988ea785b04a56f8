//! `agent-host test [DIR]`: a plugin project's scripted turns, run against
//! its real component on a real host (a private, throwaway PostgreSQL
//! cluster, the sandbox, a worker) with the model and the tools scripted.
//!
//! The script is `DIR/agent-test.json` (`--file`): the tools the host has
//! (each one answers from the script and records how it was called), and
//! cases, each a conversation of turns. A turn gives the user's input, the
//! model's answers in order (text, or calls of the tools it was offered,
//! named as the model sees them), each tool's answers in call order, and
//! what must come out: the tools the agent called (host names, with their
//! arguments), the names it offered the model, its final text and the run's
//! status. Every difference is reported; the exit status is 1 when any.
//!
//! The scripted model stands where the host's `llm` tool stands (the same
//! call, the same answer shape, its text streamed into the run word by
//! word), so the agent runs exactly as it would on a host with a model: the
//! test sees what the agent does, not what a model happens to say.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::agent::{AgentRegistry, Components};
use crate::cluster::{self, Cluster, ClusterOptions};
use crate::db;
use crate::error::HostError;
use crate::hub::Hub;
use crate::tools::llm::{parse_args, Answer, AnswerCall, Usage};
use crate::tools::{EventSink, Tool, ToolCall, ToolRegistry, LLM_TOOL};
use crate::worker::{Worker, WorkerConfig};

/// The script's file name in a project.
pub const SCRIPT_FILE: &str = "agent-test.json";
/// Whose runs the test's are (a tenant of its own database).
const OWNER: &str = "test";
/// The model name scripted answers carry.
const SCRIPTED_MODEL: &str = "scripted";
/// Turns one script may hold, and model answers or tool calls one turn may script.
const TURNS_MAX: usize = 1_000;
const STEPS_MAX: usize = 1_000;

/// The script: the host's tools and the cases.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// A note for people (ignored).
    #[serde(rename = "$comment", default)]
    _comment: Option<Value>,
    /// The tools the host has, by the name a manifest grants (an MCP
    /// server's are `server.tool`): what `list-tools` says of each.
    #[serde(default)]
    tools: BTreeMap<String, ToolDecl>,
    /// Tools granted for the test on top of `manifest.json`'s (for a tool
    /// the shipped manifest leaves to the operator to grant).
    #[serde(default)]
    grant: Vec<String>,
    cases: Vec<Case>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolDecl {
    description: Option<String>,
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    turns: Vec<TurnScript>,
}

/// One turn: a run in the case's conversation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TurnScript {
    /// The user's message.
    input: String,
    /// The run's config (default `{}`).
    #[serde(default)]
    config: Option<Value>,
    /// The model's answers, one per call, in order.
    #[serde(default)]
    model: Vec<ModelAnswer>,
    /// Each tool's answers in call order; one answer (not a list) answers every call.
    #[serde(default)]
    tools: BTreeMap<String, Answers>,
    #[serde(default)]
    expect: Expect,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelAnswer {
    /// The text it answers (streamed into the run word by word).
    #[serde(default)]
    content: String,
    /// The calls it asks for, named as the model was offered them.
    #[serde(default)]
    tool_calls: Vec<ScriptedCall>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct ScriptedCall {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

fn empty_object() -> Value {
    json!({})
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Answers {
    Each(Vec<ToolAnswer>),
    Every(ToolAnswer),
}

/// What one call of a tool answers: a JSON value, a failure, or a stop
/// asked for while the call runs (the call never answers: the host cancels
/// it, as it cancels any call in flight when a stop comes).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolAnswer {
    #[serde(default)]
    answer: Option<Value>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    stop: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    /// The run's ending status (default `completed`).
    status: Option<String>,
    /// The turn's final text, exactly.
    text: Option<String>,
    /// The tool calls the agent made, in order (host names; a call without
    /// `arguments` matches any arguments).
    tool_calls: Option<Vec<ExpectedCall>>,
    /// The tool names the model was offered on its first call (sorted).
    offered: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpectedCall {
    name: String,
    arguments: Option<Value>,
}

impl Script {
    pub fn read(path: &Path) -> anyhow::Result<Script> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let script: Script =
            serde_json::from_str(&text).with_context(|| format!("{} is not a test script", path.display()))?;
        let turns: usize = script.cases.iter().map(|c| c.turns.len()).sum();
        if turns == 0 {
            bail!("{} has no turns", path.display());
        }
        if turns > TURNS_MAX {
            bail!("{} has {turns} turns; at most {TURNS_MAX}", path.display());
        }
        for case in &script.cases {
            for (i, turn) in case.turns.iter().enumerate() {
                let at = format!("{}: case {:?}, turn {}", path.display(), case.name, i + 1);
                if turn.model.len() > STEPS_MAX {
                    bail!("{at}: more than {STEPS_MAX} model answers");
                }
                for name in turn.tools.keys() {
                    if !script.tools.contains_key(name) {
                        bail!("{at}: answers of {name:?}, which the script's \"tools\" does not declare");
                    }
                }
                for answers in turn.tools.values() {
                    let list = match answers {
                        Answers::Each(list) => list.as_slice(),
                        Answers::Every(one) => std::slice::from_ref(one),
                    };
                    for a in list {
                        let set = [a.answer.is_some(), a.error.is_some(), a.stop].iter().filter(|s| **s).count();
                        if set != 1 {
                            bail!("{at}: a tool answer is one of {{\"answer\": ...}}, {{\"error\": \"...\"}}, {{\"stop\": true}}");
                        }
                    }
                }
            }
        }
        Ok(script)
    }
}

/// What the scripted tools saw during the turn being run.
#[derive(Default)]
struct Seen {
    model: VecDeque<ModelAnswer>,
    model_calls: usize,
    model_scripted: usize,
    offered: Option<Vec<String>>,
    answers: BTreeMap<String, Answers>,
    answered: BTreeMap<String, usize>,
    calls: Vec<ScriptedCall>,
    /// What went wrong inside a call (an unscripted call, a bad argument).
    problems: Vec<String>,
}

type Shared = Arc<Mutex<Seen>>;

/// The `llm` tool, answering from the script.
struct ScriptedModel(Shared);

#[async_trait]
impl Tool for ScriptedModel {
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let args = parse_args(&call.args)?;
        let next = {
            let mut seen = self.0.lock().expect("the script's state");
            seen.model_calls += 1;
            if seen.offered.is_none() {
                let mut names: Vec<String> = args.tools.iter().map(|t| t.name.clone()).collect();
                names.sort();
                seen.offered = Some(names);
            }
            let next = seen.model.pop_front();
            if next.is_none() {
                let n = seen.model_calls;
                let scripted = seen.model_scripted;
                seen.problems.push(format!("the agent called the model {n} times; the script has {scripted} answers"));
            }
            next
        };
        let Some(answer) = next else {
            return Err(HostError::ToolFailed("the test script has no more model answers for this turn".into()));
        };
        for word in answer.content.split_inclusive(' ') {
            sink.delta(word).await?;
        }
        let earlier = args.messages.iter().map(|m| m.tool_calls.len()).sum::<usize>();
        let tool_calls: Vec<AnswerCall> = answer
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| AnswerCall {
                id: format!("call_{}", earlier + i + 1),
                name: c.name.clone(),
                arguments: c.arguments.to_string(),
            })
            .collect();
        let finish_reason = if tool_calls.is_empty() { "stop" } else { "tool_calls" };
        Ok(Answer {
            content: answer.content,
            tool_calls,
            finish_reason: finish_reason.into(),
            usage: Some(Usage::new(0, 0)),
            model: SCRIPTED_MODEL.into(),
        }
        .into_json())
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(60)
    }

    fn idempotent(&self) -> bool {
        true
    }
}

/// A tool of the script: records each call and answers from the script.
struct ScriptedTool {
    name: String,
    decl: (Option<String>, Value),
    seen: Shared,
    pool: PgPool,
}

#[async_trait]
impl Tool for ScriptedTool {
    async fn call(&self, call: &ToolCall<'_>, _sink: &dyn EventSink) -> Result<Value, HostError> {
        let answer = {
            let mut seen = self.seen.lock().expect("the script's state");
            seen.calls.push(ScriptedCall { name: self.name.clone(), arguments: call.args.clone() });
            let n = *seen.answered.entry(self.name.clone()).and_modify(|n| *n += 1).or_insert(1);
            let answer = match seen.answers.get(&self.name) {
                Some(Answers::Every(one)) => Some(one.clone()),
                Some(Answers::Each(list)) => list.get(n - 1).cloned(),
                None => None,
            };
            if answer.is_none() {
                seen.problems.push(format!("{} was called {n} times; the script answers fewer", self.name));
            }
            answer.ok_or(n)
        };
        let answer = answer.map_err(|n| {
            HostError::ToolFailed(format!("the test script has no answer for call {n} of {}", self.name))
        })?;
        if answer.stop {
            // The stop a person would ask for while the call runs; the host
            // cancels the call (this future is dropped) and tells the agent.
            db::lifecycle::cancel(&self.pool, call.run_id, OWNER)
                .await
                .map_err(|e| HostError::ToolFailed(format!("asking for the stop: {e}")))?;
            return std::future::pending().await;
        }
        match (answer.answer, answer.error) {
            (_, Some(error)) => Err(HostError::ToolFailed(error)),
            (Some(value), None) => Ok(value),
            (None, None) => unreachable!("checked when the script was read"),
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(60)
    }

    fn describe(&self) -> (Option<String>, Value) {
        self.decl.clone()
    }
}

/// Options of a test run.
pub struct Options<'a> {
    pub dir: &'a Path,
    pub file: Option<&'a Path>,
    /// A database of the test's own (its worker runs whatever is queued
    /// there); `None`: a private cluster, removed after.
    pub database_url: Option<&'a str>,
    /// How long one turn may take.
    pub turn_timeout: Duration,
}

/// Runs the script; `Ok(true)` when every turn came out as expected.
pub async fn run(opts: Options<'_>) -> anyhow::Result<bool> {
    let dir = std::path::absolute(opts.dir)?;
    let file = opts.file.map_or_else(|| dir.join(SCRIPT_FILE), Path::to_path_buf);
    let script = Script::read(&file)?;
    let name = dir.file_name().and_then(|n| n.to_str()).context("the project's directory has no name")?.to_string();
    let manifest_path = dir.join("manifest.json");
    let mut manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(&manifest_path).with_context(|| format!("reading {}", manifest_path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", manifest_path.display()))?;
    if !script.grant.is_empty() {
        let mut tools = manifest["tools"].as_array().cloned().unwrap_or_default();
        tools.extend(script.grant.iter().map(|g| json!(g)));
        manifest["tools"] = Value::Array(tools);
    }
    eprintln!("test: building {}", dir.display());
    let wasm = super::project::build(&dir, None)?;
    let bytes = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;

    let (url, mut cluster) = match opts.database_url {
        Some(url) => (url.to_string(), None),
        None => {
            let data = std::env::temp_dir().join(format!("agent-host-test-{}", uuid::Uuid::new_v4().simple()));
            let options = ClusterOptions { dir: data, ephemeral: true, remove_on_exit: true };
            let mut cluster = tokio::task::spawn_blocking(move || Cluster::start(&options))
                .await?
                .context("starting a private PostgreSQL cluster for the test")?;
            cluster.ensure_database(cluster::DATABASE).await?;
            (cluster.url(cluster::DATABASE), Some(cluster))
        }
    };
    let outcome = run_on(&script, &dir, &name, &manifest, bytes, &url, opts.turn_timeout).await;
    if let Some(c) = cluster.as_mut() {
        tokio::task::block_in_place(|| c.stop());
    }
    outcome
}

async fn run_on(
    script: &Script,
    dir: &Path,
    name: &str,
    manifest: &Value,
    bytes: Vec<u8>,
    url: &str,
    turn_timeout: Duration,
) -> anyhow::Result<bool> {
    let pool = crate::cli::serve::connect_and_migrate(url, 8).await?;
    let seen: Shared = Arc::default();
    let mut tools = ToolRegistry::default();
    tools.insert(LLM_TOOL, Arc::new(ScriptedModel(seen.clone())));
    for (tool, decl) in &script.tools {
        let schema = decl.input_schema.clone().unwrap_or_else(|| json!({ "type": "object" }));
        tools.insert(
            tool,
            Arc::new(ScriptedTool {
                name: tool.clone(),
                decl: (decl.description.clone(), schema),
                seen: seen.clone(),
                pool: pool.clone(),
            }),
        );
    }
    let cache: PathBuf = dir.join("target").join("agent-host-cache");
    let sandbox: Arc<dyn Components> =
        crate::sandbox::Sandbox::for_process(pool.clone(), &cache, None, crate::sandbox::pool_for_runs(16))?;
    let agents = AgentRegistry::default().with_sandbox(sandbox.clone()).with_tools(tools);
    let hub = Hub::start(url.to_string());
    let worker = Worker::start(pool.clone(), Some(hub), agents, WorkerConfig::default()).await?;
    let actor = db::audit::Actor::cli();
    let row = crate::service::plugins::register(&pool, &sandbox, &actor, None, name, bytes, manifest).await?;
    println!("test: {name} ({}), {} case(s)", row.digest, script.cases.len());

    let mut failed = 0;
    let mut passed = 0;
    for case in &script.cases {
        let mut conversation = None;
        for (i, turn) in case.turns.iter().enumerate() {
            let label = format!("{} (turn {})", case.name, i + 1);
            let result = one_turn(&pool, &seen, &row, conversation, turn, turn_timeout).await;
            match result {
                Ok((conv, problems)) => {
                    conversation = Some(conv);
                    if problems.is_empty() {
                        passed += 1;
                        println!("ok    {label}");
                    } else {
                        failed += 1;
                        println!("FAIL  {label}");
                        for p in problems {
                            println!("      {p}");
                        }
                    }
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL  {label}\n      {e:#}");
                    break;
                }
            }
        }
    }
    println!("test: {passed} passed, {failed} failed");
    worker.drain().await;
    pool.close().await;
    Ok(failed == 0)
}

/// Runs one turn and compares; the conversation and the differences.
async fn one_turn(
    pool: &PgPool,
    seen: &Shared,
    row: &db::plugins::PluginRow,
    conversation: Option<db::ConversationId>,
    turn: &TurnScript,
    turn_timeout: Duration,
) -> anyhow::Result<(db::ConversationId, Vec<String>)> {
    {
        let mut s = seen.lock().expect("the script's state");
        *s = Seen {
            model: turn.model.iter().cloned().collect(),
            model_scripted: turn.model.len(),
            answers: turn.tools.clone(),
            ..Seen::default()
        };
    }
    let owner = db::enqueue::Owner { user_id: OWNER.into(), tenant_id: OWNER.into() };
    let config = turn.config.clone().unwrap_or_else(|| json!({}));
    let request = json!({ "content": turn.input, "plugin": row.name, "config": config });
    let run = db::enqueue::enqueue(
        pool,
        &db::enqueue::NewRun {
            owner: &owner,
            conversation_id: conversation,
            content: &turn.input,
            plugin: &row.name,
            plugin_digest: Some(&row.digest),
            plugin_manifest: Some(&row.manifest),
            config: &config,
            request: &request,
            idempotency_key: None,
            webhook: None,
            parent: None,
        },
    )
    .await?;
    let deadline = tokio::time::Instant::now() + turn_timeout;
    let view = loop {
        match db::runs::get_run(pool, run.run_id, OWNER).await? {
            Some(v) if v.status.is_terminal() => break v,
            _ if tokio::time::Instant::now() >= deadline => {
                bail!("the run {} did not end within {} s", run.run_id, turn_timeout.as_secs())
            }
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    };
    let text = db::conversations::messages(pool, view.conversation_id, OWNER, None, 10_000)
        .await?
        .unwrap_or_default()
        .into_iter()
        .rev()
        .find(|m| m.role == "assistant" && m.run_id == Some(run.run_id))
        .map(|m| m.content)
        .unwrap_or_default();
    let s = seen.lock().expect("the script's state");
    let mut problems = s.problems.clone();
    let expected_status = turn.expect.status.as_deref().unwrap_or("completed");
    if view.status.as_str() != expected_status {
        let error = view.error.as_deref().map(|e| format!(" ({e})")).unwrap_or_default();
        problems.push(format!("status: expected {expected_status}, got {}{error}", view.status.as_str()));
    }
    if let Some(expected) = &turn.expect.text {
        if &text != expected {
            problems.push(format!("text: expected {expected:?}, got {text:?}"));
        }
    }
    if let Some(expected) = &turn.expect.tool_calls {
        let matches = expected.len() == s.calls.len()
            && expected
                .iter()
                .zip(&s.calls)
                .all(|(e, got)| e.name == got.name && e.arguments.as_ref().is_none_or(|a| a == &got.arguments));
        if !matches {
            let show = |calls: Vec<String>| if calls.is_empty() { "none".to_string() } else { calls.join(", ") };
            let want = show(
                expected
                    .iter()
                    .map(|e| match &e.arguments {
                        Some(a) => format!("{} {a}", e.name),
                        None => e.name.clone(),
                    })
                    .collect(),
            );
            let got = show(s.calls.iter().map(|c| format!("{} {}", c.name, c.arguments)).collect());
            problems.push(format!("tool calls: expected {want}; got {got}"));
        }
    }
    if let Some(expected) = &turn.expect.offered {
        let mut expected = expected.clone();
        expected.sort();
        let got = s.offered.clone().unwrap_or_default();
        if s.offered.is_none() {
            problems.push("offered: the agent never called the model".into());
        } else if expected != got {
            problems.push(format!("offered: expected {expected:?}, got {got:?}"));
        }
    }
    if !s.model.is_empty() && view.status.as_str() == "completed" {
        problems.push(format!(
            "the agent called the model {} times; the script has {} answers",
            s.model_calls, s.model_scripted
        ));
    }
    Ok((view.conversation_id, problems))
}
