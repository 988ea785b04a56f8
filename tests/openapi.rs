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
/// inputs), as a tenant admin (so the admin routes answer, not only 403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_5xx_and_no_answer_outside_the_document() {
    let db = TestDb::new().await;
    let host = HostProcess::spawn(&db.url, "fuzz", FAST);
    let token = agent_host::db::tokens::create(&db.pool, "fuzzer", "fuzz", true).await.unwrap();
    let report = std::env::temp_dir().join(format!("agent-host-schemathesis-{}", std::process::id()));
    let run = tokio::process::Command::new(venv_bin("st"))
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
        .arg(&report)
        .env("SCHEMATHESIS_TELEMETRY", "false")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(FUZZ_TIMEOUT, run).await.expect("schemathesis within its time").unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "schemathesis found failures:\n{text}\n\nhost log:\n{}", host.log());
    // It exercised the API, not an empty document.
    assert!(text.contains("/v1/runs") && text.contains("/v1/responses"), "{text}");
    let _ = std::fs::remove_dir_all(&report);
}
