//! The web console in a real headless Chromium, driven over WebDriver
//! (chromedriver): sign in, start a run, refresh mid-stream, restart the
//! serving host mid-stream, stop a run; the text shown equals the transcript.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use crate::support::process::{HostProcess, FAST};
use crate::support::*;
use agent_host::db::{tokens, RunId};
use serde_json::{json, Value};
use sqlx::PgPool;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A chromedriver process and one headless Chromium session on it.
struct Browser {
    driver: Child,
    http: reqwest::Client,
    session: String,
}

impl Browser {
    async fn start() -> Browser {
        let bin = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("chromedriver is missing: install Debian's chromium and chromium-driver (./scripts/test does)");
        let port = free_port();
        // A process group of its own: Chromium's processes go with it.
        let driver = Command::new(bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("starting chromedriver");
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        // The performance log holds the browser's network events: which
        // URLs the page requested.
        let caps = json!({ "capabilities": { "alwaysMatch": { "browserName": "chrome",
            "goog:loggingPrefs": { "performance": "ALL" },
            "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"] } } } });
        // Until chromedriver has bound its port, the post is refused.
        let session = std::sync::OnceLock::new();
        let answered = poll_until(LONG, || async {
            let Ok(res) = http.post(format!("{base}/session")).json(&caps).send().await else { return false };
            let v: Value = res.json().await.unwrap();
            let id = v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {v}"));
            session.set(format!("{base}/session/{id}")).is_ok()
        })
        .await;
        assert!(answered, "chromedriver did not answer");
        Browser { driver, http, session: session.into_inner().expect("the session it answered with") }
    }

    /// Ends the session: chromedriver quits its Chromium.
    async fn quit(&self) {
        let _ = self.http.delete(&self.session).send().await;
    }

    async fn command(&self, path: &str, body: Value) -> Value {
        let res = self.http.post(format!("{}{path}", self.session)).json(&body).send().await.unwrap();
        let v: Value = res.json().await.unwrap();
        assert!(v["value"].get("error").is_none(), "webdriver {path}: {v}");
        v["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.command("/url", json!({ "url": url })).await;
    }

    async fn refresh(&self) {
        self.command("/refresh", json!({})).await;
    }

    async fn run(&self, script: &str, args: Value) -> Value {
        self.command("/execute/sync", json!({ "script": script, "args": args })).await
    }

    /// Polls `script` until it returns true.
    async fn until(&self, what: &str, script: &str) {
        wait_for(&format!("the page to show {what}"), LONG, || async {
            self.run(script, json!([])).await == json!(true)
        })
        .await;
    }

    /// Every URL the page requested since the last call (Chromium's
    /// network log: `Network.requestWillBeSent`).
    async fn requested_urls(&self) -> Vec<String> {
        let entries = self.command("/se/log", json!({ "type": "performance" })).await;
        entries
            .as_array()
            .expect("a log")
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e["message"].as_str()?).ok())
            .filter(|m| m["message"]["method"] == "Network.requestWillBeSent")
            .filter_map(|m| m["message"]["params"]["request"]["url"].as_str().map(String::from))
            .collect()
    }

    async fn get(&self, path: &str) -> Value {
        let v: Value = self.http.get(format!("{}{path}", self.session)).send().await.unwrap().json().await.unwrap();
        assert!(v["value"].get("error").is_none(), "webdriver {path}: {v}");
        v["value"].clone()
    }

    /// The WebDriver id of the element `css` selects (its W3C reference key).
    async fn element(&self, css: &str) -> String {
        let v = self.command("/element", json!({ "using": "css selector", "value": css })).await;
        let id = v["element-6066-11e4-a52e-4f735466cecf"].as_str();
        id.unwrap_or_else(|| panic!("no element {css}: {v}")).to_string()
    }

    /// Whether a person sees the element (WebDriver's "is displayed": not
    /// hidden by CSS, with a size), and its box (x, y, width, height).
    async fn seen(&self, css: &str) -> (bool, [f64; 4]) {
        let id = self.element(css).await;
        let shown = self.get(&format!("/element/{id}/displayed")).await;
        let shown = shown.as_bool().unwrap_or_else(|| panic!("displayed: {shown}"));
        let r = self.get(&format!("/element/{id}/rect")).await;
        let f = |k: &str| r[k].as_f64().unwrap();
        (shown, [f("x"), f("y"), f("width"), f("height")])
    }

    async fn text(&self, id: &str) -> String {
        self.run("return document.getElementById(arguments[0]).textContent", json!([id])).await.as_str().unwrap().into()
    }
}

