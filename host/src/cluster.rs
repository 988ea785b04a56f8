//! A private PostgreSQL cluster for when no `DATABASE_URL` is given: started
//! from the system's server binaries in a data directory of ours, reused when
//! the host restarts with the same directory, stopped when the host exits
//! (even by SIGKILL: a guard process waits on a pipe only we hold).
//!
//! PostgreSQL refuses to run as root, so as root the cluster runs as the
//! `postgres` account, which then owns the data directory.
//!
//! It admits only the host: it listens on 127.0.0.1 alone (no Unix socket)
//! and asks every connection for a password (SCRAM), which the host
//! generated at `initdb` and keeps in `<dir>/pg.password`, readable by the
//! host's user alone (mode 0600). A cluster made by an earlier host with
//! trust authentication is given a password the first time it is opened
//! ([`Cluster::ensure_database`]).

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use nix::unistd::{Gid, Uid, User};

/// Name of the database the host uses inside its private cluster.
pub const DATABASE: &str = "agent_host";
const INSTALL_HINT: &str = "install Debian's `postgresql` package (apt-get install postgresql), \
     point AGENT_HOST_PG_BIN at the directory holding initdb and pg_ctl, \
     or set DATABASE_URL to use an existing server";

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("PostgreSQL server binaries (initdb, pg_ctl) not found: {INSTALL_HINT}")]
    BinariesMissing,
    #[error("running as root, PostgreSQL must run as an unprivileged user, and no `postgres` account exists: create one (useradd postgres) or set DATABASE_URL")]
    NoUnprivilegedUser,
    #[error("{what} failed ({status}); see {log}")]
    Command { what: String, status: String, log: String },
    #[error("cluster I/O on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// Options for a private cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Directory that holds the cluster (`<dir>/pg`) and its log.
    pub dir: PathBuf,
    /// Trade durability for speed (fsync off): for tests only.
    pub ephemeral: bool,
    /// Delete the directory when the cluster stops: for tests only.
    pub remove_on_exit: bool,
}

/// A running private cluster. Dropping it (or the process dying) stops it.
pub struct Cluster {
    pgdata: PathBuf,
    bin_dir: PathBuf,
    port: u16,
    run_as: Option<(Uid, Gid)>,
    /// Holding the write end of the guard's stdin keeps the guard waiting;
    /// when this process ends, for whatever reason, the guard stops the cluster.
    guard: Option<Child>,
    /// The `postgres` role's password, from `<dir>/pg.password`.
    password: String,
    /// An earlier host's cluster still on trust authentication: given a
    /// password (and SCRAM) by [`Cluster::ensure_database`].
    trusting: bool,
    password_file: PathBuf,
}

/// Bytes of randomness in a generated password (written as hex).
const PASSWORD_BYTES: usize = 32;

/// The authentication every connection meets: TCP from this machine only,
/// with the password (there is no Unix socket).
const HBA: &str = "# agent-host private cluster: only the host, by password
    host all all 127.0.0.1/32 scram-sha-256
    host all all ::1/128 scram-sha-256
";

/// A new random password (hex).
fn new_password() -> String {
    let bytes: [u8; PASSWORD_BYTES] = rand::random();
    hex::encode(bytes)
}

/// Writes `text` to a new file at `path` readable and writable by its owner alone.
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()
}

impl Cluster {
    pub fn start(opts: &ClusterOptions) -> Result<Cluster, ClusterError> {
        let bin_dir = find_bin_dir().ok_or(ClusterError::BinariesMissing)?;
        let run_as = if Uid::effective().is_root() {
            let user = User::from_name("postgres").ok().flatten().ok_or(ClusterError::NoUnprivilegedUser)?;
            Some((user.uid, user.gid))
        } else {
            None
        };
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ClusterError::Io { path, source }
        };
        std::fs::create_dir_all(&opts.dir).map_err(io(&opts.dir))?;
        let dir = opts.dir.canonicalize().map_err(io(&opts.dir))?;
        let pgdata = dir.join("pg");
        if let Some((uid, gid)) = run_as {
            // The server's account must be able to reach its data directory.
            for ancestor in dir.ancestors() {
                let meta = std::fs::metadata(ancestor).map_err(io(ancestor))?;
                let mode = meta.permissions().mode();
                if mode & 0o001 == 0 {
                    std::fs::set_permissions(ancestor, std::fs::Permissions::from_mode(mode | 0o011))
                        .map_err(io(ancestor))?;
                }
            }
            if !pgdata.exists() {
                std::fs::create_dir(&pgdata).map_err(io(&pgdata))?;
            }
            nix::unistd::chown(&pgdata, Some(uid), Some(gid))
                .map_err(|e| ClusterError::Io { path: pgdata.clone(), source: e.into() })?;
            std::fs::set_permissions(&pgdata, std::fs::Permissions::from_mode(0o700)).map_err(io(&pgdata))?;
        }
        let password_file = dir.join("pg.password");
        let mut cluster = Cluster {
            pgdata,
            bin_dir,
            port: 0,
            run_as,
            guard: None,
            password: String::new(),
            trusting: false,
            password_file: password_file.clone(),
        };
        let log = cluster.log_path();

