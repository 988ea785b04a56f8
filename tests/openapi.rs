//! `/openapi.json` against third-party tools from PyPI (installed by
//! scripts/test into the venv named by AGENT_HOST_TEST_VENV): the document
//! passes `openapi-spec-validator`, and `schemathesis` fuzzes every operation
//! of a live host with it (the native API and the Responses API): no answer
//! is a 5xx, and every answer's status, content type and body conform to
//! what the document declares.

use std::path::PathBuf;
use std::time::Duration;

use crate::support::process::{HostProcess, FAST};
use crate::support::*;

/// How long the fuzzer may take in all.
const FUZZ_TIMEOUT: Duration = Duration::from_secs(600);

fn venv_bin(name: &str) -> PathBuf {
    let venv = std::env::var("AGENT_HOST_TEST_VENV")
        .expect("AGENT_HOST_TEST_VENV is not set: run scripts/test, which installs tests/py/requirements.txt");
    PathBuf::from(venv).join("bin").join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_passes_a_third_party_validator() {
    let dir = std::env::temp_dir().join(format!("agent-host-openapi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("openapi.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&agent_host::api::openapi()).unwrap()).unwrap();
    let out = tokio::process::Command::new(venv_bin("openapi-spec-validator"))
        .args(["--schema", "3.1"])
        .arg(&file)
        .output()
        .await
        .expect("openapi-spec-validator runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openapi-spec-validator refused /openapi.json:\n{text}");
    assert!(text.contains("OK"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every operation every way schemathesis generates (valid and invalid
/// inputs), as a tenant admin (so the admin routes answer, not only 403):
/// once with the ids it makes up (mostly 404s), then with the ids of a real
/// run, conversation, schedule and response of the caller's, so the
/// operations on existing resources are fuzzed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_5xx_and_no_answer_outside_the_document() {
    let db = TestDb::new().await;
    let host = HostProcess::spawn(&db.url, "fuzz", FAST);
    let token = agent_host::db::tokens::create(&db.pool, "fuzzer", "fuzz", true).await.unwrap();
    let dir = std::env::temp_dir().join(format!("agent-host-schemathesis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    fuzz(&host, &token, &dir, None).await;

    // The caller's own resources: a completed run (its conversation) and a
    // response, and a schedule.
    let http = reqwest::Client::new();
    let base = format!("http://{}", host.addr);
    let post =
        |path: &str, body: serde_json::Value| http.post(format!("{base}{path}")).bearer_auth(&token).json(&body).send();
    let run: serde_json::Value = post("/v1/runs", serde_json::json!({ "plugin": "echo", "content": "hello" }))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let run_id: agent_host::db::RunId = run["run_id"].as_str().unwrap().parse().unwrap();
    wait_terminal(&db.pool, run_id, LONG).await;
    let response: serde_json::Value = post("/v1/responses", serde_json::json!({ "model": "echo", "input": "hi" }))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let schedule: serde_json::Value =
        post("/v1/schedules", serde_json::json!({ "plugin": "echo", "content": "tick", "cron": "0 0 1 1 *" }))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let ids = [
        ("runs", run["run_id"].as_str().unwrap().to_string()),
        ("conversations", run["conversation_id"].as_str().unwrap().to_string()),
        ("responses", response["id"].as_str().unwrap_or_else(|| panic!("{response}")).to_string()),
        ("schedules", schedule["id"].as_str().unwrap_or_else(|| panic!("{schedule}")).to_string()),
    ];
    let config: String = ids
        .iter()
        .map(|(path, id)| {
            format!("[[operations]]\ninclude-path-regex = \"^/v1/{path}/\\\\{{id\\\\}}\"\nparameters = {{ \"path.id\" = \"{id}\" }}\n\n")
        })
        .collect();
    let file = dir.join("schemathesis.toml");
    std::fs::write(&file, config).unwrap();
    fuzz(&host, &token, &dir, Some(&file)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// One schemathesis run against `host`, with `config` when given.
async fn fuzz(host: &HostProcess, token: &str, dir: &std::path::Path, config: Option<&std::path::Path>) {
    let mut st = tokio::process::Command::new(venv_bin("st"));
    if let Some(config) = config {
        st.arg("--config-file").arg(config);
    }
    let run = st
        .arg("run")
        .arg(format!("http://{}/openapi.json", host.addr))
        .args(["--header", &format!("Authorization: Bearer {token}")])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        ])
        .args(["--max-examples", "25", "--seed", "1", "--workers", "1", "--no-color"])
        .args(["--request-timeout", "20", "--generation-database", "none"])
        .arg("--report-dir")
        .arg(dir.join("report"))
        .env("SCHEMATHESIS_TELEMETRY", "false")
        // Its example cache goes to its working directory: the scratch one.
        .current_dir(dir)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(FUZZ_TIMEOUT, run).await.expect("schemathesis within its time").unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "schemathesis found failures:\n{text}\n\nhost log:\n{}", host.log());
    // It exercised the API, not an empty document.
    assert!(text.contains("Tested: 4"), "{text}");
}
