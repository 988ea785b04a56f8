//! Configuration that would busy-loop or overcommit is refused at start, with
//! a message naming the flag: through the validate function for every such
//! flag, and through the real binary (exit status 2 and stderr) for a few,
//! before it opens any database.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::poll_until_blocking;
use agent_host::cli::args::{Cli, ConfigError};
use agent_host::sandbox::MAX_RUNS_MAX;
use clap::Parser;

fn parse(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("agent-host").chain(args.iter().copied())).expect("the flags parse")
}

fn refusal(args: &[&str]) -> ConfigError {
    match parse(args).validate() {
        Ok(()) => panic!("{args:?} was accepted"),
        Err(e) => e,
    }
}

#[test]
fn the_defaults_are_accepted() {
    parse(&["serve"]).validate().unwrap();
    parse(&["migrate"]).validate().unwrap();
}

#[test]
fn every_zero_that_would_spin_or_stall_is_refused_naming_its_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["serve", "--sse-keepalive-ms", "0"], "--sse-keepalive-ms"),
        (&["serve", "--db-pool-max", "0"], "--db-pool-max"),
        (&["migrate", "--db-pool-max", "0"], "--db-pool-max"),
        (&["serve", "--max-runs", "0"], "--max-runs"),
        (&["serve", "--lease-ms", "0"], "--lease-ms"),
        (&["serve", "--heartbeat-ms", "0"], "--heartbeat-ms"),
        (&["serve", "--reap-interval-ms", "0"], "--reap-interval-ms"),
        (&["serve", "--poll-tick-ms", "0"], "--poll-tick-ms"),
        (&["serve", "--journal-flush-ms", "0"], "--journal-flush-ms"),
        (&["serve", "--retention-interval-ms", "0"], "--retention-interval-ms"),
        (&["serve", "--tenant-max-running", "0"], "--tenant-max-running"),
        (&["serve", "--llm-timeout-ms", "0"], "--llm-timeout-ms"),
        (&["serve", "--llm-idle-timeout-ms", "0"], "--llm-idle-timeout-ms"),
    ];
    for (args, flag) in cases {
        let e = refusal(args);
        assert!(matches!(e, ConfigError::Zero { flag: f, .. } if f == *flag), "{args:?}: {e:?}");
        let message = e.to_string();
        assert!(message.starts_with(flag), "{args:?}: the message does not name {flag}: {message}");
    }
}

#[test]
fn max_runs_above_one_processs_most_slots_is_refused() {
    let at = MAX_RUNS_MAX.to_string();
    parse(&["serve", "--max-runs", &at]).validate().unwrap();
    let above = (MAX_RUNS_MAX + 1).to_string();
    let e = refusal(&["serve", "--max-runs", &above]);
    assert_eq!(e, ConfigError::MaxRunsAboveMax { max_runs: MAX_RUNS_MAX + 1, max: MAX_RUNS_MAX });
    let message = e.to_string();
    assert!(message.contains("--max-runs") && message.contains(&at), "{message}");
}

#[test]
fn a_heartbeat_not_below_the_lease_is_still_refused() {
    let e = refusal(&["serve", "--lease-ms", "1000", "--heartbeat-ms", "1000"]);
    assert_eq!(e, ConfigError::HeartbeatNotBelowLease { heartbeat_ms: 1000, lease_ms: 1000 });
    let message = e.to_string();
    assert!(message.contains("--heartbeat-ms") && message.contains("--lease-ms"), "{message}");
    parse(&["serve", "--lease-ms", "1000", "--heartbeat-ms", "999"]).validate().unwrap();
}

/// Runs the real binary with `args` (and `env`) against a database that
/// refuses connections, so that only a refusal made before opening the
/// database can name the flag. Returns (exit code, stderr).
fn run_binary(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_agent-host"));
    cmd.env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/refused").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut status = None;
    let exited = poll_until_blocking(Duration::from_secs(30), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
        panic!("agent-host {args:?} did not exit within 30 s");
    }
    let status = status.expect("the exit status it was seen with");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    (status.code(), stderr)
}

#[test]
fn the_binary_refuses_at_start_with_the_flag_in_its_message() {
    let over = (MAX_RUNS_MAX + 1).to_string();
    let cases: &[(&[&str], &[(&str, &str)], &str)] = &[
        (&["serve", "--sse-keepalive-ms", "0"], &[], "--sse-keepalive-ms"),
        (&["serve", "--db-pool-max", "0"], &[], "--db-pool-max"),
        (&["serve", "--max-runs", &over], &[], "--max-runs"),
        // The environment fallback is checked like the flag.
        (&["serve"], &[("AGENT_HOST_POLL_TICK_MS", "0")], "--poll-tick-ms"),
    ];
    for (args, env, flag) in cases {
        let (code, stderr) = run_binary(args, env);
        assert_eq!(code, Some(2), "{args:?} {env:?}: exit {code:?}, stderr:\n{stderr}");
        assert!(stderr.contains(flag), "{args:?} {env:?}: stderr does not name {flag}:\n{stderr}");
        assert!(!stderr.contains("connecting to PostgreSQL"), "{args:?}: refused only after opening the database");
    }
}

