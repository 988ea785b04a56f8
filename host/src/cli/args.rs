//! Command line and environment. Every flag has an `AGENT_HOST_*` fallback;
//! durations are in milliseconds. [`Cli::validate`] refuses, at start and
//! naming the flag, any setting that would busy-loop (a zero interval) or
//! overcommit (more runs than the sandbox has instances); `main` calls it
//! before anything is opened.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::worker::WorkerConfig;

#[derive(Debug, Parser)]
#[command(
    name = "agent-host",
    version,
    about = "Durable AI-agent runs on plain PostgreSQL",
    args_override_self = true,
    after_help = "Examples:\n  \
      agent-host serve --demo                        # a host on a private cluster, with a demo run\n  \
      agent-host tokens create --user ada --tenant acme --admin\n  \
      agent-host runs create --plugin chat \"What time is it?\"   # with AGENT_HOST_URL and AGENT_HOST_TOKEN\n  \
      agent-host plugins upload my-agent my-agent.wasm --manifest manifest.json\n\n\
      serve, migrate, tokens, tenants, plugins add|list and audit open the database (--database-url, \
      --data-dir, ...); the other commands talk to a running host over HTTP (--url, --token)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Database")]
pub struct DbArgs {
    /// PostgreSQL URL. Without it, a private cluster is started in --data-dir.
    #[arg(long, env = "DATABASE_URL", global = true)]
    pub database_url: Option<String>,
    /// Separate URL for the LISTEN connection (keep it out of a transaction pooler).
    #[arg(long, env = "AGENT_HOST_LISTEN_DATABASE_URL", global = true)]
    pub listen_database_url: Option<String>,
    /// Directory of the private cluster (used only without DATABASE_URL).
    /// `serve` makes the cluster there; every other command uses the one it
    /// made, and refuses (naming the directory) when there is none.
    #[arg(long, env = "AGENT_HOST_DATA_DIR", default_value = ".agent-host", global = true)]
    pub data_dir: PathBuf,
    /// Where compiled plugin components are cached (keyed by digest and engine).
    #[arg(long, env = "AGENT_HOST_CACHE_DIR", default_value = ".agent-host/cache", global = true)]
    pub cache_dir: PathBuf,
    /// File holding the secret key (at least 32 bytes, e.g. 64 hex
    /// characters) of the MACs that let a process trust compiled components
    /// stored in the database and the cache. The key may instead be given in
    /// AGENT_HOST_ARTIFACT_KEY; with neither, one is generated on first start
    /// into <cache-dir>/artifact.key (mode 0600). Processes share artifacts
    /// only when they share the key.
    #[arg(long, env = "AGENT_HOST_ARTIFACT_KEY_FILE", global = true)]
    pub artifact_key_file: Option<PathBuf>,
    /// Connections in the process's pool.
    #[arg(long, env = "AGENT_HOST_DB_POOL_MAX", default_value_t = 32, global = true)]
    pub db_pool_max: u32,
    /// A private cluster for this process alone: fsync off, removed when it
    /// stops (`dev`'s own host; never a flag).
    #[arg(skip)]
    pub ephemeral: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP API and a worker (dispatcher, heartbeat, reaper).
    #[command(after_help = "Examples:\n  \
      agent-host serve --demo\n  \
      DATABASE_URL=postgres://agent@db/agents agent-host serve --listen 0.0.0.0:8080 --max-runs 64\n  \
      agent-host serve --tools-file tools.toml --llm-base-url https://api.openai.com/v1")]
    Serve(Box<ServeArgs>),
    /// Apply the embedded migrations and exit.
    Migrate {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Manage API tokens.
    Tokens {
        #[command(flatten)]
        db: DbArgs,
        #[command(subcommand)]
        command: TokensCommand,
    },
    /// Operator settings per tenant.
    Tenants {
        #[command(flatten)]
        db: DbArgs,
        #[command(subcommand)]
        command: TenantsCommand,
    },
    /// Make a plugin project in a new directory NAME (or --dir PARENT/NAME):
    /// a minimal chat agent that streams, offers the model the tools its
    /// manifest grants, runs the calls the model asks for and honours a stop,
    /// its manifest, its ecosystem's project file and a README.
    #[command(after_help = "Examples:\n  \
      agent-host new my-agent --lang python && cd my-agent && agent-host build\n  \
      agent-host new web-agent --lang typescript --dir ~/agents")]
    New {
        /// The project's directory and its plugin's name (a-z, 0-9, _ and -,
        /// starting with a letter).
        name: String,
        /// The agent's language.
        #[arg(long, value_enum)]
        lang: crate::cli::project::Lang,
        /// Where to make NAME (default: the current directory).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Build a plugin project into a component, wherever it is: app.py
    /// (componentize-py), app.js or app.ts (the TypeScript compiler, then
    /// componentize-js), Cargo.toml (cargo, wasm32-wasip2); each toolchain
    /// pinned and installed once into ~/.cache/agent-host; an unchanged
    /// project is not built again. Prints the component's path.
    Build {
        /// The project (default: the current directory).
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// The component to write (default: DIR/target/NAME.wasm).
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
    /// Run a plugin project's scripted turns (DIR/agent-test.json) against
    /// its real component on a real host with the model and the tools
    /// scripted: builds the project, starts a private PostgreSQL cluster (or
    /// uses --database-url), registers the component and runs each turn,
    /// then reports every difference from what the script expects (tool
    /// calls, the names offered to the model, final text, status). Exit
    /// status 1 when a turn differs.
    #[command(after_help = "Examples:\n  \
      agent-host test                       # in a project made by agent-host new\n  \
      agent-host test ~/agents/my-agent --file more-turns.json")]
    Test {
        /// The project (default: the current directory).
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// The script (default: DIR/agent-test.json).
        #[arg(long)]
        file: Option<PathBuf>,
        /// A database of the test's own, for example a scratch one in CI (its
        /// worker runs whatever is queued there, so never a host's; not read
        /// from DATABASE_URL for that reason). Default: a private cluster,
        /// removed after.
        #[arg(long)]
        database_url: Option<String>,
        /// How long one turn may take before it counts as failed.
        #[arg(long, default_value_t = 300_000)]
        turn_timeout_ms: u64,
    },
    /// The author's loop in one command: build the project, register it on
    /// a host, run a turn with --prompt and print its stream as it arrives;
    /// then watch the sources and, on each change, build, register and run
    /// the turn again (each run pinned to the digest it ran). Without --url
    /// the host is a private one of its own (a PostgreSQL cluster in a
    /// temporary directory, removed on exit; the offline model unless the
    /// model flags below say otherwise, and the `clock` tool). Ctrl-C stops
    /// the run in flight and the host.
    #[command(after_help = "Examples:\n  \
      agent-host dev --prompt \"What time is it?\"       # in a project made by agent-host new\n  \
      agent-host dev --once --prompt hi                  # one round; exit status 1 unless it completed\n  \
      agent-host dev --url https://agents.example.com --token $TOKEN --prompt hi")]
    Dev(Box<DevArgs>),
    /// Print a shell completion script (e.g. `agent-host completions bash >
    /// /etc/bash_completion.d/agent-host`).
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The benchmark moved to its own binary; this only says where.
    #[command(hide = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
    /// Manage WebAssembly plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// The audit trail, oldest first: who did what and when.
    Audit {
        #[command(flatten)]
        db: DbArgs,
        /// Only this tenant's rows (and the operator-wide ones).
        #[arg(long)]
        tenant: Option<String>,
        /// Rows after this id.
        #[arg(long)]
        after: Option<i64>,
        /// Rows at most (1-1000).
        #[arg(long, default_value_t = 1000)]
        limit: i64,
    },
    /// Start, watch and cancel runs over the HTTP API.
    Runs {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: RunsCommand,
    },
    /// Cron schedules of runs, over the HTTP API.
    Schedules {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: SchedulesCommand,
    },
    /// Tool calls waiting for a person's decision, over the HTTP API.
    Approvals {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: ApprovalsCommand,
    },
    /// Stop conversations over the HTTP API.
    Conversations {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: ConversationsCommand,
    },
}

/// `agent-host dev`.
#[derive(Debug, Clone, Args)]
pub struct DevArgs {
    /// The project (default: the current directory).
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// The turn's input.
    #[arg(short, long, default_value = "Hello!")]
    pub prompt: String,
    /// The run's config (JSON), as `runs create --config` takes it.
    #[arg(long)]
    pub config: Option<String>,
    /// The name the plugin is registered under (default: the directory's).
    #[arg(long)]
    pub name: Option<String>,
    /// One round (build, register, run), then exit: status 0 when the run
    /// completed, 1 otherwise.
    #[arg(long)]
    pub once: bool,
    /// A running host to use instead of a private one (with --token: a
    /// tenant admin's, to upload).
    #[arg(long, env = "AGENT_HOST_URL")]
    pub url: Option<String>,
    /// The bearer token for --url.
    #[arg(long, env = "AGENT_HOST_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Where the private host's HTTP API (and console) listens; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    #[command(flatten, next_help_heading = "The private host's model and tools")]
    pub tools: ToolArgs,
}

/// Where the API is and who is calling.
#[derive(Debug, Clone, Args)]
pub struct ApiArgs {
    /// Base URL of a running host.
    #[arg(long, env = "AGENT_HOST_URL", default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
    /// A bearer token (`agent-host tokens create`).
    #[arg(long, env = "AGENT_HOST_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// Enqueue a run and print its stream live until it ends.
    #[command(after_help = "Examples:\n  \
      agent-host runs create --plugin chat \"What time is it?\"\n  \
      agent-host runs create --plugin chat --conversation ID \"and then?\"\n  \
      id=$(agent-host runs create --plugin chat --no-follow \"hi\") && agent-host runs tail \"$id\"")]
    Create {
        /// The user's message.
        content: String,
        /// The plugin (agent) that runs the turn.
        #[arg(long)]
        plugin: String,
        /// Continue this conversation (default: a new one).
        #[arg(long)]
        conversation: Option<String>,
        /// The run's config, a JSON object.
        #[arg(long)]
        config: Option<String>,
        /// Print the run id and return without streaming.
        #[arg(long)]
        no_follow: bool,
    },
    /// Print one run: status, plugin, times, error, usage.
    Get {
        /// The run's id.
        id: String,
        /// Print the API's JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// The caller's runs, newest first: id, status, plugin, created, conversation.
    List {
        /// Only runs in this status (queued, running, waiting, completed, failed, cancelled).
        #[arg(long)]
        status: Option<String>,
        /// Runs at most.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print one JSON object per run instead of columns.
        #[arg(long)]
        json: bool,
    },
    /// A new run for a failed or cancelled run's message (the latest turn
    /// of its conversation); prints the new run's id.
    Retry {
        /// The failed or cancelled run's id.
        id: String,
    },
    /// Print a run's stream from a cursor, live until it ends.
    Tail {
        /// The run's id.
        id: String,
        /// Events after this seq (default 0: everything).
        #[arg(long, default_value_t = 0)]
        from: i64,
    },
    /// Ask a run to stop.
    Cancel {
        /// The run's id.
        id: String,
    },
    /// Queue an instruction for a run's turn: its agent takes it at its next
    /// step (steering); prints the instruction as queued.
    Steer {
        /// The run's id.
        id: String,
        /// The instruction.
        content: String,
    },
    /// Approve a waiting run's tool call (with other arguments: --args).
    Approve {
        /// The waiting run's id.
        id: String,
        /// The call's number (`call_id` in `approvals list`).
        call: u32,
        /// Run the call with these arguments instead (a JSON object): an edit.
        #[arg(long)]
        args: Option<String>,
    },
    /// Reject a waiting run's tool call: the agent gets `denied` with the reason.
    Reject {
        /// The waiting run's id.
        id: String,
        /// The call's number (`call_id` in `approvals list`).
        call: u32,
        /// Why, as the agent hears it.
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum SchedulesCommand {
    /// The caller's schedules: id, cron, time zone, plugin, paused, next firing.
    List {
        /// Print one JSON object per line instead of columns.
        #[arg(long)]
        json: bool,
    },
    /// Run PLUGIN with CONTENT on a cron expression.
    Create {
        /// The user's message each firing posts.
        content: String,
        /// The plugin (agent) each firing runs.
        #[arg(long)]
        plugin: String,
        /// `min hour day month weekday`, or with seconds first.
        #[arg(long)]
        cron: String,
        /// An IANA time zone (default UTC).
        #[arg(long)]
        timezone: Option<String>,
        /// The runs' config, a JSON object.
        #[arg(long)]
        config: Option<String>,
        /// Every firing continues this conversation (default: a new one each).
        #[arg(long)]
        conversation: Option<String>,
    },
    /// Stop firing it (until resumed).
    Pause {
        /// The schedule's id.
        id: String,
    },
    /// Fire it again, next at its next time after now.
    Resume {
        /// The schedule's id.
        id: String,
    },
    /// Delete it (runs it started are not touched).
    Delete {
        /// The schedule's id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ApprovalsCommand {
    /// The caller's pending approvals: run, call, tool, arguments, deadline.
    List {
        /// Print one JSON object per line instead of columns.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConversationsCommand {
    /// The caller's conversations, newest first: id, created, latest run and
    /// its status, title.
    List {
        /// Conversations at most.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print one JSON object per line instead of columns.
        #[arg(long)]
        json: bool,
    },
    /// Stop every queued and running turn; prints the drafts handed back.
    Stop {
        /// The conversation's id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum PluginsCommand {
    /// Validate a component and point NAME at it (with its manifest).
    Add {
        #[command(flatten)]
        db: DbArgs,
        /// The name runs ask for (a-z, 0-9, _ and -, starting with a letter).
        name: String,
        /// The component (.wasm) built for the agent-host:plugin world.
        file: PathBuf,
        /// The manifest (JSON): granted tools and limits.
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// The tenant that owns it (visible to and runnable by it alone);
        /// unset: published to every tenant.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// List plugins: name, digest, size, manifest (published ones, or what
    /// a tenant may run).
    List {
        #[command(flatten)]
        db: DbArgs,
        /// What this tenant may run (default: the published plugins).
        #[arg(long)]
        tenant: Option<String>,
        /// Print one JSON object per line instead of columns.
        #[arg(long)]
        json: bool,
    },
    /// What a plugin is and may do: the WIT world version its component
    /// targets, its imports and exports, its language, size and digest (for
    /// a FILE, read locally without compiling), its manifest's grants and
    /// limits (defaults filled in), and which granted tools the host has for
    /// this token (`GET /v1/tools`; for a FILE only when a token is given).
    /// NAME is a plugin on the host (`GET /v1/plugins`).
    #[command(after_help = "Examples:\n  \
      agent-host plugins inspect target/my-agent.wasm\n  \
      agent-host plugins inspect target/my-agent.wasm --manifest manifest.json --token $TOKEN\n  \
      agent-host plugins inspect my-agent --url http://127.0.0.1:8080 --token $TOKEN --json")]
    Inspect {
        #[command(flatten)]
        api: ApiArgs,
        /// A component file (.wasm), or the name of a plugin on the host.
        plugin: String,
        /// The manifest (JSON) of a FILE (default: manifest.json beside it,
        /// if there is one).
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Upload a component over the HTTP API with a tenant admin's token
    /// (no database access needed): the tenant's own plugin NAME.
    Upload {
        #[command(flatten)]
        api: ApiArgs,
        /// The name runs ask for (a-z, 0-9, _ and -, starting with a letter).
        name: String,
        /// The component (.wasm) built for the agent-host:plugin world.
        file: PathBuf,
        /// The manifest (JSON): granted tools and limits.
        #[arg(long)]
        manifest: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Create a token and print it (it is shown only once).
    Create {
        /// The user the token acts as (runs and conversations belong to it).
        #[arg(long)]
        user: String,
        /// The user's tenant: the unit of fairness, quotas and plugins.
        #[arg(long)]
        tenant: String,
        /// May upload the tenant's plugins, manage its tokens, read its audit trail.
        #[arg(long)]
        admin: bool,
        /// An operator-level admin (implies --admin): every tenant's tokens
        /// and audit trail, and plugins published to every tenant.
        #[arg(long)]
        operator: bool,
        /// Expires after this long (`90s`, `15m`, `12h`, `30d`); unset: never.
        #[arg(long, value_parser = parse_duration_s)]
        expires_in: Option<i64>,
    },
    /// List tokens: id, user, tenant, admin, created, last used, expiry,
    /// revoked (never a secret).
    List {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Print one JSON object per line instead of columns.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token by its id: every process refuses it at once.
    Revoke {
        /// The token's id (`tokens list`), never its secret.
        id: uuid::Uuid,
    },
}

#[derive(Debug, Subcommand)]
pub enum TenantsCommand {
    /// Set the share of each process's run slots TENANT may hold (percent,
    /// 1-100), or --clear it back to --tenant-slot-share-pct. Every process
    /// reads it on its next heartbeat.
    Share {
        /// The tenant's id (as its tokens carry it).
        tenant: String,
        /// Its share of each process's slots, in percent (1-100).
        #[arg(required_unless_present = "clear", value_parser = clap::value_parser!(u8).range(1..=100))]
        pct: Option<u8>,
        /// Forget the tenant's own share: it takes --tenant-slot-share-pct again.
        #[arg(long, conflicts_with = "pct")]
        clear: bool,
    },
    /// Set the ceilings on limits TENANT's own plugins may ask for in their
    /// manifests (NAME=VALUE, e.g. wall_ms=600000 memory_bytes=134217728),
    /// replacing the ones set before, or --clear them. An upload asking for
    /// more is refused naming the limits; plugins already uploaded keep
    /// their manifests.
    Ceiling {
        /// The tenant's id (as its tokens carry it).
        tenant: String,
        /// A limit's name and its ceiling, as NAME=VALUE (a manifest's `limits` names).
        #[arg(required_unless_present = "clear", value_parser = parse_ceiling)]
        ceilings: Vec<(String, u64)>,
        /// Forget the tenant's ceilings: the host's own apply again.
        #[arg(long, conflicts_with = "ceilings")]
        clear: bool,
    },
    /// The tenants with settings of their own: tenant, share percent, ceilings.
    List {
        /// Print one JSON object per line instead of columns.
        #[arg(long)]
        json: bool,
    },
}

/// `NAME=VALUE` of `tenants ceiling`.
fn parse_ceiling(raw: &str) -> Result<(String, u64), String> {
    let (name, value) = raw.split_once('=').ok_or_else(|| format!("{raw:?} is not NAME=VALUE"))?;
    let value = value.parse().map_err(|_| format!("{value:?} is not a whole number"))?;
    Ok((name.to_string(), value))
}

pub use crate::service::tokens::EXPIRES_IN_MAX_S;

/// `90s`, `15m`, `12h`, `30d` (or plain seconds) as seconds, 1 s to 10 years.
pub fn parse_duration_s(raw: &str) -> Result<i64, String> {
    let raw = raw.trim();
    let (digits, unit) = match raw.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => raw.split_at(i),
        None => (raw, "s"),
    };
    let n: i64 = digits.parse().map_err(|_| format!("{raw:?} is not a duration like 90s, 15m, 12h or 30d"))?;
    let unit_s = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{raw:?}: the unit must be s, m, h or d")),
    };
    match n.checked_mul(unit_s) {
        Some(s) if (1..=EXPIRES_IN_MAX_S).contains(&s) => Ok(s),
        _ => Err(format!("{raw:?} must be between 1 second and 10 years")),
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Address of the HTTP API (port 0 picks a free port).
    #[arg(long, help_heading = "HTTP API", env = "AGENT_HOST_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Create a demo token, enqueue a demo run and print how to watch it
    /// (and its ending). Implies --builtin-agents.
    #[arg(long, help_heading = "HTTP API")]
    pub demo: bool,
    /// Offer the built-in agents (`noop`, `echo`, `sleep`: for demos, tests
    /// and benchmarks) to every tenant. Off by default: on a shared host
    /// they are agents nobody uploaded.
    #[arg(long, help_heading = "HTTP API", env = "AGENT_HOST_BUILTIN_AGENTS")]
    pub builtin_agents: bool,
    /// SSE keepalive, which is also a tail's fallback poll when no wake arrives.
    #[arg(long, help_heading = "HTTP API", env = "AGENT_HOST_SSE_KEEPALIVE_MS", default_value_t = 15_000)]
    pub sse_keepalive_ms: u64,
    /// How long a live SSE tail whose client stops reading (while events wait for it) is kept
    /// before it is cut; the client rejoins from its last event id.
    #[arg(long, help_heading = "HTTP API", env = "AGENT_HOST_SSE_STALL_MS", default_value_t = 30_000)]
    pub sse_stall_ms: u64,
    /// Live SSE tails this process serves at most; past it a new one answers 503 `too_many_streams`.
    #[arg(long, help_heading = "HTTP API", env = "AGENT_HOST_SSE_TAILS_MAX", default_value_t = crate::stream::tail::LIVE_TAILS_MAX_DEFAULT)]
    pub sse_tails_max: usize,
    #[command(flatten, next_help_heading = "Worker")]
    pub worker: WorkerArgs,
    #[command(flatten, next_help_heading = "Tools and models")]
    pub tools: ToolArgs,
    #[command(flatten, next_help_heading = "Traces")]
    pub traces: TraceArgs,
}

/// OpenTelemetry traces of runs over OTLP (off unless an endpoint is given).
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// Export a trace per run (claims, the agent's segments, model and tool
    /// calls, with GenAI attributes) over OTLP/HTTP protobuf to this
    /// collector: a base URL such as http://127.0.0.1:4318 (`/v1/traces` is
    /// added) or the whole traces URL. Unset: no traces.
    #[arg(long, env = "AGENT_HOST_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Put prompts, completions, tool arguments and tool answers on the
    /// spans (each cut at 64 KiB). Off: counts, names and models only.
    #[arg(long, env = "AGENT_HOST_OTLP_CONTENT", requires = "otlp_endpoint")]
    pub otlp_content: bool,
    /// The `service.name` of the exported traces.
    #[arg(long, env = "AGENT_HOST_OTLP_SERVICE_NAME", default_value = "agent-host")]
    pub otlp_service_name: String,
}

impl TraceArgs {
    /// The exporter's configuration (`None`: traces are off).
    pub fn config(&self) -> Result<Option<crate::telemetry::TraceConfig>, ConfigError> {
        let Some(endpoint) = &self.otlp_endpoint else { return Ok(None) };
        let endpoint = crate::telemetry::traces_url(endpoint)
            .map_err(|why| ConfigError::Refused(format!("--otlp-endpoint (AGENT_HOST_OTLP_ENDPOINT): {why}")))?;
        if self.otlp_service_name.trim().is_empty() {
            return Err(ConfigError::Refused(
                "--otlp-service-name (AGENT_HOST_OTLP_SERVICE_NAME) must not be empty".into(),
            ));
        }
        Ok(Some(crate::telemetry::TraceConfig {
            endpoint,
            content: self.otlp_content,
            service_name: self.otlp_service_name.clone(),
        }))
    }
}

/// The host's tools: the model behind `llm` and the operator's webhooks.
/// Credentials stay here; guests only ever see what a tool answers.
#[derive(Debug, Clone, Args)]
pub struct ToolArgs {
    /// OpenAI-compatible endpoint, e.g. https://api.openai.com/v1 or
    /// http://127.0.0.1:11434/v1 (Ollama): the provider `default` (the tools
    /// file's `[[provider]]` tables add more); with none at all, the
    /// built-in offline model.
    #[arg(long, env = "AGENT_HOST_LLM_BASE_URL")]
    pub llm_base_url: Option<String>,
    /// Sent as `Authorization: Bearer` to the endpoint.
    #[arg(long, env = "AGENT_HOST_LLM_API_KEY", hide_env_values = true)]
    pub llm_api_key: Option<String>,
    /// The model a plugin's call gets when it names none: a `[[model]]`
    /// alias of the tools file, `<provider>/<model>`, or a model of the
    /// default provider.
    #[arg(long, env = "AGENT_HOST_LLM_MODEL", default_value = "gpt-4o-mini")]
    pub llm_model: String,
    /// One whole model call: waits for shared limits, retries and fallbacks before the first token included.
    #[arg(long, env = "AGENT_HOST_LLM_TIMEOUT_MS", default_value_t = 120_000)]
    pub llm_timeout_ms: u64,
    /// Silence allowed between two pieces of a streamed answer.
    #[arg(long, env = "AGENT_HOST_LLM_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    pub llm_idle_timeout_ms: u64,
    /// The tools file (TOML): `[[webhook]]`, `[[mcp]]` and `[[http]]` tables,
    /// `[secrets]`, and the models' `[[provider]]`, `[[model]]`, `[[limit]]`
    /// and `[model_retry]`; `${env:NAME}` takes a value from the environment.
    #[arg(long, env = "AGENT_HOST_TOOLS_FILE")]
    pub tools_file: Option<PathBuf>,
    /// What a tools-file entry naming no `tenants` grants the tenants' own
    /// plugins: `none` (only the operator's published plugins may use it)
    /// or `all` (every tenant's).
    #[arg(long, env = "AGENT_HOST_TENANT_TOOLS", value_enum, default_value_t = TenantTools::None)]
    pub tenant_tools: TenantTools,
}

/// `--operator-approvals`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OperatorApprovals {
    Requester,
    Admin,
}

/// `--tenant-tools`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TenantTools {
    None,
    All,
}

impl ToolArgs {
    /// The registry these flags describe; errors name the flag or file entry.
    pub fn registry(&self) -> anyhow::Result<crate::tools::ToolRegistry> {
        let llm = crate::tools::LlmConfig {
            base_url: self.llm_base_url.clone(),
            api_key: self.llm_api_key.clone(),
            model: self.llm_model.clone(),
            timeout: Duration::from_millis(self.llm_timeout_ms),
            idle_timeout: Duration::from_millis(self.llm_idle_timeout_ms),
        };
        let mut file: crate::tools::ToolsConfig = match &self.tools_file {
            Some(path) => crate::tools::load_tools_file(path).map_err(anyhow::Error::msg)?,
            None => Default::default(),
        };
        file.tenants_default_all = self.tenant_tools == TenantTools::All;
        crate::tools::ToolRegistry::from_tools(&llm, &file).map_err(anyhow::Error::msg)
    }
}

#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Runs executed at once by this process.
    #[arg(long, env = "AGENT_HOST_MAX_RUNS", default_value_t = crate::worker::MAX_RUNS_DEFAULT)]
    pub max_runs: usize,
    /// Lease a claim holds without a heartbeat.
    #[arg(long, env = "AGENT_HOST_LEASE_MS", default_value_t = millis(crate::worker::LEASE_DEFAULT))]
    pub lease_ms: u64,
    /// Heartbeat interval (must be below the lease).
    #[arg(long, env = "AGENT_HOST_HEARTBEAT_MS", default_value_t = millis(crate::worker::HEARTBEAT_DEFAULT))]
    pub heartbeat_ms: u64,
    /// Slack past the lease before the reaper ends a run.
    #[arg(long, env = "AGENT_HOST_REAP_GRACE_MS", default_value_t = millis(crate::worker::REAP_GRACE_DEFAULT))]
    pub reap_grace_ms: u64,
    /// How often the reaper sweeps.
    #[arg(long, env = "AGENT_HOST_REAP_INTERVAL_MS", default_value_t = millis(crate::worker::REAP_INTERVAL_DEFAULT))]
    pub reap_interval_ms: u64,
    /// Fallback poll of the dispatcher when no wake arrives.
    #[arg(long, env = "AGENT_HOST_POLL_TICK_MS", default_value_t = millis(crate::worker::POLL_TICK_DEFAULT))]
    pub poll_tick_ms: u64,
    /// Budget for in-flight runs to finish on SIGTERM/SIGINT.
    #[arg(long, env = "AGENT_HOST_DRAIN_TIMEOUT_MS", default_value_t = millis(crate::worker::DRAIN_TIMEOUT_DEFAULT))]
    pub drain_timeout_ms: u64,
    /// How long content deltas merge before a journal flush.
    #[arg(long, env = "AGENT_HOST_JOURNAL_FLUSH_MS", default_value_t = millis(crate::run::journal::FLUSH_DEFAULT))]
    pub journal_flush_ms: u64,
    /// How long a terminal run's events are kept (then the run's request snapshot is nulled too).
    #[arg(long, env = "AGENT_HOST_EVENT_RETENTION_S", default_value_t = crate::worker::RETENTION_DEFAULT.as_secs())]
    pub event_retention_s: u64,
    /// How often retention runs.
    #[arg(long, env = "AGENT_HOST_RETENTION_INTERVAL_MS", default_value_t = millis(crate::worker::RETENTION_INTERVAL_DEFAULT))]
    pub retention_interval_ms: u64,
    /// How long a run may keep going after a stop before it is interrupted.
    #[arg(long, env = "AGENT_HOST_CANCEL_GRACE_MS", default_value_t = millis(crate::worker::CANCEL_GRACE_DEFAULT))]
    pub cancel_grace_ms: u64,
    /// Attempts a resumable run gets (its plugin's manifest says
    /// `"durability": "resume"`): after this many lost workers or drains out
    /// of budget it ends failed instead of going back to the queue.
    #[arg(long, env = "AGENT_HOST_RESUME_ATTEMPTS", default_value_t = crate::db::lifecycle::RESUME_ATTEMPTS_DEFAULT)]
    pub resume_attempts: u32,
    /// URL prefixes a run's completion webhook (and an A2A task's push
    /// notifications) may start with (repeat the flag, or separate with
    /// commas); none: runs may not ask for webhooks.
    #[arg(
        long,
        help_heading = "Completion webhooks",
        env = "AGENT_HOST_COMPLETION_WEBHOOK_ALLOW",
        value_delimiter = ','
    )]
    pub completion_webhook_allow: Vec<String>,
    /// The completion webhooks' signing secret (`whsec_<base64>`, or at least
    /// 16 bytes); required with `--completion-webhook-allow`.
    #[arg(long, help_heading = "Completion webhooks", env = "AGENT_HOST_WEBHOOK_SECRET", hide_env_values = true)]
    pub webhook_secret: Option<String>,
    /// Attempts per completion webhook before its delivery is `failed`.
    #[arg(long, help_heading = "Completion webhooks", env = "AGENT_HOST_WEBHOOK_ATTEMPTS", default_value_t = 8)]
    pub webhook_attempts: u32,
    /// The first retry's pause; each next one doubles it (at most 10 min).
    #[arg(long, help_heading = "Completion webhooks", env = "AGENT_HOST_WEBHOOK_BACKOFF_MS", default_value_t = 1_000)]
    pub webhook_backoff_ms: u64,
    /// How often this process looks for webhook deliveries to send.
    #[arg(long, help_heading = "Completion webhooks", env = "AGENT_HOST_WEBHOOK_POLL_MS", default_value_t = 1_000)]
    pub webhook_poll_ms: u64,
    /// How often this process fires due schedules.
    #[arg(long, help_heading = "Schedules", env = "AGENT_HOST_SCHEDULE_TICK_MS", default_value_t = millis(crate::worker::SCHEDULE_TICK_DEFAULT))]
    pub schedule_tick_ms: u64,
    /// Schedules one tenant may have at most (its users together); past it
    /// a new one is refused (422).
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_MAX_SCHEDULES", default_value_t = crate::service::schedules::TENANT_MAX_SCHEDULES_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub tenant_max_schedules: u32,
    /// Who decides a tool call the operator gates (a tools-file entry's
    /// `approval`): its requester, or an admin of its tenant other than the
    /// requester.
    #[arg(long, help_heading = "Approvals", env = "AGENT_HOST_OPERATOR_APPROVALS", value_enum, default_value_t = OperatorApprovals::Requester)]
    pub operator_approvals: OperatorApprovals,
    /// A decision on a call the operator gates may not edit its arguments.
    #[arg(long, help_heading = "Approvals", env = "AGENT_HOST_OPERATOR_APPROVALS_NO_EDIT")]
    pub operator_approvals_no_edit: bool,
    /// The shortest time between two firings of one schedule, in seconds:
    /// a cron expression that would fire more often is refused (422).
    #[arg(long, help_heading = "Schedules", env = "AGENT_HOST_SCHEDULE_MIN_INTERVAL_S", default_value_t = crate::service::schedules::MIN_INTERVAL_DEFAULT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub schedule_min_interval_s: u64,
    /// Running runs one tenant may have at most, across all processes (unset: no cap).
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_MAX_RUNNING")]
    pub tenant_max_running: Option<u32>,
    /// The share of this process's run slots one tenant may hold, in
    /// percent (rounded up, at least one slot; below 100, never every slot
    /// of a process with two or more): the rest stay free for the other
    /// tenants, so no tenant holds every slot. A tenant's own share is
    /// set with `agent-host tenants share` (read on each heartbeat).
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_SLOT_SHARE_PCT", default_value_t = crate::worker::TENANT_SLOT_SHARE_PCT_DEFAULT,
          value_parser = clap::value_parser!(u8).range(1..=100))]
    pub tenant_slot_share_pct: u8,
    /// Queued runs one tenant may have at most, across all processes; past
    /// it an enqueue answers 429 `quota_exceeded` (unset: no quota).
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_MAX_QUEUED")]
    pub tenant_max_queued: Option<u32>,
    /// Enqueues per second one tenant may make, per process (a token bucket;
    /// a burst waits up to 2 s for its tokens, then 429). Unset: no limit.
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_ENQUEUE_PER_S")]
    pub tenant_enqueue_per_s: Option<std::num::NonZeroU32>,
    /// The enqueue bucket's size (default: one second's worth).
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_ENQUEUE_BURST")]
    pub tenant_enqueue_burst: Option<std::num::NonZeroU32>,
    /// Live event streams and waiting Responses requests one user may hold
    /// at most, per process; past it 429 `quota_exceeded`.
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_USER_MAX_STREAMS", default_value_t = crate::service::quota::USER_MAX_STREAMS_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub user_max_streams: u32,
    /// Live event streams and waiting Responses requests one tenant's users
    /// may hold at most, per process; past it 429 `quota_exceeded`.
    #[arg(long, help_heading = "Tenants and quotas", env = "AGENT_HOST_TENANT_MAX_STREAMS", default_value_t = crate::service::quota::TENANT_MAX_STREAMS_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub tenant_max_streams: u32,
    /// Group commit of endings: how long a batch of terminal writes waits for
    /// more after its first (0: only endings already queued share a commit).
    #[arg(long, env = "AGENT_HOST_FINISH_WINDOW_MS", default_value_t = millis(crate::worker::FINISH_WINDOW_DEFAULT), value_parser = clap::value_parser!(u64).range(0..=crate::worker::FINISH_WINDOW_MAX.as_millis() as u64))]
    pub finish_window_ms: u64,
    /// This process's name in claims (default: hostname-pid).
    #[arg(long, env = "AGENT_HOST_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Do not claim runs (serve the API and reap only).
    #[arg(long, env = "AGENT_HOST_NO_DISPATCH")]
    pub no_dispatch: bool,
    /// Queue every run for a claim, even when this process has a free slot
    /// and nothing else is queued (by default such a run starts in its
    /// enqueue's statement: eager start).
    #[arg(long, env = "AGENT_HOST_NO_EAGER_START")]
    pub no_eager_start: bool,
    /// Run without the LISTEN hub (every wait falls back to its poll).
    #[arg(long, env = "AGENT_HOST_NO_HUB")]
    pub no_hub: bool,
}

