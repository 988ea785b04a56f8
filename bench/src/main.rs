//! `agent-host-bench`: the documented benchmark of agent-host, outside the
//! host's binary and library. Prints enqueue latency over HTTP, pickup latency
//! (enqueue commit to agent start, idle worker), drain throughput of
//! pre-enqueued no-op runs, the same SQL statements run without the host (the
//! SQL floor) and their ratio, emit-to-client latency, SIGKILL-to-failed,
//! durable resume's costs (recording, resumable drain, SIGKILL-to-resumed,
//! replay), approvals' costs (decision to resumed, memory per waiting run)
//! and the sandbox's costs. Medians over passes; the machine is shared and noisy,
//! so single figures mean little.
//!
//! It uses the library's public API only (see `library`), in a throwaway
//! database beside the one it is given (or in a private cluster).

mod approvals;
mod durable;
mod figures;
mod graphile;
mod guests;
mod hostile;
mod library;
mod live;
mod queue;
mod sandbox;
mod sql;
mod stream;
mod tools;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use library::{DbArgs, ServeArgs};

#[derive(Debug, Parser)]
#[command(
    name = "agent-host-bench",
    version,
    about = "Measure agent-host: enqueue and pickup latency, drain throughput against the SQL floor, \
             streaming, reaping and the sandbox",
    args_override_self = true
)]
struct Cli {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    bench: BenchArgs,
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// The `agent-host serve` process the SIGKILL measurement starts and
    /// kills (the benchmark runs it as its own child).
    #[command(hide = true)]
    Serve(Box<ServeArgs>),
    /// A worker holding runs waiting for approval, for the resident-memory
    /// measurement (the benchmark runs it as its own child).
    #[command(hide = true)]
    Waiter,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Runs pre-enqueued for each drain pass.
    #[arg(long, default_value_t = 20_000)]
    pub runs: usize,
    /// Runs in flight while draining.
    #[arg(long, default_value_t = 10)]
    pub in_flight: usize,
    /// Passes of the drain and SQL-floor measurements (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub passes: usize,
    /// Samples for the latency measurements.
    #[arg(long, default_value_t = 500)]
    pub samples: usize,
    /// Where the built guest plugins are (echo.wasm, fixtures.wasm).
    #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
    pub plugin_dir: PathBuf,
    /// Guests parked at once for the memory measurement.
    #[arg(long, default_value_t = 1000)]
    pub parked: usize,
    /// Host processes killed for the SIGKILL-to-failed measurement.
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// Runs pre-enqueued for each pass of the resumable-beside-at-most-once drain.
    #[arg(long, default_value_t = 5_000)]
    pub resume_runs: usize,
    /// Resumed runs for the replay measurement (each one sample).
    #[arg(long, default_value_t = 20)]
    pub replays: usize,
    /// Recorded tool calls each replay run makes, then replays.
    #[arg(long, default_value_t = 1_000)]
    pub replay_calls: usize,
    /// Approval decisions timed to the resumed run (after 5 warm-up ones).
    #[arg(long, default_value_t = 200)]
    pub decisions: usize,
    /// Runs waiting for approval on one host for the resident-memory measurement.
    #[arg(long, default_value_t = 1000)]
    pub waiting: usize,
    /// The throwaway database created (dropped first if it exists) beside the given one.
    #[arg(long, default_value = "agent_host_bench")]
    pub bench_database: String,
    /// Another queue drained on the same server in the same sitting, when
    /// Node is present: `graphile` (graphile-worker, pinned in
    /// bench/graphile, installed into a cache outside the clone) or `none`.
    #[arg(long, value_enum, default_value_t = Compare::Graphile)]
    pub compare: Compare,
    /// Only the queue's figures (enqueue, pickup, drain, the comparison).
    #[arg(long)]
    pub queue_only: bool,
    /// Only the drain passes (end to end, with their commits and WAL per
    /// run): for profiling the database while it drains.
    #[arg(long)]
    pub drain_only: bool,
    /// Only the tools' figures (an MCP call's and an `http` call's host
    /// overhead over the server's own time); needs no database.
    #[arg(long)]
    pub tools_only: bool,
    /// Where the Python and JavaScript examples are (scripts/build-plugin's
    /// chat-python.wasm, chat-js.wasm).
    #[arg(long, default_value = "plugins/target/guests")]
    pub guest_dir: PathBuf,
    /// Only the guests' figures (Python and JavaScript beside Rust).
    #[arg(long)]
    pub guests_only: bool,
    /// Only the hostile tenant's figures: a trickle's pickup and completion
    /// with and without a tenant flooding slots, schedules and streams.
    #[arg(long)]
    pub hostile_only: bool,
    /// Only the live runs' figures: N concurrent turns of a `chat`
    /// plugin (--live-plugin) against the benchmark's streaming mock model on one `serve`
    /// process, each followed by one SSE client (commits/s, NOTIFYs/s,
    /// token-to-client delay, frames lost or repeated).
    #[arg(long, value_name = "N")]
    pub live: Option<usize>,
    /// Seconds of tokens per live turn.
    #[arg(long, default_value_t = 30)]
    pub live_secs: u64,
    /// Tokens a second the mock model sends per live turn.
    #[arg(long, default_value_t = 20)]
    pub live_tokens_per_s: u64,
    /// `serve` processes sharing the database for the live runs (each
    /// takes every K-th turn).
    #[arg(long, default_value_t = 1)]
    pub live_processes: usize,
    /// The live turns' plugin: `chat` (Rust, from --plugin-dir), or
    /// `chat-python` or `chat-js` (from --guest-dir); all three stream the
    /// model's text through the host the same way.
    #[arg(long, default_value = "chat", value_parser = ["chat", "chat-python", "chat-js"])]
    pub live_plugin: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Compare {
    Graphile,
    None,
}

impl BenchArgs {
    /// Guests the sandbox's instance pool can hold; one more is the probe's own run.
    const PARKED_MAX: usize = library::INSTANCES_MAX as usize - 1;