impl Drop for Browser {
    /// However the test ended, nothing of the browser outlives it.
    fn drop(&mut self) {
        let group = nix::unistd::Pid::from_raw(self.driver.id() as i32);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.driver.wait();
    }
}

async fn deltas_of(pool: &PgPool, run: RunId) -> String {
    deltas_text(&journal_payloads(pool, run).await)
}

async fn answer_of(pool: &PgPool, run: RunId) -> (String, String) {
    let answer: Option<(String, String)> =
        sqlx::query_as("SELECT content, status FROM message WHERE run_id = $1 AND role = 'assistant'")
            .bind(run)
            .fetch_optional(pool)
            .await
            .unwrap();
    match answer {
        Some(a) => a,
        None => {
            // Say what the run was, so a failure here can be understood.
            let row: (String, Option<String>, Option<String>) =
                sqlx::query_as("SELECT status, error, worker_id FROM agent_run WHERE id = $1")
                    .bind(run)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            panic!("run {run} has no assistant message: {row:?}; journal {:?}", journal_payloads(pool, run).await)
        }
    }
}

/// One browser test at a time: each drives Chromium and host processes.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_streams_survives_refresh_and_restart_and_stops() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = TestDb::new().await;
    let pool = &db.pool;
    let token = tokens::create(pool, "alice", "acme", false).await.unwrap();
    // The browser talks to `web` (serves only); `work` executes the runs, so
    // restarting `web` cuts the stream while the run goes on.
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let mut web_args = FAST.to_vec();
    web_args.extend(["--no-dispatch", "--listen", &listen, "--sse-keepalive-ms", "1000"]);
    let mut web = HostProcess::spawn(&db.url, "web", &web_args);
    let _work = HostProcess::spawn(&db.url, "work", FAST);
    let url = format!("http://127.0.0.1:{port}/");
    let browser = Browser::start().await;

    browser.goto(&url).await;
    browser
        .run(
            "document.getElementById('token').value = arguments[0]; document.getElementById('signin-button').click()",
            json!([token]),
        )
        .await;
    browser.until("the signed-in app", "return !document.getElementById('app').hidden").await;
    browser.until("the plugin list", "return document.getElementById('plugin').options.length > 0").await;

    let start = |content: &str, config: Value| {
        browser.run(
            "const [content, config] = arguments;
             document.getElementById('plugin').value = 'sleep';
             document.getElementById('message').value = content;
             document.getElementById('config').value = JSON.stringify(config);
             document.getElementById('send').click();",
            json!([content, config]),
        )
    };
    // A long run: refresh mid-stream, then restart the host mid-stream.
    start("count slowly", json!({ "steps": 40, "step_ms": 150 })).await;
    browser.until("streamed text", "return document.getElementById('output').textContent.length > 0").await;
    let run: RunId = browser.text("run-id").await.parse().unwrap();
    browser.refresh().await;
    browser
        .until("the run again after a refresh", "return document.getElementById('run-id').textContent.length > 0")
        .await;
    assert_eq!(browser.text("run-id").await, run.to_string(), "the refresh came back to the same run");
    browser
        .until("streaming resumed", "return document.getElementById('output').textContent.includes('step 3.')")
        .await;

    web.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = web.wait_exit(LONG).await;
    let before = browser.text("output").await;
    web = HostProcess::spawn(&db.url, "web", &web_args);
    browser
        .until(
            "the stream to resume after the restart",
            "return document.getElementById('run-status').textContent === 'completed'",
        )
        .await;
    let shown = browser.text("output").await;
    assert!(shown.starts_with(&before), "text shown before the restart was kept");
    assert_eq!(shown, deltas_of(pool, run).await, "no character lost or repeated");
    assert_eq!(answer_of(pool, run).await, (shown.clone(), "complete".to_string()), "the text shown is the transcript");
    browser
        .until(
            "the answer in the transcript pane",
            "return document.querySelectorAll('#transcript .msg.assistant').length === 1",
        )
        .await;
    let transcript = browser
        .run(
            "return [...document.querySelectorAll('#transcript .msg.assistant .content')].map(e => e.textContent)",
            json!([]),
        )
        .await;
    assert_eq!(transcript, json!([shown]), "the transcript pane shows the answer");

    // A second turn, stopped from the page.
    start("count forever", json!({ "steps": 10000, "step_ms": 50 })).await;
    browser
        .until(
            "the second run streaming",
            &format!(
                "return document.getElementById('run-id').textContent !== '{run}'
                    && document.getElementById('output').textContent.includes('step 2.')"
            ),
        )
        .await;
    let second: RunId = browser.text("run-id").await.parse().unwrap();
    assert_ne!(second, run);
    browser.run("document.getElementById('stop').click()", json!([])).await;
    browser.until("the stop", "return document.getElementById('run-status').textContent === 'cancelled'").await;
    let shown = browser.text("output").await;
    assert_eq!(answer_of(pool, second).await, (shown.clone(), "partial".to_string()), "the partial text is kept");
    assert_eq!(shown, deltas_of(pool, second).await);
    let progress = browser.text("progress").await;
    assert!(progress.contains("characters") && progress.contains("events"), "progress is visible: {progress}");
    let timeline = browser.text("timeline").await;
    assert!(timeline.contains("run_started") && timeline.contains("complete cancelled"), "{timeline}");

    // A run's detail from the transcript: the first turn replays in full.
    let first_text = deltas_of(pool, run).await;
    browser.run("document.querySelector('#transcript .msg.assistant').click()", json!([])).await;
    browser
        .until(
            "the first run's detail",
            &format!(
                "return document.getElementById('run-id').textContent === '{run}'
                    && document.getElementById('run-status').textContent === 'completed'
                    && document.getElementById('output').textContent.length === {}",
                first_text.encode_utf16().count()
            ),
        )
        .await;
    assert_eq!(browser.text("output").await, first_text);

    // No URL the page requested holds the token; the streams went on tickets.
    let urls = browser.requested_urls().await;
    let secret = &token[3..];
    assert!(urls.iter().all(|u| !u.contains(secret)), "a requested URL holds the token: {urls:?}");
    let streams: Vec<&String> = urls.iter().filter(|u| u.contains("/events")).collect();
    assert!(streams.len() >= 3 && streams.iter().all(|u| u.contains("ticket=st_")), "{streams:?}");
    assert!(urls.iter().any(|u| u.ends_with("/console.js")), "the script is a file of its own: {urls:?}");
    // The old way, a long-lived token in the stream's URL, is refused.
    let old = reqwest::get(format!("{url}v1/runs/{run}/events?access_token={token}")).await.unwrap();
    assert_eq!(old.status(), 401);
    browser.quit().await;
    drop(web);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_a_pending_approval_and_approve_resumes_the_run_on_the_page() {
    let _one = ONE_AT_A_TIME.lock().await;
    let manifest = json!({ "tools": ["llm", "send"], "durability": "resume", "approval": { "send": "always" } });
    let env = crate::support::durable::Env::with_manifest("chat", "chat", &manifest, true, &[]).await;
    let host = env.spawn("A");
    // A schedule, which the console lists.
    let schedule = json!({ "plugin": "echo", "content": "happy new year", "cron": "0 0 1 1 *" });
    let (_, created) = env.request(&host, reqwest::Method::POST, "/v1/schedules", Some(schedule)).await;
    let browser = signed_in(&host.addr, &env.token).await;
    browser
        .until("the plugin list", "return [...document.getElementById('plugin').options].some(o => o.value === 'chat')")
        .await;
    browser.until("the schedule", "return document.querySelectorAll('#schedules li').length === 1").await;
    let shown = browser.text("schedules").await;
    assert!(shown.contains("0 0 1 1 *") && shown.contains("echo") && shown.contains("next"), "{shown}: {created}");
    browser.run("document.querySelector('#schedules li button').click()", json!([])).await;
    browser
        .until("the schedule paused", "return document.getElementById('schedules').textContent.includes('paused')")
        .await;
    let config = json!({ "tools": [{ "name": "send", "description": "send it", "parameters": { "type": "object" } }] });
    browser
        .run(
            "document.getElementById('plugin').value = 'chat';
             document.getElementById('message').value = 'send the memo';
             document.getElementById('config').value = JSON.stringify(arguments[0]);
             document.getElementById('send').click();",
            json!([config]),
        )
        .await;
    browser.until("the pending approval", "return !document.getElementById('approval').hidden").await;
    assert_eq!(browser.text("run-status").await, "waiting");
    assert_eq!(browser.text("approval-tool").await, "send");
    let args: Value = serde_json::from_str(&browser.text("approval-args").await).unwrap();
    assert_eq!(args, json!({ "input": "send the memo" }), "the approver sees the arguments");
    let run: RunId = browser.text("run-id").await.parse().unwrap();
    assert!(env.receiver.args.lock().unwrap().is_empty(), "nothing sent before the approval");

    browser.run("document.getElementById('approve').click()", json!([])).await;
    browser
        .until("the run to finish", "return document.getElementById('run-status').textContent === 'completed'")
        .await;
    assert!(browser.run("return document.getElementById('approval').hidden", json!([])).await.as_bool().unwrap());
    let panel_hidden = browser.run("return document.getElementById('usage-panel').hidden", json!([])).await;
    assert_eq!(panel_hidden, json!(true), "the usage by user is an admin's");
    let shown = browser.text("output").await;
    assert_eq!(shown, deltas_of(&env.db.pool, run).await, "the text continued on the same page");
    assert!(shown.contains("Offline reply to: send the memo"), "{shown}");
    assert_eq!(env.receiver.args.lock().unwrap().len(), 1, "the approved call ran once");
    let timeline = browser.text("timeline").await;
    assert!(timeline.contains("approval_requested") && timeline.contains("approval_decided"), "{timeline}");
    browser.quit().await;
}