/// The front door and the book keep their links: every relative link in the
/// README, CONTRIBUTING, CHANGELOG and the book names a file of the
/// repository, and an anchor names a heading of that file; every page of the
/// book is in its SUMMARY.
#[test]
fn the_readme_and_the_book_link_only_to_what_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut pages: Vec<std::path::PathBuf> =
        ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"].iter().map(|p| root.join(p)).collect();
    let mut book = Vec::new();
    let mut dirs = vec![root.join("docs/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                book.push(path);
            }
        }
    }
    pages.extend(book.iter().cloned());
    let slug = |heading: &str| -> String {
        heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .collect::<String>()
            .replace(' ', "-")
    };
    let anchors = |path: &std::path::Path| -> Vec<String> {
        let text = std::fs::read_to_string(path).unwrap();
        let mut fenced = false;
        let mut out = Vec::new();
        for line in text.lines() {
            if line.starts_with("```") {
                fenced = !fenced;
            } else if !fenced && line.starts_with('#') {
                out.push(slug(line.trim_start_matches('#')));
            }
        }
        out
    };
    let link = regex_lite_links;
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for target in link(&text) {
            if target.starts_with("http://") || target.starts_with("https://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if file.is_empty() { page.clone() } else { page.parent().unwrap().join(file) };
            if !resolved.exists() {
                broken.push(format!("{}: {target} (no such file)", page.display()));
            } else if let Some(a) = anchor {
                if resolved.is_file() && !anchors(&resolved).iter().any(|h| h == a) {
                    broken.push(format!("{}: {target} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    let summary = std::fs::read_to_string(root.join("docs/src/SUMMARY.md")).unwrap();
    for page in &book {
        let rel = page.strip_prefix(root.join("docs/src")).unwrap().to_string_lossy().into_owned();
        if rel != "SUMMARY.md" {
            assert!(summary.contains(&format!("]({rel})")), "docs/src/{rel} is not in SUMMARY.md");
        }
    }
}

/// The targets of the markdown links `[text](target)` in `text`, outside
/// fenced code.
fn regex_lite_links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            match after.find(')') {
                Some(j) => {
                    let target = &after[..j];
                    if !target.contains(' ') && !target.contains('`') {
                        out.push(target.to_string());
                    }
                    rest = &after[j + 1..];
                }
                None => break,
            }
        }
    }
    out
}

/// `completions` prints a shell's completion script for every command.
#[test]
fn completions_print_a_script_for_the_shell() {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-host")).args(["completions", "bash"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(script.contains("_agent__host()") && script.contains("tenants"), "{}", &script[..script.len().min(400)]);
}

/// A reader that stops early (`agent-host runs list | head -1`, `... | grep -q`)
/// ends a client command quietly, by SIGPIPE as other Unix tools end, never
/// with a panic on "Broken pipe" (exit 101). The script is larger than a
/// pipe's buffer, so the writer meets the closed pipe whatever the timing.
#[test]
fn a_reader_that_stops_early_ends_a_client_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(["completions", "bash"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(nix::libc::SIGPIPE), "{:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "{stderr}");
}

/// Issue 39: the generated reference pages cannot go stale: the command
/// line from the clap definitions, the manifest and the tools file from JSON
/// Schemas derived from their Rust types; each committed file must be what
/// the code generates (`AGENT_HOST_BLESS=1` writes them again).
#[test]
fn the_generated_reference_pages_are_what_the_code_generates() {
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src");
    let mut stale = Vec::new();
    for (path, generated) in agent_host::cli::doc::generated_pages() {
        let file = docs.join(path);
        if std::env::var_os("AGENT_HOST_BLESS").is_some() {
            std::fs::write(&file, &generated).unwrap();
        }
        let undocumented: Vec<&str> =
            generated.lines().filter(|l| l.starts_with("| `") && (l.ends_with("|  |") || l.ends_with("| |"))).collect();
        assert!(undocumented.is_empty(), "{path}: entries without a doc comment:\n{}", undocumented.join("\n"));
        if std::fs::read_to_string(&file).unwrap_or_default() != generated {
            stale.push(path);
        }
    }
    assert!(
        stale.is_empty(),
        "docs/src/{stale:?} differ from what the code generates: run \
         `AGENT_HOST_BLESS=1 cargo test -p agent-host --test it config::` and commit them"
    );
}

/// Issue 39: the book builds with mdBook (installed by scripts/test, named
/// by AGENT_HOST_TEST_MDBOOK), and every page its SUMMARY names exists
/// (`create-missing = false`: a missing page fails the build).
#[test]
fn the_book_builds_with_mdbook() {
    let mdbook = std::env::var("AGENT_HOST_TEST_MDBOOK")
        .expect("AGENT_HOST_TEST_MDBOOK is not set: run scripts/test, which installs mdbook into a cache");
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let out = std::env::temp_dir().join(format!("agent-host-book-{}", std::process::id()));
    let built = Command::new(mdbook).arg("build").arg(&docs).arg("-d").arg(&out).output().unwrap();
    let said = String::from_utf8_lossy(&built.stderr);
    assert!(built.status.success(), "mdbook build failed:\n{said}");
    assert!(!said.contains("[WARN]") && !said.contains("[ERROR]"), "{said}");
    for page in ["index.html", "getting-started.html", "guides/python.html", "reference/routes.html"] {
        assert!(out.join(page).exists(), "the book has no {page}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