impl WorkerArgs {
    pub fn to_config(&self) -> WorkerConfig {
        let ms = Duration::from_millis;
        WorkerConfig {
            max_runs: self.max_runs,
            lease: ms(self.lease_ms),
            heartbeat: ms(self.heartbeat_ms),
            reap_grace: ms(self.reap_grace_ms),
            reap_interval: ms(self.reap_interval_ms),
            poll_tick: ms(self.poll_tick_ms),
            drain_timeout: ms(self.drain_timeout_ms),
            worker_id: self.worker_id.clone().unwrap_or_else(crate::worker::default_worker_id),
            journal_flush: ms(self.journal_flush_ms),
            journal_give_up: crate::run::journal::GIVE_UP_DEFAULT,
            retention: Duration::from_secs(self.event_retention_s),
            retention_interval: ms(self.retention_interval_ms),
            cancel_grace: ms(self.cancel_grace_ms),
            tenant_max_running: self.tenant_max_running,
            tenant_slot_share_pct: self.tenant_slot_share_pct,
            dispatch: !self.no_dispatch,
            resume_attempts: self.resume_attempts,
            webhooks: self.webhook_secret.as_deref().and_then(|s| crate::worker::webhook_secret_bytes(s).ok()).map(
                |secret| crate::worker::WebhookConfig {
                    secret,
                    attempts_max: self.webhook_attempts,
                    backoff: ms(self.webhook_backoff_ms),
                    poll: ms(self.webhook_poll_ms),
                },
            ),
            schedule_tick: ms(self.schedule_tick_ms),
            policy: std::sync::Arc::new(self.policy()),
            finish_window: ms(self.finish_window_ms),
            eager_start: !self.no_eager_start,
        }
    }