/// Issue 45: the run pane steers a running turn (the instruction reaches the
/// agent, whose offline model answers it) and forks an ended one into a new
/// conversation with another message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_steers_a_running_turn_and_forks_an_ended_one() {
    let _one = ONE_AT_A_TIME.lock().await;
    let manifest = json!({ "tools": ["llm"], "durability": "resume" });
    let wasm = example_wasm("chat-python");
    let env = crate::support::durable::Env::with_wasm("chat-python", &wasm, &manifest, true, &[]).await;
    let host = env.spawn("A");
    let browser = signed_in(&host.addr, &env.token).await;
    browser
        .until(
            "the plugin list",
            "return [...document.getElementById('plugin').options].some(o => o.value === 'chat-python')",
        )
        .await;
    // A turn that streams dots for a while before it asks its model.
    browser
        .run(
            "document.getElementById('plugin').value = 'chat-python';
             document.getElementById('message').value = 'hello';
             document.getElementById('config').value = '{\"hold_ms\": 4000}';
             document.getElementById('send').click();",
            json!([]),
        )
        .await;
    browser.until("the run streaming", "return document.getElementById('output').textContent.includes('.')").await;
    browser
        .run(
            "document.getElementById('steer-text').value = 'say bonjour'; document.getElementById('steer').click()",
            json!([]),
        )
        .await;
    browser
        .until(
            "the instruction received",
            "return document.getElementById('timeline').textContent.includes('steer_received')",
        )
        .await;
    browser
        .until("the run to finish", "return document.getElementById('run-status').textContent === 'completed'")
        .await;
    let run: RunId = browser.text("run-id").await.parse().unwrap();
    let timeline = browser.text("timeline").await;
    assert!(timeline.contains("steer_taken"), "{timeline}");
    let (answer, _) = answer_of(&env.db.pool, run).await;
    assert!(answer.contains("say bonjour"), "the model was given the instruction: {answer}");
    assert!(browser.run("return document.getElementById('steer').disabled", json!([])).await.as_bool().unwrap());

    // Fork the ended turn with another message: a new conversation, its run watched.
    browser
        .run(
            "document.getElementById('fork-content').value = 'hello again'; document.getElementById('fork').click()",
            json!([]),
        )
        .await;
    let original = run.to_string();
    browser
        .until(
            "the fork's run",
            &format!("return document.getElementById('run-id').textContent !== '{original}' && document.getElementById('run-status').textContent === 'completed'"),
        )
        .await;
    let fork: RunId = browser.text("run-id").await.parse().unwrap();
    let forked_from: Option<RunId> = sqlx::query_scalar("SELECT forked_from FROM agent_run WHERE id = $1")
        .bind(fork)
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    assert_eq!(forked_from, Some(run));
    let (answer, _) = answer_of(&env.db.pool, fork).await;
    assert!(answer.contains("hello again"), "{answer}");
    browser.quit().await;
}

