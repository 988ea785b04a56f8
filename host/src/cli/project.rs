//! A plugin project outside this repository: `agent-host new` writes one
//! from a template (`plugins/templates/<language>/`, inside the binary), and
//! `agent-host build` builds one wherever it is, through the same script the
//! examples and the tests build with (`scripts/build-plugin` of the checkout
//! this binary was built from, which pins and caches every toolchain).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// A template's language.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Python,
    Javascript,
    Typescript,
    Rust,
}

/// A template: (path in the project, text with `{{name}}` and
/// `{{manifest_schema}}` to fill in).
type Template = &'static [(&'static str, &'static str)];

macro_rules! template {
    ($lang:literal: $($file:literal),+ $(,)?) => {
        &[$(($file, include_str!(concat!("../../../plugins/templates/", $lang, "/", $file)))),+]
    };
}

const PYTHON: Template = template!("python": "app.py", "manifest.json", "pyproject.toml");
const JAVASCRIPT: Template = template!("javascript": "app.js", "manifest.json", "package.json");
const TYPESCRIPT: Template = template!("typescript": "app.ts", "manifest.json", "package.json", "tsconfig.json");
const RUST: Template = template!("rust": "src/lib.rs", "manifest.json", "Cargo.toml");

/// The scripted turns every template ships (`agent-host test`).
const TEST_SCRIPT: &str = include_str!("../../../plugins/templates/agent-test.json");

/// The checkout this binary was built from: its SDKs, WIT and build script.
fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `agent-host new NAME --lang L [--dir PARENT]`: the project in PARENT/NAME,
/// which must not exist or be empty. Returns its directory.
pub fn new(name: &str, lang: Lang, parent: &Path) -> anyhow::Result<PathBuf> {
    if !crate::db::plugins::valid_name(name) {
        bail!("{name:?} is not a plugin name: a-z, 0-9, _ and -, starting with a letter, at most 64 characters");
    }
    let dir = parent.join(name);
    if dir.read_dir().is_ok_and(|mut d| d.next().is_some()) {
        bail!("{} exists and is not empty: choose another name or --dir", dir.display());
    }
    let root = std::path::absolute(checkout())?;
    // The SDKs are not filled in: a project depends on them by version, as
    // on a registry, and `build` supplies the checkout's in their place.
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{manifest_schema}}", &root.join("docs/src/reference/manifest.schema.json").display().to_string())
    };
    let (files, what): (Template, &str) = match lang {
        Lang::Python => (PYTHON, "Python"),
        Lang::Javascript => (JAVASCRIPT, "JavaScript"),
        Lang::Typescript => (TYPESCRIPT, "TypeScript"),
        Lang::Rust => (RUST, "Rust"),
    };
    for (path, text) in files {
        let file = dir.join(path);
        std::fs::create_dir_all(file.parent().expect("a file in the project"))
            .with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(&file, fill(text)).with_context(|| format!("writing {}", file.display()))?;
    }
    std::fs::write(dir.join("README.md"), readme(name, what)).context("writing README.md")?;
    let script = dir.join(super::agent_test::SCRIPT_FILE);
    std::fs::write(&script, TEST_SCRIPT).with_context(|| format!("writing {}", script.display()))?;
    Ok(dir)
}

/// The project's README: the loop, in commands.
fn readme(name: &str, lang: &str) -> String {
    format!(
        "# {name}\n\nAn agent-host plugin in {lang}: a chat agent that sends the conversation to the model (the \
         host's `llm` tool, granted in `manifest.json`) with the other tools `manifest.json` grants offered to \
         it, runs the calls the model asks for, streams its answer and honours a stop.\n\n\
         ```sh\n\
         agent-host dev --prompt \"hello\"                   # build, run a turn on a private host; again on each change\n\
         agent-host build                                   # the component: target/{name}.wasm\n\
         agent-host test                                    # the scripted turns of agent-test.json\n\
         agent-host plugins upload {name} target/{name}.wasm --manifest manifest.json\n\
         agent-host runs create --plugin {name} \"hello\"     # streams the answer\n\
         ```\n\n\
         `plugins upload` and `runs create` reach a host at `AGENT_HOST_URL` with the token in \
         `AGENT_HOST_TOKEN` (a tenant admin's, to upload). Change the agent, build and upload again: runs \
         already enqueued keep the digest they were pinned to.\n\n\
         `agent-host test` runs the agent for real on a private host (its own PostgreSQL cluster, removed \
         after) with the model and the tools answering from `agent-test.json`, and reports every \
         difference from what each turn expects: the tools called and with what, the tools offered to \
         the model, the final text, the run's status. Add a turn for each behaviour you rely on.\n"
    )
}

/// `agent-host build [DIR] [-o OUT]`: the component, by default
/// `DIR/target/<name>.wasm`; an unchanged project is not built again.
pub fn build(dir: &Path, out: Option<&Path>) -> anyhow::Result<PathBuf> {
    let script = checkout().join("scripts/build-plugin");
    if !script.exists() {
        bail!(
            "`agent-host build` builds with the checkout this binary was built from, and {} is gone: build \
             agent-host from a checkout (`cargo install --path host`) and keep it",
            script.display()
        );
    }
    let dir = std::path::absolute(dir)?;
    let name = dir.file_name().and_then(|n| n.to_str()).context("the project's directory has no name")?;
    let out = match out {
        Some(out) => out.to_path_buf(),
        None => dir.join("target").join(format!("{name}.wasm")),
    };
    let status = std::process::Command::new(&script)
        .arg(&dir)
        .arg("-o")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("building {} failed (its output is above)", dir.display());
    }
    Ok(out)
}