    /// The operator's rules for submissions.
    pub fn policy(&self) -> crate::service::submit::Policy {
        let quotas = crate::service::quota::QuotaConfig {
            tenant_max_queued: self.tenant_max_queued,
            tenant_enqueue_per_s: self.tenant_enqueue_per_s,
            tenant_enqueue_burst: self.tenant_enqueue_burst,
            user_max_streams: Some(self.user_max_streams),
            tenant_max_streams: Some(self.tenant_max_streams),
        };
        let schedules = crate::service::schedules::SchedulePolicy {
            tenant_max: self.tenant_max_schedules,
            min_interval: Duration::from_secs(self.schedule_min_interval_s),
        };
        let approvals = crate::service::submit::ApprovalPolicy {
            admin_decides: self.operator_approvals == OperatorApprovals::Admin,
            edit: !self.operator_approvals_no_edit,
        };
        let webhook_secret = self
            .webhook_secret
            .as_deref()
            .and_then(|s| crate::worker::webhook_secret_bytes(s).ok())
            .map(crate::service::submit::WebhookSecret);
        crate::service::submit::Policy {
            schedules,
            approvals,
            webhook_secret,
            webhook_allow: self.completion_webhook_allow.clone(),
            quotas: crate::service::quota::Quotas::new(quotas),
        }
    }
}