/// What a newcomer sees: after sign-in only the app (the sign-in form is
/// gone, not merely marked hidden), a plugin picker that names each plugin's
/// language, digest and granted tools, and a run pane whose timeline stays
/// in view while the page scrolls. An admin also sees the tenant's model
/// usage by user, and every conversation its own usage (issue 46).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_sign_in_a_person_sees_the_app_the_plugins_languages_and_a_run_pane_in_view() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = TestDb::new().await;
    let token = tokens::create(&db.pool, "alice", "acme", true).await.unwrap();
    // A day of a provider's reported usage, as the `llm` tool records it.
    sqlx::query(
        "INSERT INTO model_usage_day (tenant_id, user_id, day, provider, model, calls, prompt_tokens, completion_tokens)
         VALUES ('acme', 'bob', (now() AT TIME ZONE 'UTC')::date, 'openai', 'gpt-x', 3, 120, 45)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let python = example_wasm("chat-python");
    let manifest = json!({ "tools": ["llm"] });
    let digest = agent_host::db::plugins::put(&db.pool, "chat-python", &python, &manifest).await.unwrap().digest;
    agent_host::db::plugins::put(&db.pool, "chat", &plugin_wasm("chat"), &manifest).await.unwrap();
    let cache = std::env::temp_dir().join(format!("agent-host-console-{}", uuid::Uuid::new_v4().simple()));
    let cache_arg = cache.to_string_lossy().into_owned();
    let host = HostProcess::spawn(&db.url, "w", &[FAST, &["--cache-dir", &cache_arg]].concat());
    let browser = Browser::start().await;
    browser.command("/window/rect", json!({ "width": 1280, "height": 700 })).await;
    browser.goto(&format!("http://{}/", host.addr)).await;
    let (signin_seen, _) = browser.seen("#signin").await;
    assert!(signin_seen, "before sign-in, the form is on screen");
    browser
        .run(
            "document.getElementById('token').value = arguments[0]; document.getElementById('signin-button').click()",
            json!([token]),
        )
        .await;
    browser.until("the plugin list", "return document.getElementById('plugin').options.length > 1").await;
    let (signin_seen, signin_box) = browser.seen("#signin").await;
    assert!(!signin_seen, "after sign-in the form is gone from the screen ({signin_box:?})");
    assert_eq!(signin_box[2] * signin_box[3], 0.0, "the form takes no space: {signin_box:?}");
    let (app_seen, app_box) = browser.seen("#app").await;
    assert!(app_seen && app_box[1] < 80.0, "the app is right under the header: {app_box:?}");
    browser.until("the usage panel", "return !document.getElementById('usage-panel').hidden").await;
    let usage = browser.text("usage").await;
    assert!(usage.contains("bob · openai/gpt-x · 3 calls, 120+45 tokens"), "{usage}");

    // The picker: language, digest and granted tools of each plugin.
    let options: Vec<String> = serde_json::from_value(
        browser.run("return [...document.getElementById('plugin').options].map(o => o.textContent)", json!([])).await,
    )
    .unwrap();
    let python_option = options.iter().find(|o| o.starts_with("chat-python")).expect("chat-python is offered");
    assert!(python_option.contains("python"), "{python_option}");
    assert!(python_option.contains(&digest[7..19]), "{python_option}");
    assert!(python_option.contains("tools: llm"), "{python_option}");
    let rust_option = options.iter().find(|o| o.starts_with("chat ·")).expect("chat is offered");
    assert!(rust_option.contains("rust"), "{rust_option}");
    assert!(options.iter().any(|o| o == "echo · built-in"), "{options:?}");
    browser
        .run(
            "const s = document.getElementById('plugin'); s.value = 'chat-python'; s.dispatchEvent(new Event('change'))",
            json!([]),
        )
        .await;
    let (info_seen, _) = browser.seen("#plugin-info").await;
    let info = browser.text("plugin-info").await;
    assert!(info_seen && info.contains(&digest) && info.contains("Language: python"), "{info}");

    // A Python chat turn, watched in the run pane.
    browser
        .run(
            "document.getElementById('message').value = 'hello from the console';
             document.getElementById('send').click();",
            json!([]),
        )
        .await;
    browser
        .until("the run to finish", "return document.getElementById('run-status').textContent === 'completed'")
        .await;
    let shown = browser.text("output").await;
    assert!(shown.contains("hello from the console"), "{shown}");
    // The conversation's usage, as its API answer sums it.
    browser
        .until("the conversation's usage", "return document.getElementById('conversation-usage').textContent !== ''")
        .await;
    let line = browser.text("conversation-usage").await;
    assert!(line.starts_with("1 model call · "), "{line}");
    let (run_seen, _) = browser.seen("#run").await;
    let (timeline_seen, timeline_box) = browser.seen("#timeline").await;
    assert!(run_seen && timeline_seen && timeline_box[3] > 0.0, "the timeline is on screen: {timeline_box:?}");
    // A long conversation scrolls the page: the run pane stays in view.
    browser
        .run(
            "const t = document.getElementById('transcript');
             for (let i = 0; i < 60; i++) { const d = document.createElement('div'); d.className = 'msg';
               d.textContent = 'an earlier message ' + i; t.append(d); }
             window.scrollTo(0, document.body.scrollHeight);",
            json!([]),
        )
        .await;
    let scrolled = browser.run("return window.scrollY", json!([])).await.as_f64().unwrap();
    assert!(scrolled > 0.0, "the page scrolled");
    let viewport = browser.run("return window.innerHeight", json!([])).await.as_f64().unwrap();
    let in_view = browser
        .run(
            "const r = document.getElementById('timeline').getBoundingClientRect(); return [r.top, r.bottom]",
            json!([]),
        )
        .await;
    let (top, bottom) = (in_view[0].as_f64().unwrap(), in_view[1].as_f64().unwrap());
    assert!(
        top >= 0.0 && bottom <= viewport && bottom > top,
        "the timeline stays in view: {top}..{bottom} of {viewport}"
    );
    browser.quit().await;
    drop(host);
    let _ = std::fs::remove_dir_all(cache);
}