        if !cluster.pgdata.join("PG_VERSION").exists() {
            let password = new_password();
            // initdb reads the password from a file the server's account
            // can read: a private copy, removed once it has been read.
            let pwfile = dir.join(format!("pg.password.{}.initdb", std::process::id()));
            write_private(&pwfile, &password).map_err(io(&pwfile))?;
            if let Some((uid, gid)) = run_as {
                nix::unistd::chown(&pwfile, Some(uid), Some(gid))
                    .map_err(|e| ClusterError::Io { path: pwfile.clone(), source: e.into() })?;
            }
            let mut initdb = cluster.command("initdb");
            initdb
                .arg("-D")
                .arg(&cluster.pgdata)
                .args(["-U", "postgres", "--auth=scram-sha-256", "-E", "UTF8", "--locale=C"])
                .arg(format!("--pwfile={}", pwfile.display()));
            if opts.ephemeral {
                initdb.arg("--no-sync");
            }
            // The password is kept before the cluster that asks for it exists:
            // a host that dies between the two leaves a cluster it can open.
            write_private(&password_file, &password).map_err(io(&password_file))?;
            let made = cluster.run(initdb, "initdb");
            let _ = std::fs::remove_file(&pwfile);
            if made.is_err() {
                let _ = std::fs::remove_file(&password_file);
            }
            made?;
            let hba = cluster.pgdata.join("pg_hba.conf");
            std::fs::write(&hba, HBA).map_err(io(&hba))?;
            let mut conf = String::from(
                "\n# agent-host private cluster\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\nmax_connections = 300\n",
            );
            if opts.ephemeral {
                conf.push_str("fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n");
            }
            let conf_path = cluster.pgdata.join("postgresql.conf");
            let mut existing = std::fs::read_to_string(&conf_path).map_err(io(&conf_path))?;
            existing.push_str(&conf);
            std::fs::write(&conf_path, existing).map_err(io(&conf_path))?;
        }

        match std::fs::read_to_string(&password_file) {
            Ok(p) => cluster.password = p.trim().to_string(),
            // A cluster an earlier host made, with trust authentication.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => cluster.trusting = true,
            Err(e) => return Err(ClusterError::Io { path: password_file, source: e }),
        }

        let started_here = match cluster.running_port() {
            // Someone else's running cluster (another host on this directory):
            // use it, and leave stopping it to whoever started it.
            Some(port) => {
                cluster.port = port;
                false
            }
            None => {
                cluster.port = free_port().map_err(io(&cluster.pgdata))?;
                let mut start = cluster.command("pg_ctl");
                start
                    .arg("-D")
                    .arg(&cluster.pgdata)
                    .arg("-l")
                    .arg(&log)
                    .args(["-w", "-t", "60", "-o"])
                    .arg(format!("-p {}", cluster.port))
                    .arg("start");
                cluster.run(start, "pg_ctl start")?;
                true
            }
        };
        if !started_here {
            return Ok(cluster);
        }

