//! The MCP server (issue 44), driven by the official clients against real
//! host processes: the `mcp` Python SDK (tests/mcp/client.py, in the venv
//! scripts/test caches for tests/mcp/requirements.txt) and the TypeScript
//! SDK, `@modelcontextprotocol/sdk` (tests/mcp/client.mjs, from the
//! node_modules scripts/test installs from tests/mcp/package-lock.json).
//! They list the agents as tools (input schemas from the manifests), call
//! one, call one with progress (the notifications carry the streamed text),
//! run a long call as a task and cancel it (its run ends cancelled), and
//! find a task from a new session on another process and read its result;
//! a task whose run waits for a person's approval is `input_required` until
//! the native API decides it. Another tenant sees neither the tenant's own agent nor its task. Every
//! call is a run the native API reads.

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};

use crate::support::durable::*;
use crate::support::*;

fn env_dir(var: &str, installs: &str) -> PathBuf {
    let dir =
        std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set: run scripts/test, which installs {installs}"));
    PathBuf::from(dir)
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/mcp").join(name)
}

/// Runs a client to its end; its last line, as JSON.
fn last_line(mut cmd: Command, what: &str) -> Value {
    let out = cmd.output().unwrap_or_else(|e| panic!("running {what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn python(args: &[&str]) -> Value {
    let venv = env_dir("AGENT_HOST_TEST_MCP_VENV", "tests/mcp/requirements.txt");
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.arg(script("client.py")).args(args);
    last_line(cmd, &format!("the Python MCP client {args:?}"))
}

fn node(args: &[&str]) -> Value {
    let modules = env_dir("AGENT_HOST_TEST_MCP_NODE_MODULES", "tests/mcp/package-lock.json");
    let mut cmd = Command::new("node");
    cmd.arg(script("client.mjs")).args(args).env("AGENT_HOST_TEST_MCP_NODE_MODULES", modules);
    last_line(cmd, &format!("the TypeScript MCP client {args:?}"))
}

/// The config schema the chat plugin's manifest declares.
fn chat_config() -> Value {
    json!({ "type": "object", "properties": { "tools": { "type": "array", "description": "function tools offered" } } })
}

/// The chat plugin (with a description and a config schema), the built-in
/// agents, and a plugin of the tenant's own.
async fn env() -> Env {
    let manifest = json!({
        "tools": ["llm", "send"],
        "durability": "resume",
        "approval": { "send": "always" },
        "description": "Chats, and sends what it is asked to once a person approves",
        "config_schema": chat_config(),
    });
    let env = Env::with_manifest("chat", "chat", &manifest, true, &[]).await;
    let actor = agent_host::db::audit::Actor::cli();
    let wasm = plugin_wasm("chat");
    agent_host::db::plugins::put_as(&env.db.pool, &actor, Some("acme"), "private", &wasm, &json!({})).await.unwrap();
    env
}

/// The streamed text the progress notifications carried, and whether their
/// progress values rose.
fn progress_text(notes: &Value) -> (String, bool) {
    let notes = notes.as_array().unwrap();
    let text = notes.iter().map(|n| n[1].as_str().unwrap()).collect();
    let values: Vec<f64> = notes.iter().map(|n| n[0].as_f64().unwrap()).collect();
    (text, values.windows(2).all(|w| w[0] < w[1]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_python_client_lists_calls_streams_and_runs_tasks_any_process_serves() {
    let env = env().await;
    let (a, b) = (env.spawn("A"), env.spawn("B"));
    let (url_a, url_b) = (format!("http://{}", a.addr), format!("http://{}", b.addr));
    let out = python(&["main", &url_a, &url_b, &env.token]);

    assert_eq!(out["protocol"], "2025-11-25", "{out}");
    assert_eq!(out["tasks_capability"], true, "{out}");
    // Every agent the token may run is a tool, with its manifest's schema.
    let tools = &out["tools"];
    for name in ["chat", "echo", "noop", "private", "sleep"] {
        let tool = &tools[name];
        assert_eq!(tool["properties"], json!(["config", "conversation_id", "prompt"]), "{name}: {out}");
        assert_eq!(tool["required"], json!(["prompt"]), "{name}");
        assert_eq!(tool["task_support"], "optional", "{name}");
    }
    assert_eq!(tools["chat"]["description"], "Chats, and sends what it is asked to once a person approves");
    assert_eq!(tools["chat"]["config"], chat_config());
    assert_eq!(tools["echo"]["config"]["type"], "object");

    // A call is a run: its answer is the run's final text.
    let call = &out["call"];
    assert_eq!((&call["text"], &call["error"]), (&json!("hello there"), &json!(false)), "{out}");
    let run = env.get(&a, &format!("/v1/runs/{}", call["run"]["run_id"].as_str().unwrap())).await;
    assert_eq!((&run["status"], &run["plugin"]), (&json!("completed"), &json!("echo")), "{run}");
    assert_eq!(run["conversation_id"], call["run"]["conversation_id"]);

    // Progress notifications carried the streamed text, in order.
    let expected = "step 0. step 1. step 2. step 3. ";
    assert_eq!(out["progress"]["text"], expected, "{out}");
    let (streamed, rising) = progress_text(&out["progress"]["notes"]);
    assert_eq!(streamed, expected, "{out}");
    assert!(rising, "{out}");

    assert_eq!(out["bad_arguments"]["error"], true, "{out}");
    assert!(out["bad_arguments"]["text"].as_str().unwrap().contains("prompt"), "{out}");
    assert_eq!(out["unknown_tool"], -32602, "{out}");
    assert_eq!(out["unknown_task"], -32602, "{out}");

    // A task cancelled: a durable stop; its run ended cancelled.
    let cancel = &out["cancel"];
    assert_eq!(cancel["first"], "working", "{out}");
    assert_eq!(cancel["listed"], true, "{out}");
    assert_eq!((&cancel["answer"], &cancel["after"]), (&json!("cancelled"), &json!("cancelled")), "{out}");
    assert_eq!(cancel["again"], -32602, "{out}");
    let run = env.get(&b, &format!("/v1/runs/{}", cancel["id"].as_str().unwrap())).await;
    assert_eq!(run["status"], "cancelled", "{run}");

    // A task started on A, found by a new session on B: its result.
    let created = &out["reconnect_created"];
    assert_eq!(created["status"], "working", "{out}");
    assert_eq!((&created["ttl"], &created["poll"]), (&Value::Null, &json!(500)), "{out}");
    let reconnect = &out["reconnect"];
    assert!(["working", "completed"].contains(&reconnect["found"].as_str().unwrap()), "{out}");
    assert_eq!(reconnect["text"], "step 0. step 1. step 2. ", "{out}");
    assert_eq!(reconnect["error"], false);
    assert_eq!(reconnect["related"], json!({ "taskId": created["id"] }), "{out}");
    assert_eq!(reconnect["after"], "completed");
    let run = env.get(&a, &format!("/v1/runs/{}", created["id"].as_str().unwrap())).await;
    assert_eq!(run["status"], "completed", "{run}");

    // Another tenant: neither the tenant's own agent nor its task.
    let other = agent_host::db::tokens::create(&env.db.pool, "mallory", "other", true).await.unwrap();
    let theirs = python(&["other", &url_b, &other, created["id"].as_str().unwrap()]);
    assert_eq!(theirs["tools"], json!(["chat", "echo", "noop", "sleep"]), "{theirs}");
    assert_eq!((&theirs["get"], &theirs["result"]), (&json!(-32602), &json!(-32602)), "{theirs}");
    assert_eq!(theirs["listed"], json!([]), "{theirs}");

    // No token: 401 with a challenge, before the body is read; no stream to GET.
    let http = reqwest::Client::new();
    let ping = json!({ "jsonrpc": "2.0", "id": 1, "method": "ping" });
    let res = http.post(format!("{url_a}/mcp")).json(&ping).send().await.unwrap();
    assert_eq!(res.status(), 401);
    assert_eq!(res.headers()["www-authenticate"], "Bearer");
    let res = http.get(format!("{url_a}/mcp")).bearer_auth(&env.token).send().await.unwrap();
    assert_eq!(res.status(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_run_waits_for_approval_is_input_required_and_ends_once_a_person_decides() {
    let env = env().await;
    let host = env.spawn("A");
    let out = python(&["approval", &format!("http://{}", host.addr), &env.token]);
    assert_eq!(out["waiting"], "input_required", "{out}");
    let note = out["note"].as_str().unwrap();
    assert!(note.contains("\"send\"") && note.contains("/approvals/"), "{out}");
    assert_eq!(out["decided"], 200, "{out}");
    assert_eq!((&out["after"], &out["error"]), (&json!("completed"), &json!(false)), "{out}");
    assert!(out["text"].as_str().unwrap().starts_with("Offline reply to: send the report Tool send said"), "{out}");
    // The approved call ran once.
    assert_eq!(env.receiver.args.lock().unwrap().len(), 1, "the approved call ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_typescript_client_lists_calls_with_progress_and_runs_tasks() {
    let env = env().await;
    let host = env.spawn("A");
    let out = node(&[&format!("http://{}", host.addr), &env.token]);

    assert_eq!(out["protocol"], "2025-11-25", "{out}");
    let tools = out["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t[0].as_str().unwrap()).collect();
    assert_eq!(names, ["chat", "echo", "noop", "private", "sleep"], "{out}");
    assert!(tools.iter().all(|t| t[1] == "optional" && t[2] == json!(["prompt"])), "{out}");

    let expected = "step 0. step 1. step 2. ";
    assert_eq!(out["progress"]["text"], expected, "{out}");
    let (streamed, rising) = progress_text(&out["progress"]["notes"]);
    assert_eq!(streamed, expected, "{out}");
    assert!(rising, "{out}");

    // The SDK's task stream: created, polled until completed, then its result.
    let events = out["task"]["events"].as_array().unwrap();
    assert_eq!(events.first().unwrap(), &json!(["created", "working"]), "{out}");
    assert_eq!(events.last().unwrap(), &json!(["status", "completed"]), "{out}");
    assert_eq!(out["task"]["text"], "step 0. step 1. ", "{out}");

    let cancel = &out["cancel"];
    assert_eq!(
        (&cancel["answer"], &cancel["after"], &cancel["listed"]),
        (&json!("cancelled"), &json!("cancelled"), &json!(true)),
        "{out}"
    );
    let run = env.get(&host, &format!("/v1/runs/{}", cancel["id"].as_str().unwrap())).await;
    assert_eq!(run["status"], "cancelled", "{run}");
}
