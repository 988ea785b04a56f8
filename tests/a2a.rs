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
//! the native API reads. Push notifications: configs made on a send and by
//! the config methods (read, listed, deleted, refused outside the
//! operator's allow-list), each told every state change of its task
//! through the webhook outbox, verified by the Standard Webhooks library
//! with the tenant's key and parsed as the protocol's `StreamResponse`.

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
    env_with(&[]).await
}

async fn env_with(extra: &[&str]) -> Env {
    let manifest = json!({
        "tools": ["llm", "send"],
        "durability": "resume",
        "approval": { "send": "always" },
        "description": "Chats, and sends what it is asked to once a person approves",
    });
    Env::with_manifest("chat", "chat", &manifest, true, extra).await
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
    // It ends completed: told by a status update, or already so in the
    // first snapshot when the run ended before the stream began.
    let last = stream.last().unwrap();
    assert!(last[0] == "status" || stream.len() == 1, "{out}");
    assert_eq!(last[1], "TASK_STATE_COMPLETED", "{out}");
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
    let hidden = json!({ "get": "TaskNotFoundError", "push_list": "TaskNotFoundError" });
    assert_eq!(scenario(&["other", &url, &other, id]), hidden);
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

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A push notification as the receiver got it.
#[derive(Debug, Clone, serde::Serialize)]
struct Pushed {
    route: String,
    headers: std::collections::BTreeMap<String, String>,
    body: String,
}

#[derive(Default)]
struct PushReceiver {
    got: std::sync::Mutex<Vec<Pushed>>,
    arrived: tokio::sync::Notify,
}

async fn pushed(
    axum::extract::State(r): axum::extract::State<std::sync::Arc<PushReceiver>>,
    axum::extract::Path(route): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
    body: String,
) -> axum::http::StatusCode {
    let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string())).collect();
    r.got.lock().unwrap().push(Pushed { route, headers, body });
    r.arrived.notify_waiters();
    axum::http::StatusCode::NO_CONTENT
}

impl PushReceiver {
    fn states(&self, route: &str) -> Vec<String> {
        let got = self.got.lock().unwrap();
        let states = got.iter().filter(|p| p.route == route);
        states
            .map(|p| serde_json::from_str::<Value>(&p.body).unwrap()["statusUpdate"]["status"]["state"].to_string())
            .collect()
    }