        // The guard: waits for EOF on stdin, which comes when this process
        // exits however it exits, then stops the cluster. It runs as us; the
        // server's own commands run as the server's account.
        let as_server = if cluster.run_as.is_some() { "runuser -u postgres -- " } else { "" };
        let pg_ctl = cluster.bin_dir.join("pg_ctl");
        let script = if opts.remove_on_exit {
            format!(
                "cat >/dev/null; {as_server}'{}' -D '{}' -m immediate -w stop >/dev/null 2>&1; rm -rf '{}'",
                pg_ctl.display(),
                cluster.pgdata.display(),
                dir.display()
            )
        } else {
            format!(
                "cat >/dev/null; {as_server}'{}' -D '{}' -m fast -w stop >/dev/null 2>&1",
                pg_ctl.display(),
                cluster.pgdata.display()
            )
        };
        let mut guard = Command::new("sh");
        guard
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .current_dir("/")
            // Its own process group: a Ctrl-C aimed at the host must not
            // stop the database under a draining host.
            .process_group(0);
        cluster.guard = Some(guard.spawn().map_err(io(Path::new("sh")))?);
        Ok(cluster)
    }

    /// Connection URL for a database of this cluster, with the password:
    /// not for logs (see [`Cluster::port`]).
    pub fn url(&self, database: &str) -> String {
        match self.password.is_empty() {
            true => format!("postgres://postgres@127.0.0.1:{}/{}", self.port, database),
            false => format!("postgres://postgres:{}@127.0.0.1:{}/{}", self.password, self.port, database),
        }
    }

    /// Creates `database` unless it exists (and first gives a cluster still
    /// on trust authentication its password).
    pub async fn ensure_database(&mut self, database: &str) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        if self.trusting {
            self.secure().await?;
        }
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres")).await?;
        let exists: bool = sqlx::query_scalar("SELECT exists (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(database)
            .fetch_one(&mut conn)
            .await?;
        if !exists {
            // Identifiers cannot be bound; quote it.
            let quoted = format!("\"{}\"", database.replace('"', "\"\""));
            sqlx::query(&format!("CREATE DATABASE {quoted}")).execute(&mut conn).await?;
        }
        conn.close().await
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A cluster an earlier host made with trust authentication: the
    /// `postgres` role gets a new password, kept in `pg.password` (0600),
    /// and `pg_hba.conf` asks every connection for it from the reload on.
    async fn secure(&mut self) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        let io = |e: std::io::Error| sqlx::Error::Io(e);
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres")).await?;
        let password = new_password();
        // Never in the server's log, whatever its settings say.
        sqlx::query("SET log_statement = 'none'").execute(&mut conn).await?;
        sqlx::query("SET log_min_error_statement = 'panic'").execute(&mut conn).await?;
        // A hex string: nothing in it needs quoting.
        sqlx::query(&format!("ALTER ROLE postgres PASSWORD '{password}'")).execute(&mut conn).await?;
        write_private(&self.password_file, &password).map_err(io)?;
        let hba = self.pgdata.join("pg_hba.conf");
        std::fs::write(&hba, HBA).map_err(io)?;
        sqlx::query("SELECT pg_reload_conf()").execute(&mut conn).await?;
        conn.close().await?;
        self.password = password;
        self.trusting = false;
        tracing::warn!(file = %self.password_file.display(), "the private cluster used trust authentication: it now asks for a password");
        Ok(())
    }

    pub fn log_path(&self) -> PathBuf {
        self.pgdata.join("server.log")
    }

    /// Restarts the server on the same port (fast shutdown: every connection
    /// is cut). For the fault tests, which restart PostgreSQL under live hosts.
    pub fn restart(&self) -> Result<(), ClusterError> {
        let mut restart = self.command("pg_ctl");
        restart
            .arg("-D")
            .arg(&self.pgdata)
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "-m", "fast", "-o"])
            .arg(format!("-p {}", self.port))
            .arg("restart");
        self.run(restart, "pg_ctl restart")
    }

    /// Crashes the server and starts it again on the same port: an
    /// immediate stop (no shutdown checkpoint, WAL not flushed past what was
    /// flushed, as a power cut would leave it), then crash recovery at start.
    /// For the tests of what survives a crash.
    pub fn crash_restart(&self) -> Result<(), ClusterError> {
        let mut stop = self.command("pg_ctl");
        stop.arg("-D").arg(&self.pgdata).args(["-w", "-t", "60", "-m", "immediate", "stop"]);
        self.run(stop, "pg_ctl stop -m immediate")?;
        let mut start = self.command("pg_ctl");
        start
            .arg("-D")
            .arg(&self.pgdata)
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "-o"])
            .arg(format!("-p {}", self.port))
            .arg("start");
        self.run(start, "pg_ctl start")
    }

    /// Stops the cluster now (fast shutdown) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut guard) = self.guard.take() {
            drop(guard.stdin.take());
            let _ = guard.wait();
        }
    }

    fn running_port(&self) -> Option<u16> {
        let mut status = self.command("pg_ctl");
        status.arg("-D").arg(&self.pgdata).arg("status");
        let out = status.stdout(Stdio::null()).stderr(Stdio::null()).status().ok()?;
        if !out.success() {
            return None;
        }
        // postmaster.pid: line 4 is the port.
        let pid = std::fs::read_to_string(self.pgdata.join("postmaster.pid")).ok()?;
        pid.lines().nth(3)?.trim().parse().ok()
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(program));
        cmd.current_dir("/").env_remove("PGDATA").process_group(0);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid.as_raw()).gid(gid.as_raw());
        }
        cmd
    }

    fn run(&self, mut cmd: Command, what: &str) -> Result<(), ClusterError> {
        let out = cmd.output().map_err(|source| ClusterError::Io { path: PathBuf::from(what), source })?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        Err(ClusterError::Command {
            what: what.to_string(),
            status: format!("{}: {}", out.status, stderr.trim()),
            log: self.log_path().display().to_string(),
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Finds the directory of `initdb` and `pg_ctl`: `AGENT_HOST_PG_BIN`, then
/// `PATH`, then Debian's `/usr/lib/postgresql/<version>/bin` (newest first).
fn find_bin_dir() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(dir) = std::env::var_os("AGENT_HOST_PG_BIN") {
        let dir = PathBuf::from(dir);
        return has_both(&dir).then_some(dir);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if has_both(&dir) {
                return Some(dir);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, dir)| has_both(dir))
        .collect();
    versions.sort();
    versions.pop().map(|(_, dir)| dir)
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