/// A configuration the host refuses at start: it would busy-loop or
/// overcommit. Each message names the flag (and its environment fallback).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag} ({env}) must be greater than 0: {why}")]
    Zero { flag: &'static str, env: &'static str, why: &'static str },
    #[error(
        "--max-runs ({max_runs}) exceeds {max}, the most slots one process holds: each slot's guest \
         reserves address space and memory maps of its own (run more processes instead)"
    )]
    MaxRunsAboveMax { max_runs: usize, max: usize },
    #[error(
        "--heartbeat-ms ({heartbeat_ms}) must be below --lease-ms ({lease_ms}), or a healthy worker loses its runs"
    )]
    HeartbeatNotBelowLease { heartbeat_ms: u64, lease_ms: u64 },
    /// Anything else the host refuses, said whole.
    #[error("{0}")]
    Refused(String),
}

/// Refuses a zero `value` for the flag `flag` (environment `env`), saying why.
fn non_zero(value: u64, flag: &'static str, env: &'static str, why: &'static str) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::Zero { flag, env, why });
    }
    Ok(())
}

impl Cli {
    /// Every check that can be made before anything is opened.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match &self.command {
            Command::Serve(args) => args.validate(),
            Command::Migrate { db }
            | Command::Tokens { db, .. }
            | Command::Tenants { db, .. }
            | Command::Audit { db, .. }
            | Command::Plugins(PluginsCommand::Add { db, .. } | PluginsCommand::List { db, .. }) => db.validate(),
            _ => Ok(()),
        }
    }
}