    fn validate(&self) -> anyhow::Result<()> {
        for (flag, n) in [
            ("--runs", self.runs),
            ("--in-flight", self.in_flight),
            ("--passes", self.passes),
            ("--samples", self.samples),
            ("--parked", self.parked),
            ("--kills", self.kills),
            ("--resume-runs", self.resume_runs),
            ("--replays", self.replays),
            ("--replay-calls", self.replay_calls),
            ("--decisions", self.decisions),
            ("--waiting", self.waiting),
        ] {
            anyhow::ensure!(n > 0, "{flag} must be greater than 0");
        }
        anyhow::ensure!(
            self.parked <= Self::PARKED_MAX,
            "--parked ({}) exceeds the sandbox's instance pool ({})",
            self.parked,
            Self::PARKED_MAX
        );
        anyhow::ensure!(
            self.replays <= Self::PARKED_MAX,
            "--replays ({}) exceeds the sandbox's instance pool ({})",
            self.replays,
            Self::PARKED_MAX
        );
        anyhow::ensure!(
            self.replay_calls as u64 <= library::TOOL_CALLS_CEILING,
            "--replay-calls ({}) exceeds a manifest's tool calls ceiling ({})",
            self.replay_calls,
            library::TOOL_CALLS_CEILING
        );
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The benchmark's own runs would drown its figures in per-run lines.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("AGENT_HOST_LOG").unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    cli.db.validate()?;
    match &cli.role {
        Some(Role::Serve(args)) => {
            args.validate()?;
            library::serve(&args.db, args).await
        }
        Some(Role::Waiter) => approvals::waiter(&cli.db).await,
        None if cli.bench.tools_only => tools::tools(&cli.bench).await,
        None => {
            cli.bench.validate()?;
            run(&cli.db, &cli.bench).await
        }
    }
}

async fn run(db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    let mut database = library::open_database(db_args).await?;
    let result = measure(&database.url, db_args, args).await;
    if let Some(c) = database.cluster.as_mut() {
        c.stop();
    }
    result
}

async fn measure(server_url: &str, db_args: &DbArgs, args: &BenchArgs) -> anyhow::Result<()> {
    let url = sql::fresh_database(server_url, &args.bench_database).await?;
    let pool = library::connect_and_migrate(&url, (args.in_flight as u32 + 8).max(16)).await?;
    println!("agent-host bench: {} cores, database {}", figures::num_cpus(), figures::redact(&url));

    if let Some(n) = args.live {
        let k = args.live_processes;
        anyhow::ensure!((1..=16).contains(&k), "--live-processes must be 1 to 16");
        anyhow::ensure!(
            n > 0 && n.div_ceil(k) <= library::MAX_RUNS_MAX,
            "--live must be 1 to {} per process (--live-processes {k})",
            library::MAX_RUNS_MAX
        );
        live::live(&pool, &url, db_args, args, n).await?;
        pool.close().await;
        return Ok(());
    }
    if args.guests_only {
        guests::guests(&pool, &url, db_args, args).await?;
        pool.close().await;
        return Ok(());
    }
    if args.hostile_only {
        hostile::hostile(&pool, &url, args).await?;
        pool.close().await;
        return Ok(());
    }
    if args.drain_only {
        queue::drains(&pool, &url, args).await?;
        pool.close().await;
        return Ok(());
    }
    queue::enqueue_latency(&pool, args).await?;
    let claimed = queue::pickup_latency(&pool, &url, args, queue::PickupPath::Claimed).await?;
    let eager = queue::pickup_latency(&pool, &url, args, queue::PickupPath::Eager).await?;
    queue::pickup_latency(&pool, &url, args, queue::PickupPath::Polled).await?;
    let mut graphile = match args.compare {
        Compare::Graphile => graphile::Graphile::prepare(server_url, args).await?,
        Compare::None => None,
    };
    let (ours, theirs) = queue::throughput(&pool, &url, args, graphile.as_mut()).await?;
    if let Some(g) = graphile.as_mut() {
        g.compare(args, &ours, &theirs, claimed, eager).await?;
    }
    if args.queue_only {
        pool.close().await;
        return Ok(());
    }
    stream::stream_latency(&pool, &url).await?;
    hostile::hostile(&pool, &url, args).await?;
    queue::sigkill_to_failed(&pool, &url, db_args, args).await?;
    durable::durable(&pool, &url, db_args, args).await?;
    approvals::approvals(&pool, &url, db_args, args).await?;
    sandbox::sandbox(&pool, &url, db_args, args).await?;
    tools::tools(args).await?;
    guests::guests(&pool, &url, db_args, args).await?;

    pool.close().await;
    Ok(())
}
