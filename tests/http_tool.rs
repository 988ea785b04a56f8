//! The allow-listed `http` tool and the tools file's secrets: an allowed
//! loopback destination answers `{status, headers, body}`; a disallowed
//! host, method or path, a name that resolves to a blocked range and a
//! redirect to a disallowed destination are `denied` with no connection to
//! it; a body past the cap is cut with a named reason. A secret named in the
//! tools file reaches its destination through a real host process and
//! appears nowhere else: not in the journal, the call log, the host's logs
//! or `/metrics`; a missing one stops the host at start, named.

#[allow(dead_code)]
use std::sync::{Arc, Mutex};

use crate::support::process::{HostProcess, FAST};
use crate::support::tools::{tools_file, Sink};
use crate::support::*;
use agent_host::db::{plugins, tokens, RunId};
use agent_host::error::HostError;
use agent_host::tools::{LlmConfig, ToolCall, ToolRegistry};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Json, Router};
use serde_json::{json, Value};

/// Every request a destination received: (path, headers).
type Seen = Arc<Mutex<Vec<(String, HeaderMap)>>>;

async fn destination(State(seen): State<Seen>, Path(path): Path<String>, headers: HeaderMap) -> Response {
    seen.lock().unwrap().push((path.clone(), headers.clone()));
    match path.as_str() {
        "v1/now" => ([("x-answer", "yes")], "sunny").into_response(),
        // A careless destination that echoes the credential it was sent.
        "v1/echo-key" => {
            let key = headers.get("x-weather-key").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
            Json(json!({ "you_sent": key })).into_response()
        }
        "v1/big" => {
            let chunks = (0..10).map(|_| Ok::<_, std::io::Error>("x".repeat(1000)));
            axum::body::Body::from_stream(futures::stream::iter(chunks)).into_response()
        }
        "v1/to-elsewhere" => {
            let to = headers.get("x-redirect-to").unwrap().to_str().unwrap().to_string();
            (StatusCode::FOUND, [("location", to)]).into_response()
        }
        "v1/to-same" => (StatusCode::SEE_OTHER, [("location", "/v1/now")]).into_response(),
        // Unavailable on its first two requests (of any method), then well.
        "v1/flaky" => {
            let hits = seen.lock().unwrap().iter().filter(|(p, _)| p == "v1/flaky").count();
            match hits {
                1 | 2 => (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "0")], "busy").into_response(),
                _ => "well".into_response(),
            }
        }
        _ => (StatusCode::NOT_FOUND, "no such path").into_response(),
    }
}

/// A destination on a fresh loopback port: its `host:port` and what it saw.
async fn start_destination() -> (String, Seen) {
    let seen = Seen::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let router = Router::new().route("/{*path}", any(destination)).with_state(seen.clone());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (addr, seen)
}

/// A registry from a tools file's text (with `env` for `${env:...}`).
fn registry(text: &str, env: &[(&str, &str)]) -> ToolRegistry {
    ToolRegistry::from_tools(&LlmConfig::default(), &tools_file(text, env)).unwrap()
}