impl DbArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_zero(
            self.db_pool_max.into(),
            "--db-pool-max",
            "AGENT_HOST_DB_POOL_MAX",
            "a pool of no connections makes every query wait out its timeout",
        )
    }
}

impl ServeArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        // The keepalive is also each tail's fallback poll.
        non_zero(
            self.sse_keepalive_ms,
            "--sse-keepalive-ms",
            "AGENT_HOST_SSE_KEEPALIVE_MS",
            "every SSE tail would send keepalives and re-read its run in a busy loop",
        )?;
        non_zero(
            self.sse_stall_ms,
            "--sse-stall-ms",
            "AGENT_HOST_SSE_STALL_MS",
            "every SSE tail with an event waiting would be cut at once",
        )?;
        self.db.validate()?;
        self.worker.validate()?;
        self.traces.config()?;
        self.tools.validate()
    }
}

/// A zero that would make a loop spin.
const SPIN: &str = "its loop would spin without pause";

/// The flag behind each of the worker's settings that must not be zero, and
/// what a zero would do: the checks themselves are the worker's
/// ([`WorkerConfig::validate`]), written once.
const WORKER_FLAGS: &[(&str, &str, &str, &str)] = &[
    ("max runs", "--max-runs", "AGENT_HOST_MAX_RUNS", "this process would never start a run"),
    ("lease", "--lease-ms", "AGENT_HOST_LEASE_MS", "every claim would lapse the moment it is made"),
    ("heartbeat", "--heartbeat-ms", "AGENT_HOST_HEARTBEAT_MS", SPIN),
    ("reap interval", "--reap-interval-ms", "AGENT_HOST_REAP_INTERVAL_MS", SPIN),
    ("poll tick", "--poll-tick-ms", "AGENT_HOST_POLL_TICK_MS", SPIN),
    ("journal flush", "--journal-flush-ms", "AGENT_HOST_JOURNAL_FLUSH_MS", SPIN),
    ("retention interval", "--retention-interval-ms", "AGENT_HOST_RETENTION_INTERVAL_MS", SPIN),
    ("schedule tick", "--schedule-tick-ms", "AGENT_HOST_SCHEDULE_TICK_MS", SPIN),
    ("resume attempts", "--resume-attempts", "AGENT_HOST_RESUME_ATTEMPTS", "a resumable run could never start"),
    (
        "tenant max running",
        "--tenant-max-running",
        "AGENT_HOST_TENANT_MAX_RUNNING",
        "no tenant could ever run (leave it unset for no cap)",
    ),
    ("webhook attempts", "--webhook-attempts", "AGENT_HOST_WEBHOOK_ATTEMPTS", "no webhook would be sent"),
    ("webhook backoff", "--webhook-backoff-ms", "AGENT_HOST_WEBHOOK_BACKOFF_MS", SPIN),
    ("webhook poll", "--webhook-poll-ms", "AGENT_HOST_WEBHOOK_POLL_MS", SPIN),
];