    /// Until `route` has been told `state`.
    async fn until(&self, route: &str, state: &str) {
        let wanted = format!("{state:?}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let arrived = self.arrived.notified();
            if self.states(route).contains(&wanted) {
                return;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            assert!(
                tokio::time::timeout(left, arrived).await.is_ok(),
                "{route} never told {state}: {:?}",
                self.states(route)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_notifications_tell_each_config_every_state_change_signed_through_the_outbox() {
    let receiver = std::sync::Arc::new(PushReceiver::default());
    let router = axum::Router::new().route("/push/{route}", axum::routing::post(pushed)).with_state(receiver.clone());
    let hook = format!("{}/push", serve(router).await);
    let flags = ["--completion-webhook-allow", &hook, "--webhook-secret", SECRET, "--webhook-poll-ms", "50"];
    let env = env_with(&flags).await;
    let host = env.spawn("A");
    let url = format!("http://{}", host.addr);
    let out = scenario(&["push", &url, &env.token, &hook]);

    assert_eq!(out["capability"], true, "{out}");
    let task = out["task"].as_str().unwrap();
    let created = json!({ "task": task, "id": "b", "url": format!("{hook}/b"), "token": "tok-b",
                          "scheme": "Bearer", "credentials": "" });
    assert_eq!(out["created"], created, "credentials are never read back: {out}");
    assert_eq!(out["got"], json!({ "id": "b", "url": format!("{hook}/b") }), "{out}");
    // The config made on the send is named by its message's id.
    let mut listed = vec![out["message_id"].as_str().unwrap(), "b"];
    listed.sort();
    assert_eq!(out["listed"], json!(listed), "{out}");
    assert_eq!(out["get_deleted"], "TaskNotFoundError", "{out}");
    assert_eq!(out["elsewhere"], "InvalidParamsError", "{out}");
    assert_eq!(out["unknown_task"], "TaskNotFoundError", "{out}");
    assert_eq!(out["final"], "TASK_STATE_COMPLETED", "{out}");
    assert_eq!(out["approval_first"], "TASK_STATE_INPUT_REQUIRED", "{out}");
    assert_eq!(out["approval_after"], "TASK_STATE_COMPLETED", "{out}");

    for route in ["a", "b", "c"] {
        receiver.until(route, "TASK_STATE_COMPLETED").await;
    }
    // Each config: told once per state, in order, ending with the end.
    let a = receiver.states("a");
    assert_eq!(a.last().unwrap(), "\"TASK_STATE_COMPLETED\"", "{a:?}");
    assert!(a.len() <= 3 && a.iter().collect::<std::collections::BTreeSet<_>>().len() == a.len(), "{a:?}");
    let c = receiver.states("c");
    let c_states: Vec<&str> = c.iter().map(|s| s.trim_matches('"')).collect();
    let input = c_states.iter().position(|s| *s == "TASK_STATE_INPUT_REQUIRED").expect("told INPUT_REQUIRED");
    assert_eq!(c_states.last(), Some(&"TASK_STATE_COMPLETED"), "{c_states:?}");
    assert!(input < c_states.len() - 1, "{c_states:?}");
    // The deleted config was told at most the state it was made in.
    assert!(receiver.states("gone").len() <= 1, "{:?}", receiver.states("gone"));

    // Headers: each config's token, and its credentials.
    let got = receiver.got.lock().unwrap().clone();
    for p in &got {
        let token = p.headers.get("x-a2a-notification-token").map(String::as_str);
        let expected = match p.route.as_str() {
            "a" => Some("tok-a"),
            "b" => Some("tok-b"),
            "c" => Some("tok-c"),
            _ => None,
        };
        assert_eq!(token, expected, "{p:?}");
        let authorization = p.headers.get("authorization").map(String::as_str);
        assert_eq!(authorization, (p.route == "b").then_some("Bearer cred-b"), "{p:?}");
    }
    // Verified with the tenant's key (as its admin reads it) by the
    // Standard Webhooks library, and parsed by the official SDK's types.
    let admin = agent_host::db::tokens::create(&env.db.pool, "ada", "acme", true).await.unwrap();
    let key: Value = reqwest::Client::new()
        .get(format!("{url}/v1/webhooks/signing-key"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let file = std::env::temp_dir().join(format!("a2a-push-{}.json", uuid::Uuid::new_v4().simple()));
    std::fs::write(&file, serde_json::to_vec(&got).unwrap()).unwrap();
    let verified = scenario(&["verify", key["key"].as_str().unwrap(), file.to_str().unwrap()]);
    std::fs::remove_file(&file).unwrap();
    let verified = verified.as_array().unwrap();
    assert_eq!(verified.len(), got.len());
    for v in verified {
        let expected_task = match v["route"].as_str().unwrap() {
            "c" => out["approval_task"].as_str().unwrap(),
            _ => task,
        };
        assert_eq!(v["task"], expected_task, "{v}");
    }
    // Times told in order per config.
    for route in ["a", "b", "c"] {
        let at: Vec<i64> = verified.iter().filter(|v| v["route"] == route).map(|v| v["at"].as_i64().unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "{route}: {at:?}");
    }
    // The run's own completion-webhook field is untouched by notifications.
    let run = env.get(&host, &format!("/v1/runs/{task}")).await;
    assert!(run["webhook"].is_null(), "{run}");

    // Another tenant sees neither the task nor its configs.
    let other = agent_host::db::tokens::create(&env.db.pool, "mallory", "other", true).await.unwrap();
    let hidden = json!({ "get": "TaskNotFoundError", "push_list": "TaskNotFoundError" });
    assert_eq!(scenario(&["other", &url, &other, task]), hidden);
}
