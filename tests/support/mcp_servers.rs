//! Third-party MCP servers on loopback for the tools tests, as installed by
//! scripts/test: the `mcp` Python SDK's FastMCP server running
//! tests/mcp/py_server.py (AGENT_HOST_TEST_MCP_VENV), and
//! @modelcontextprotocol/server-everything in Streamable HTTP mode
//! (AGENT_HOST_TEST_MCP_NODE_MODULES). Each is killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{poll_until, wait_for};

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn env_path(var: &str, what: &str) -> PathBuf {
    let v = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run scripts/test, which installs {what} into a cache and names it")
    });
    PathBuf::from(v)
}

/// One MCP server process.
pub struct McpServerProcess {
    child: Child,
    pub port: u16,
    /// The Python server's notes (`started`, `cancelled`, `finished` of its
    /// slow tool, `echo` calls), one a line.
    pub events: PathBuf,
    log: PathBuf,
}

/// One server starting at a time in a test binary: a free port is free
/// only until its server binds it, and two tests picking at once could
/// both get it (the second server would then fail to bind while its test
/// talked to the first).
static STARTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl McpServerProcess {
    /// The FastMCP server of tests/mcp/py_server.py on `port` (a fresh one when `None`).
    pub async fn python(port: Option<u16>, events: Option<PathBuf>) -> McpServerProcess {
        let _one = STARTING.lock().await;
        let venv = env_path("AGENT_HOST_TEST_MCP_VENV", "tests/mcp/requirements.txt");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("tests/mcp/py_server.py");
        let port = port.unwrap_or_else(free_port);
        let id = uuid::Uuid::new_v4().simple().to_string();
        let events = events.unwrap_or_else(|| std::env::temp_dir().join(format!("agent-host-mcp-events-{id}")));
        let log = std::env::temp_dir().join(format!("agent-host-mcp-py-{id}.log"));
        let mut cmd = Command::new(venv.join("bin/python"));
        cmd.arg(&script).arg(port.to_string()).arg(&events);
        McpServerProcess::spawn(cmd, port, events, log).await
    }

    /// @modelcontextprotocol/server-everything, Streamable HTTP, on a fresh port.
    pub async fn everything() -> McpServerProcess {
        let _one = STARTING.lock().await;
        let modules = env_path("AGENT_HOST_TEST_MCP_NODE_MODULES", "tests/mcp/package-lock.json");
        let port = free_port();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let log = std::env::temp_dir().join(format!("agent-host-mcp-everything-{id}.log"));
        let mut cmd = Command::new("node");
        cmd.arg(modules.join("@modelcontextprotocol/server-everything/dist/index.js"))
            .arg("streamableHttp")
            .env("PORT", port.to_string());
        McpServerProcess::spawn(cmd, port, std::env::temp_dir().join(format!("unused-{id}")), log).await
    }

    async fn spawn(mut cmd: Command, port: u16, events: PathBuf, log: PathBuf) -> McpServerProcess {
        let out = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("starting an MCP server");
        let mut server = McpServerProcess { child, port, events, log };
        server.wait_listening().await;
        // Listening, and it is ours: a server that could not bind exits.
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("the MCP server on port {} exited ({status}); its log:\n{}", server.port, server.log());
        }
        server
    }

    /// Waits (bounded) until the port accepts connections.
    async fn wait_listening(&self) {
        let listening = || async { tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() };
        assert!(
            poll_until(Duration::from_secs(60), listening).await,
            "the MCP server never listened; its log:\n{}",
            self.log()
        );
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The server's notes so far.
    pub fn notes(&self) -> Vec<String> {
        std::fs::read_to_string(&self.events).unwrap_or_default().lines().map(str::to_string).collect()
    }

    /// Waits (bounded) until the server noted `line`.
    pub async fn wait_note(&self, line: &str, within: Duration) {
        let noted = || async { self.notes().iter().any(|l| l == line) };
        assert!(poll_until(within, noted).await, "the MCP server never noted {line:?}: {:?}", self.notes());
    }

    /// Kills the server and waits until its port refuses connections.
    pub async fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let refused = || async { tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_err() };
        wait_for("the killed MCP server's port to refuse", Duration::from_secs(10), refused).await;
    }
}

impl Drop for McpServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
        let _ = std::fs::remove_file(&self.events);
    }
}