impl WorkerArgs {
    /// The worker's own checks of the configuration these flags make (one
    /// validator, [`WorkerConfig::validate`]), said in the flags' words;
    /// then the completion webhooks' secret and allow-list.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use crate::worker::ConfigError as Worker;
        let zero = |name: &str| match WORKER_FLAGS.iter().find(|f| f.0 == name) {
            Some(&(_, flag, env, why)) => ConfigError::Zero { flag, env, why },
            None => ConfigError::Refused(format!("{name} must be greater than zero")),
        };
        self.to_config().validate().map_err(|e| match e {
            Worker::Zero(name) => zero(name),
            Worker::MaxRuns(0) => zero("max runs"),
            Worker::MaxRuns(max_runs) => ConfigError::MaxRunsAboveMax { max_runs, max: crate::sandbox::MAX_RUNS_MAX },
            Worker::HeartbeatNotBelowLease { heartbeat, lease } => ConfigError::HeartbeatNotBelowLease {
                heartbeat_ms: heartbeat.as_millis() as u64,
                lease_ms: lease.as_millis() as u64,
            },
            other => ConfigError::Refused(other.to_string()),
        })?;
        match (&self.webhook_secret, self.completion_webhook_allow.is_empty()) {
            (None, false) => {
                return Err(ConfigError::Refused(
                    "--completion-webhook-allow needs a signing secret: set AGENT_HOST_WEBHOOK_SECRET".into(),
                ))
            }
            (Some(secret), _) => {
                crate::worker::webhook_secret_bytes(secret).map_err(ConfigError::Refused)?;
            }
            (None, true) => {}
        }
        if let Some(p) =
            self.completion_webhook_allow.iter().find(|p| !(p.starts_with("http://") || p.starts_with("https://")))
        {
            return Err(ConfigError::Refused(format!(
                "--completion-webhook-allow {p:?} must be an http:// or https:// URL prefix"
            )));
        }
        Ok(())
    }
}

impl ToolArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let why = "every model call would time out at once";
        non_zero(self.llm_timeout_ms, "--llm-timeout-ms", "AGENT_HOST_LLM_TIMEOUT_MS", why)?;
        non_zero(self.llm_idle_timeout_ms, "--llm-idle-timeout-ms", "AGENT_HOST_LLM_IDLE_TIMEOUT_MS", why)
    }
}

/// A default written once, as the worker's `Duration` constant, and shown
/// by a flag in milliseconds.
const fn millis(d: std::time::Duration) -> u64 {
    d.as_millis() as u64
}