/// Issue 40: a link cannot steer the console. An id in the URL is taken
/// only when it is a UUID and every request path encodes it: a link whose
/// run id climbs to another route (`#r=../tokens/ID/revoke%3F`, which once
/// made a signed-in operator's console revoke that token) is set aside and
/// said on the page, and no request leaves for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_whose_id_is_a_path_cannot_steer_the_console() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = TestDb::new().await;
    let operator =
        tokens::NewToken { user_id: "root", tenant_id: "ops", admin: true, operator: true, ..Default::default() };
    let (_, operator) = tokens::create_with(&db.pool, &operator).await.unwrap();
    let victim = tokens::NewToken { user_id: "vic", tenant_id: "acme", ..Default::default() };
    let (victim, _) = tokens::create_with(&db.pool, &victim).await.unwrap();
    let host = HostProcess::spawn(&db.url, "w", FAST);
    let browser = Browser::start().await;
    browser.goto(&format!("http://{}/", host.addr)).await;
    browser
        .run(
            "document.getElementById('token').value = arguments[0]; document.getElementById('signin-button').click()",
            json!([operator]),
        )
        .await;
    browser.until("the plugin list", "return document.getElementById('plugin').options.length > 1").await;
    browser.requested_urls().await;

    browser.goto(&format!("http://{}/#r=../tokens/{}/revoke%3F", host.addr, victim.id)).await;
    browser.refresh().await;
    browser
        .until(
            "the link set aside",
            "return document.getElementById('run-error').textContent.includes('not a run or conversation id')",
        )
        .await;
    let urls = browser.requested_urls().await;
    assert!(!urls.iter().any(|u| u.contains("/tokens/")), "a request left for the link: {urls:?}");
    let revoked: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT revoked_at FROM api_token WHERE id = $1")
            .bind(victim.id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(revoked, None, "the link revoked a token");
    browser.quit().await;
    drop(host);
}

/// A browser on the console of the host at `addr`, signed in with `token`.
async fn signed_in(addr: &str, token: &str) -> Browser {
    let browser = Browser::start().await;
    browser.goto(&format!("http://{addr}/")).await;
    browser
        .run(
            "document.getElementById('token').value = arguments[0]; document.getElementById('signin-button').click()",
            json!([token]),
        )
        .await;
    browser
}