async fn fetch(r: &ToolRegistry, args: Value) -> Result<Value, HostError> {
    let c = ToolCall {
        run_id: RunId::new(),
        call_index: 1,
        name: "http",
        args,
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    r.invoke(c, &Sink::default(), std::future::pending()).await.map(|a| serde_json::from_str(&a).unwrap())
}

fn denied(r: Result<Value, HostError>) -> String {
    match r {
        Err(HostError::Denied(m)) => m,
        other => panic!("not denied: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_what_a_rule_allows_is_called() {
    let (allowed, seen) = start_destination().await;
    let (elsewhere, seen_elsewhere) = start_destination().await;
    let port = allowed.rsplit_once(':').unwrap().1;
    let r = registry(
        &format!(
            "[[http]]\nurl = \"http://{allowed}\"\nmethods = [\"GET\", \"POST\"]\npaths = [\"/v1/*\"]\n\
             max_response_bytes = 4096\n\n\
             [[http]]\nurl = \"http://localhost:{port}\"\n"
        ),
        &[],
    );

    // Allowed: the answer as the destination gave it.
    let answer = fetch(&r, json!({ "method": "GET", "url": format!("http://{allowed}/v1/now") })).await.unwrap();
    assert_eq!(answer["status"], 200);
    assert_eq!(answer["body"], "sunny");
    assert_eq!(answer["headers"]["x-answer"], "yes");
    assert!(answer.get("truncated").is_none());
    // A redirect to the same destination is followed, as a GET.
    let answer = fetch(&r, json!({ "method": "POST", "url": format!("http://{allowed}/v1/to-same"), "body": "x" }));
    assert_eq!(answer.await.unwrap()["body"], "sunny");
    assert_eq!(seen.lock().unwrap().len(), 3);

    // A host, a method, a path no rule allows.
    let m = denied(fetch(&r, json!({ "method": "GET", "url": format!("http://{elsewhere}/v1/now") })).await);
    assert_eq!(m, format!("http: no rule allows GET http://{elsewhere}/v1/now"));
    let m = denied(fetch(&r, json!({ "method": "DELETE", "url": format!("http://{allowed}/v1/now") })).await);
    assert!(m.starts_with("http: no rule allows DELETE"), "{m}");
    let m = denied(fetch(&r, json!({ "method": "GET", "url": format!("http://{allowed}/admin") })).await);
    assert!(m.contains("/admin"), "{m}");
    // A name that resolves to loopback, which its rule does not name.
    let m = denied(fetch(&r, json!({ "method": "GET", "url": format!("http://localhost:{port}/v1/now") })).await);
    assert!(m.contains("localhost resolves to") && m.contains("a loopback address"), "{m}");
    // A redirect to a destination no rule allows: denied, never called.
    let to = format!("http://{elsewhere}/v1/now");
    let args = json!({ "method": "GET", "url": format!("http://{allowed}/v1/to-elsewhere"), "headers": { "x-redirect-to": to } });
    let m = denied(fetch(&r, args).await);
    assert_eq!(m, format!("http: no rule allows GET http://{elsewhere}/v1/now"));
    assert!(seen_elsewhere.lock().unwrap().is_empty(), "the disallowed destination was called");
    assert_eq!(seen.lock().unwrap().len(), 4, "only the redirecting call reached the allowed one");

    // A body past the cap is cut, and says why.
    let answer = fetch(&r, json!({ "method": "GET", "url": format!("http://{allowed}/v1/big") })).await.unwrap();
    assert_eq!(answer["body"].as_str().unwrap().len(), 4096);
    assert_eq!(answer["truncated"], "max_response_bytes: the body was cut at 4096 bytes");

    // Malformed calls.
    let e = fetch(&r, json!({ "url": "http://x/" })).await.unwrap_err();
    assert!(matches!(e, HostError::Invalid(ref m) if m.contains("method")), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_is_substituted_only_for_its_destination_and_never_shown() {
    let (bound, seen) = start_destination().await;
    let (other, seen_other) = start_destination().await;
    let r = registry(
        &format!(
            "[secrets]\nweather_key = \"${{env:AGENT_HOST_TEST_HTTP_KEY_A}}\"\n\n\
             [[http]]\nurl = \"http://{bound}\"\nsecrets = [\"weather_key\"]\n\n\
             [[http]]\nurl = \"http://{other}\"\n"
        ),
        &[("AGENT_HOST_TEST_HTTP_KEY_A", "wk-live-0451")],
    );
    let headers = json!({ "x-weather-key": "{{secret:weather_key}}" });
    let answer =
        fetch(&r, json!({ "method": "GET", "url": format!("http://{bound}/v1/echo-key"), "headers": headers }));
    let answer = answer.await.unwrap();
    // The destination got the value; the guest sees it cut out of the echo.
    assert_eq!(seen.lock().unwrap()[0].1["x-weather-key"], "wk-live-0451");
    assert_eq!(answer["body"], r#"{"you_sent":"<redacted>"}"#);
    assert!(!answer.to_string().contains("wk-live-0451"));
    // Not bound to the other destination: denied, and nothing sent there.
    let args = json!({ "method": "GET", "url": format!("http://{other}/v1/now"), "headers": headers });
    let m = denied(fetch(&r, args).await);
    assert_eq!(m, format!("http: secret \"weather_key\" is not bound to http://{other}"));
    assert!(seen_other.lock().unwrap().is_empty());
}

/// A chat-completions endpoint that asks, once, for the `http` call in
/// `args`, then answers in text.
async fn model_asking_for(args: Value, log: Arc<Mutex<Vec<Value>>>) -> String {
    let complete = move |Json(body): Json<Value>| {
        let args = args.clone();
        let log = log.clone();
        async move {
            log.lock().unwrap().push(body.clone());
            let has_result = body["messages"].as_array().unwrap().iter().any(|m| m["role"] == "tool");
            let frame = |c: Value| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(format!("data: {c}\n\n")));
            let mut frames = Vec::new();
            if has_result {
                let delta = json!({ "content": "fetched" });
                frames.push(frame(json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": null }] })));
                frames.push(frame(json!({ "choices": [{ "index": 0, "delta": {}, "finish_reason": "stop" }] })));
            } else {
                let call = json!({ "index": 0, "id": "call_1", "type": "function",
                                   "function": { "name": "http", "arguments": args.to_string() } });
                let delta = json!({ "tool_calls": [call] });
                frames.push(frame(json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": null }] })));
                frames.push(frame(json!({ "choices": [{ "index": 0, "delta": {}, "finish_reason": "tool_calls" }] })));
            }
            frames.push(Ok(bytes::Bytes::from("data: [DONE]\n\n")));
            ([("content-type", "text/event-stream")], axum::body::Body::from_stream(futures::stream::iter(frames)))
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let router = Router::new().route("/v1/chat/completions", axum::routing::post(complete));
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_reaches_its_destination_through_a_host_process_and_appears_nowhere_else() {
    const SECRET: &str = "wk-process-7f3a9c";
    // An MCP server's credential, in a header of its [[mcp]] entry.
    const MCP_SECRET: &str = "mcp-token-55e1d0b2c4";
    let db = TestDb::new().await;
    let mcp_server = crate::support::mcp_servers::McpServerProcess::python(None, None).await;
    let (dest, seen) = start_destination().await;
    let url = format!("http://{dest}/v1/echo-key");
    let model_log = Arc::new(Mutex::new(Vec::new()));
    let asked = json!({ "method": "GET", "url": url, "headers": { "x-weather-key": "{{secret:weather_key}}" } });
    let model = model_asking_for(asked, model_log.clone()).await;
    let dir = std::env::temp_dir().join(format!("agent-host-secret-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let tools_file = dir.join("tools.toml");
    std::fs::write(
        &tools_file,
        format!(
            "[secrets]\nweather_key = \"${{env:AGENT_HOST_TEST_WEATHER_KEY}}\"\n\n\
             [[http]]\nurl = \"http://{dest}\"\npaths = [\"/v1/*\"]\nsecrets = [\"weather_key\"]\n\n\
             [[mcp]]\nname = \"py\"\nurl = \"{}\"\n\
             headers = {{ Authorization = \"Bearer ${{env:AGENT_HOST_TEST_MCP_TOKEN}}\" }}\n",
            mcp_server.url()
        ),
    )
    .unwrap();
    let manifest = json!({ "tools": ["llm", "http", "py.*"], "durability": "resume" });
    plugins::put(&db.pool, "chat", &plugin_wasm("chat"), &manifest).await.unwrap();
    let token = tokens::create(&db.pool, "alice", "acme", false).await.unwrap();

    // Without the variable, the host does not start, and says which.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["serve", "--database-url", &db.url, "--listen", "127.0.0.1:0"])
        .args(["--tools-file", &tools_file.display().to_string()])
        .env_remove("AGENT_HOST_TEST_WEATHER_KEY")
        .env("AGENT_HOST_TEST_MCP_TOKEN", MCP_SECRET)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("environment variable AGENT_HOST_TEST_WEATHER_KEY is not set"), "{stderr}");

    // The host process is given both, and logs at debug level.
    let mut args: Vec<String> = FAST.iter().map(|s| s.to_string()).collect();
    args.extend(["--tools-file".into(), tools_file.display().to_string()]);
    args.extend(["--llm-base-url".into(), model]);
    args.extend(["--cache-dir".into(), dir.join("cache").display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env = [
        ("AGENT_HOST_TEST_WEATHER_KEY", SECRET),
        ("AGENT_HOST_TEST_MCP_TOKEN", MCP_SECRET),
        ("AGENT_HOST_LOG", "debug"),
        // A proxy that is not there: every client of the host (MCP, http,
        // the model) goes direct, so the run still completes.
        ("HTTP_PROXY", "http://127.0.0.1:9"),
        ("http_proxy", "http://127.0.0.1:9"),
        ("ALL_PROXY", "http://127.0.0.1:9"),
    ];
    let host = HostProcess::spawn_with_env(&db.url, "secret-w", &args, &env);

    let client = reqwest::Client::new();
    // `chat` offers what list-tools says is granted (`http`, described by the host).
    let body = json!({ "plugin": "chat", "content": "weather?", "config": { "tools": "granted" } });
    let res = client.post(format!("http://{}/v1/runs", host.addr)).bearer_auth(&token).json(&body).send().await;
    let v: Value = res.unwrap().json().await.unwrap();
    let run: RunId = v["run_id"].as_str().expect("a run id").parse().unwrap();
    let pool = &db.pool;
    wait_for("the run to end", LONG, || async move {
        ["completed", "failed", "cancelled"].contains(&status(pool, run).await.as_str())
    })
    .await;
    assert_eq!(status(pool, run).await, "completed", "{}", host.log());

    // It reached the destination.
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1["x-weather-key"], SECRET);

    // And nowhere else.
    let journal: Vec<String> = sqlx::query_scalar("SELECT payload::text FROM run_event WHERE run_id = $1")
        .bind(run)
        .fetch_all(pool)
        .await
        .unwrap();
    assert!(journal.iter().any(|p| p.contains("\"http\"")), "{journal:?}");
    assert!(!journal.iter().any(|p| p.contains(SECRET)), "journal: {journal:?}");
    let calls: Vec<String> =
        sqlx::query_scalar("SELECT concat_ws(' ', import, name, args_hash, result) FROM run_call WHERE run_id = $1")
            .bind(run)
            .fetch_all(pool)
            .await
            .unwrap();
    // The resumable run recorded what list-tools answered, and the model was
    // offered the http tool as the host describes it.
    assert!(calls.iter().any(|c| c.starts_with("list-tools") && c.contains("\"http\"")), "{calls:?}");
    let offered = model_log.lock().unwrap()[0]["tools"].clone();
    let http = offered.as_array().unwrap().iter().find(|t| t["function"]["name"] == "http").expect("http offered");
    assert_eq!(http["function"]["parameters"]["required"], json!(["method", "url"]), "{offered}");
    // So was the MCP server's echo: its listing went through its header.
    assert!(offered.as_array().unwrap().iter().any(|t| t["function"]["name"] == "py_echo"), "{offered}");
    // The recorded answer (replayed on a resume) holds the echo, cut out.
    assert!(calls.iter().any(|c| c.starts_with("call-tool http") && c.contains("<redacted>")), "{calls:?}");
    assert!(!calls.iter().any(|c| c.contains(SECRET)), "call log: {calls:?}");
    let messages: Vec<String> = sqlx::query_scalar("SELECT content FROM message").fetch_all(pool).await.unwrap();
    assert!(!messages.iter().any(|m| m.contains(SECRET)), "{messages:?}");
    let metrics = client.get(format!("http://{}/metrics", host.addr)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("agent_host_"), "{metrics}");
    assert!(!metrics.contains(SECRET));
    for secret in [SECRET, MCP_SECRET] {
        assert!(!journal.iter().any(|p| p.contains(secret)), "journal: {journal:?}");
        assert!(!calls.iter().any(|c| c.contains(secret)), "call log: {calls:?}");
        assert!(!metrics.contains(secret));
    }
    let log = host.log();
    // The log is the debug-level one, and holds the MCP connection made with
    // the credential, but neither secret.
    assert!(log.contains("DEBUG"), "not a debug-level log: {log}");
    assert!(log.contains("connected to an MCP server") && log.contains("py"), "host log: {log}");
    assert!(!log.contains(SECRET) && !log.contains(MCP_SECRET), "host log: {log}");
    drop(host);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 46: a rule's retry policy tries an idempotent request again after
/// a 503 (each attempt journaled as `tool_attempt`) and answers the one that
/// passed; a POST, whose outcome the destination may have acted on, is
/// answered its 503 at once; a destination that cannot be reached is tried
/// again whatever the method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_retry_policy_tries_idempotent_requests_again() {
    let (allowed, seen) = start_destination().await;
    let r = registry(
        &format!(
            "[[http]]\nurl = \"http://{allowed}\"\nmethods = [\"GET\", \"POST\"]\n\
             retry = {{ attempts = 3, backoff_ms = 1, backoff_max_ms = 5 }}\n"
        ),
        &[],
    );
    let flaky = format!("http://{allowed}/v1/flaky");
    let sink = Sink::default();
    let c = ToolCall {
        run_id: RunId::new(),
        call_index: 7,
        name: "http",
        args: json!({ "method": "GET", "url": flaky }),
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    let answer: Value = serde_json::from_str(&r.invoke(c, &sink, std::future::pending()).await.unwrap()).unwrap();
    assert_eq!((answer["status"].clone(), answer["body"].clone()), (json!(200), json!("well")));
    let attempts: Vec<Value> =
        sink.0.lock().unwrap().iter().filter(|(k, _)| k == "tool_attempt").map(|(_, p)| p.clone()).collect();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!((attempts[0]["attempt"].clone(), attempts[0]["status"].clone()), (json!(1), json!(503)));
    assert_eq!(attempts[1]["call_index"], 7);
    assert_eq!(seen.lock().unwrap().iter().filter(|(p, _)| p == "v1/flaky").count(), 3);

    // A POST is not sent twice: the 503 is its answer.
    seen.lock().unwrap().clear();
    let answer = fetch(&r, json!({ "method": "POST", "url": format!("http://{allowed}/v1/flaky"), "body": "x" })).await;
    assert_eq!(answer.unwrap()["status"], 503);
    assert_eq!(seen.lock().unwrap().len(), 1);

    // Nothing listening: each attempt fails to connect, each is journaled.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gone = closed.local_addr().unwrap();
    drop(closed);
    let r = registry(
        &format!("[[http]]\nurl = \"http://{gone}\"\nmethods = [\"POST\"]\nretry = {{ attempts = 2, backoff_ms = 1, backoff_max_ms = 2 }}\n"),
        &[],
    );
    let sink = Sink::default();
    let c = ToolCall {
        run_id: RunId::new(),
        call_index: 1,
        name: "http",
        args: json!({ "method": "POST", "url": format!("http://{gone}/x") }),
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    let e = r.invoke(c, &sink, std::future::pending()).await.unwrap_err();
    assert!(e.to_string().contains("could not be called"), "{e}");
    assert_eq!(sink.0.lock().unwrap().iter().filter(|(k, _)| k == "tool_attempt").count(), 1);
}
