//! The book's shell steps, run as written against a real host (issue 39):
//! in the pages listed in [`PAGES`], a block fenced ```` ```sh doc-run ````
//! runs with `bash -euo pipefail`, and one fenced ```` ```<lang>
//! doc-file=PATH ```` is written to PATH first, in order, in one fresh
//! directory a page. `agent-host` and the repository's `scripts/` are on
//! PATH; AGENT_HOST_URL and AGENT_HOST_TOKEN name a host (a tenant admin's
//! token; the operator let tenants' plugins use every tool, and published
//! the example `chat` agent). A wrong command in the book fails this test.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::process::{HostProcess, FAST};
use crate::support::*;

/// The pages whose marked blocks run, and how many runnable blocks each must
/// have at least (so a page that lost its markers cannot pass by running nothing).
const PAGES: &[(&str, usize)] = &[
    ("getting-started.md", 1),
    ("guides/writing-a-plugin.md", 1),
    ("guides/python.md", 1),
    ("guides/javascript.md", 4),
    ("guides/rust.md", 5),
    ("guides/testing.md", 2),
    ("guides/a2a.md", 1),
    ("guides/mcp-server.md", 1),
];

/// One block a page's runner does.
#[derive(Debug)]
enum Step {
    File { path: String, text: String },
    Run { line: usize, script: String },
}

/// The marked blocks of a page, in order.
fn steps(page: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut lines = page.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        let Some(info) = line.trim_start().strip_prefix("```") else { continue };
        let mut body = String::new();
        for (_, l) in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                break;
            }
            body.push_str(l);
            body.push('\n');
        }
        let words: Vec<&str> = info.split_whitespace().collect();
        if let Some(path) = words.iter().find_map(|w| w.strip_prefix("doc-file=")) {
            steps.push(Step::File { path: path.to_string(), text: body });
        } else if words.contains(&"doc-run") {
            steps.push(Step::Run { line: n + 1, script: body });
        }
    }
    steps
}

/// The target directory the tests' Rust projects share.
pub fn rust_target() -> PathBuf {
    std::env::temp_dir().join("agent-host-test-rust-target")
}

#[test]
fn the_runner_reads_marked_blocks_only() {
    let page = "text\n```sh\nnot run\n```\n```python doc-file=a/app.py\nprint(1)\n```\n```sh doc-run\necho hi\n```\n";
    let s = steps(page);
    assert_eq!(s.len(), 2, "{s:?}");
    assert!(matches!(&s[0], Step::File { path, text } if path == "a/app.py" && text == "print(1)\n"));
    assert!(matches!(&s[1], Step::Run { line: 8, script } if script == "echo hi\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_shell_steps_run_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let db = TestDb::new().await;
    let host = HostProcess::spawn(&db.url, "docs", &[FAST, &["--tenant-tools", "all"]].concat());
    // The example `chat` agent, published, as `serve --demo` registers it.
    let chat = root.join("plugins/target/wasm32-wasip2/release/chat.wasm");
    let _ = plugin_wasm("chat");
    let manifest = std::env::temp_dir().join(format!("agent-host-docs-chat-{}.json", std::process::id()));
    std::fs::write(&manifest, r#"{"tools": ["llm"]}"#).unwrap();
    let added = std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["plugins", "add", "--database-url", &db.url, "chat"])
        .arg("--cache-dir")
        .arg(std::env::temp_dir().join(format!("agent-host-docs-cache-{}", std::process::id())))
        .arg(&chat)
        .arg("--manifest")
        .arg(&manifest)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&manifest);
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));
    let token = agent_host::db::tokens::create(&db.pool, "reader", "docs", true).await.unwrap();
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_agent-host")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}:{}", bin_dir.display(), root.join("scripts").display(), std::env::var("PATH").unwrap());

    for (page, runs_min) in PAGES {
        let text = std::fs::read_to_string(root.join("docs/src").join(page))
            .unwrap_or_else(|e| panic!("docs/src/{page}: {e}"));
        let steps = steps(&text);
        let runs = steps.iter().filter(|s| matches!(s, Step::Run { .. })).count();
        assert!(runs >= *runs_min, "docs/src/{page} has {runs} doc-run blocks, fewer than {runs_min}");
        let dir =
            std::env::temp_dir().join(format!("agent-host-docs-{}-{}", std::process::id(), page.replace('/', "-")));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for step in steps {
            match step {
                Step::File { path, text } => {
                    let file = dir.join(&path);
                    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
                    std::fs::write(&file, text).unwrap();
                }
                Step::Run { line, script } => {
                    let run = tokio::process::Command::new("bash")
                        .args(["-euo", "pipefail", "-c", &script])
                        .current_dir(&dir)
                        .env("PATH", &path)
                        .env("AGENT_HOST_URL", format!("http://{}", host.addr))
                        .env("AGENT_HOST_TOKEN", &token)
                        // Rust projects share one target directory (their dependencies built once).
                        .env("CARGO_TARGET_DIR", rust_target())
                        .kill_on_drop(true)
                        .output();
                    let out = tokio::time::timeout(Duration::from_secs(600), run)
                        .await
                        .unwrap_or_else(|_| panic!("docs/src/{page}:{line} did not finish in 10 minutes"))
                        .unwrap();
                    assert!(
                        out.status.success(),
                        "docs/src/{page}:{line} failed ({}):\n{script}\nstdout:\n{}\nstderr:\n{}\nhost log (tail):\n{}",
                        out.status,
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr),
                        host.log().lines().rev().take(30).collect::<Vec<_>>().join("\n")
                    );
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
