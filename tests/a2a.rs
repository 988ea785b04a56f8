//! The A2A protocol (issue 44), driven by the official client (`a2a-sdk`
//! from PyPI, tests/a2a/client.py, in the venv scripts/test caches) against
//! real host processes: the agent card, a blocking send, a background send
//! polled to its end, a list paged by context, a streaming send, a cancel
//! (a durable stop; a second cancel is refused in the protocol's error), a
//! second message in a context, an unknown task; a task subscribed on one
//! process whose process is SIGKILLed mid-stream and rejoined on another,
//! with nothing lost or repeated; a task that needs a person's approval
//! (`INPUT_REQUIRED`) decided by the next message; and another tenant that
//! sees neither the task nor the tenant's own agent. Every task is a run
//! the native API reads.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{json, Value};

use crate::support::durable::*;
use crate::support::*;

fn python() -> PathBuf {
    let venv = std::env::var("AGENT_HOST_TEST_A2A_VENV")
        .expect("AGENT_HOST_TEST_A2A_VENV is not set: run scripts/test, which installs tests/a2a/requirements.txt");
    PathBuf::from(venv).join("bin/python")
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/a2a/client.py")
}

/// Runs a scenario to its end; its last line, as JSON.
fn scenario(args: &[&str]) -> Value {
    let out = Command::new(python()).arg(script()).args(args).output().expect("running the a2a client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "a2a client {args:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// The chat plugin (resumable) whose `send` tool needs approval, and the
/// built-in agents.
async fn env() -> Env {
    let manifest = json!({
        "tools": ["llm", "send"],
        "durability": "resume",
        "approval": { "send": "always" },
        "description": "Chats, and sends what it is asked to once a person approves",
    });
    Env::with_manifest("chat", "chat", &manifest, true, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_client_sends_streams_lists_cancels_and_reads_tasks_that_are_runs() {
    let env = env().await;
    let host = env.spawn("A");
    let url = format!("http://{}", host.addr);
    let out = scenario(&["main", &url, &env.token]);

    let card = &out["card"];
    assert_eq!(card["name"], "echo", "{out}");
    assert_eq!(card["url"], format!("{url}/a2a/echo"), "{out}");
    assert_eq!(card["binding"], "JSONRPC");
    assert_eq!(card["streaming"], true);
    assert_eq!(card["security"], json!(["bearer"]));

    let blocking = &out["blocking"];
    assert_eq!(blocking["state"], "TASK_STATE_COMPLETED", "{out}");
    assert_eq!(blocking["text"], "hello there");
    assert_eq!(blocking["history"], json!([["ROLE_USER", "hello there"], ["ROLE_AGENT", "hello there"]]));
    // The task is a run, and its context the run's conversation.
    let id = blocking["id"].as_str().unwrap();
    let run = env.get(&host, &format!("/v1/runs/{id}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["conversation_id"], blocking["context"]);
    assert_eq!(run["plugin"], "echo");

    assert_eq!(out["context"], json!({ "same": true, "new_task": true, "text": "and again" }), "{out}");
    assert_eq!(out["history_length_1"], json!(["ROLE_AGENT"]), "{out}");

    assert!(["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"].contains(&out["background_first"].as_str().unwrap()));
    assert_eq!(out["background"], json!({ "state": "TASK_STATE_COMPLETED", "text": "step 0. step 1. step 2. " }));
    // Two tasks in the context, one a page, newest first.
    let list = &out["list"];
    assert_eq!(list["page1"], json!([list["second"]]), "{out}");
    assert_eq!(list["page2"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(list["total"], 2);
    assert_eq!(list["last_token"], "");

    let stream = out["stream"].as_array().unwrap();
    assert_eq!(stream.first().unwrap()[0], "task", "{out}");
    // It ends completed: with a status update, or (a run that ended before
    // the stream's first frame) with the task itself, completed.
    let last = stream.last().unwrap();
    let ended =
        last == &json!(["status", "TASK_STATE_COMPLETED"]) || (stream.len() == 1 && last[1] == "TASK_STATE_COMPLETED");
    assert!(ended, "{out}");
    // The task as it stood (its text so far), then the rest as artifact updates.
    let mut streamed = stream[0][2].as_str().unwrap().to_string();
    streamed.extend(stream.iter().filter(|e| e[0] == "artifact").map(|e| e[1].as_str().unwrap()));
    assert_eq!(streamed, "a b c", "{out}");

    assert_eq!(out["cancel"]["state"], "TASK_STATE_CANCELED", "{out}");
    let cancelled = env.get(&host, &format!("/v1/runs/{}", out["cancel"]["id"].as_str().unwrap())).await;
    assert_eq!(cancelled["status"], "cancelled");
    assert_eq!(out["cancel_again"], "TaskNotCancelableError", "{out}");
    assert_eq!(out["unknown"], "TaskNotFoundError", "{out}");

    // Another tenant: the task is not found, the tenant's own agent is unknown.
    let other = agent_host::db::tokens::create(&env.db.pool, "mallory", "other", true).await.unwrap();
    assert_eq!(scenario(&["other", &url, &other, id]), json!({ "get": "TaskNotFoundError" }));
    let actor = agent_host::db::audit::Actor::cli();
    let wasm = plugin_wasm("chat");
    agent_host::db::plugins::put_as(&env.db.pool, &actor, Some("acme"), "private", &wasm, &json!({})).await.unwrap();
    let http = reqwest::Client::new();
    let card = |token: &str| {
        http.get(format!("{url}/a2a/private/.well-known/agent-card.json")).bearer_auth(token.to_string()).send()
    };
    assert_eq!(card(&env.token).await.unwrap().status(), 200);
    assert_eq!(card(&other).await.unwrap().status(), 404);
    // No token: 401 with a challenge, on the card and on the endpoint.
    let bare = http.post(format!("{url}/a2a/echo")).json(&json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask"}));
    let res = bare.send().await.unwrap();
    assert_eq!(res.status(), 401);
    assert_eq!(res.headers()["www-authenticate"], "Bearer");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_whose_process_is_killed_rejoins_on_another_with_nothing_lost_or_repeated() {
    let env = env().await;
    let (w, mut a, b) = (env.spawn("W"), env.spawn("A"), env.spawn("B"));
    let urls = [w.addr.clone(), a.addr.clone(), b.addr.clone()].map(|addr| format!("http://{addr}"));
    let mut child = Command::new(python())
        .arg(script())
        .args(["rejoin", &urls[0], &urls[1], &urls[2], &env.token])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.next().expect("the client's first line").unwrap();
    assert!(ready.starts_with("READY "), "{ready}");
    // The serving process dies mid-stream.
    a.signal(Signal::SIGKILL);
    a.wait_exit(Duration::from_secs(30)).await;
    let last = lines.map_while(Result::ok).last().expect("the client's report");
    assert!(child.wait().unwrap().success());
    let out: Value = serde_json::from_str(&last).unwrap();

    let text = out["text"].as_str().unwrap();
    let expected: String = (0..40).map(|i| format!("step {i}. ")).collect();
    assert_eq!(text, expected, "{out}");
    assert_eq!(out["final"], "TASK_STATE_COMPLETED", "{out}");
    assert!(out["a_error"].is_string(), "the first stream did not break: {out}");
    // What A delivered is the answer's beginning...
    let on_a: String = out["a"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| match e[0].as_str().unwrap() {
            "task" => e[1].as_str().unwrap().to_string(),
            _ => e[1].as_str().unwrap().to_string(),
        })
        .collect();
    assert!(expected.starts_with(&on_a) && !on_a.is_empty(), "{out}");
    // ...and B's snapshot, then its deltas, are the whole answer once: no gap, no repeat.
    let b_events = out["b"].as_array().unwrap();
    assert_eq!(b_events[0][0], "task", "{out}");
    let mut on_b = b_events[0][1].as_str().unwrap().to_string();
    assert!(on_b.len() >= on_a.len() || on_a.starts_with(&on_b), "{out}");
    for e in &b_events[1..] {
        assert_eq!(e[0], "delta", "{out}");
        on_b.push_str(e[1].as_str().unwrap());
    }
    assert_eq!(on_b, expected, "{out}");
    let run = env.get(&w, &format!("/v1/runs/{}", out["id"].as_str().unwrap())).await;
    assert_eq!(run["status"], "completed", "{run}");
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_needs_approval_is_input_required_and_the_next_message_decides_it() {
    let env = env().await;
    let host = env.spawn("A");
    let url = format!("http://{}", host.addr);
    let out = scenario(&["approval", &url, &env.token]);
    assert_eq!(out["first"], "TASK_STATE_INPUT_REQUIRED", "{out}");
    assert!(out["ask"].as_str().unwrap().contains("\"send\""), "{out}");
    assert_eq!(out["unclear"], "InvalidParamsError", "{out}");
    assert_eq!(out["after"], "TASK_STATE_COMPLETED", "{out}");
    assert!(out["text"].as_str().unwrap().starts_with("Offline reply to: send the report Tool send said"), "{out}");
    // The approved call ran once; the native API sees the decision.
    assert_eq!(env.receiver.args.lock().unwrap().len(), 1, "the approved call ran once");
    let run = env.get(&host, &format!("/v1/runs/{}", out["id"].as_str().unwrap())).await;
    assert_eq!(run["status"], "completed", "{run}");
}
