//! Plugin registration, written once: `POST /v1/plugins` and
//! `agent-host plugins add` both call [`register`]. It checks the name and
//! the manifest, validates the component against the world with the
//! sandbox (off the async threads), then stores it content-addressed and
//! points the name at it in its tenant or published (`db::plugins::put_as`,
//! which writes the audit row in the same transaction), and keeps the
//! validation's compiled artifact for every process (`sandbox`).

use std::sync::Arc;

use serde_json::Value;
use sqlx::PgPool;

use crate::agent::Components;
use crate::db::audit::Actor;
use crate::db::plugins::{self, PluginRow};
use crate::run::manifest::Manifest;

use crate::text::{self, Unstorable};

/// Bytes of a component: 64 MiB. An interpreter travels inside its
/// component: the Python `chat` example (componentize-py, CPython) is about
/// 19 MB and the JavaScript one (componentize-js, SpiderMonkey) 12 MB, so a
/// Python agent with a few pure-Python dependencies still fits three times
/// over, while one upload held in memory stays bounded.
pub const COMPONENT_BYTES_MAX: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Unstorable(#[from] Unstorable),
    #[error("plugin name {0:?} must be 1-63 characters of a-z, 0-9, _ and -, starting with a letter")]
    InvalidName(String),
    #[error("{0}")]
    InvalidManifest(String),
    #[error("the component is {0} bytes; the limit is {COMPONENT_BYTES_MAX}")]
    TooLarge(usize),
    /// Not a component of the world the host serves (the sandbox's words).
    #[error("{0}")]
    InvalidComponent(String),
    /// The validating task died (a panic, or the runtime is shutting down).
    #[error("validating the component stopped before it finished")]
    Interrupted,
    /// For logs only; APIs answer a fixed message.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// What can be checked without the component or the database: the name and
/// the manifest. [`register`] checks it too; a CLI calls it first to fail
/// before opening a database.
pub fn check(name: &str, manifest: &Value) -> Result<(), RegisterError> {
    text::refuse_text("name", name)?;
    text::refuse_json("manifest", manifest)?;
    if !plugins::valid_name(name) {
        return Err(RegisterError::InvalidName(name.to_string()));
    }
    check_manifest(manifest)?;
    Ok(())
}

/// A manifest as [`check`] takes it (`plugins inspect` reads one without a
/// name), parsed with its defaults filled in.
pub fn check_manifest(manifest: &Value) -> Result<Manifest, RegisterError> {
    text::refuse_json("manifest", manifest)?;
    Manifest::parse(manifest).map_err(RegisterError::InvalidManifest)
}

/// Checks, validates and stores `component` under `name` with `manifest`,
/// owned by `tenant` (`None`: published to every tenant), with `actor`'s
/// audit row.
pub async fn register(
    pool: &PgPool,
    sandbox: &Arc<dyn Components>,
    actor: &Actor,
    tenant: Option<&str>,
    name: &str,
    component: Vec<u8>,
    manifest: &Value,
) -> Result<PluginRow, RegisterError> {
    check(name, manifest)?;
    if component.len() > COMPONENT_BYTES_MAX {
        return Err(RegisterError::TooLarge(component.len()));
    }
    // Compiling is CPU work: off the async threads. The compile is the
    // digest's only one: its artifact is kept once the component is stored.
    let compiler = sandbox.clone();
    let (component, compiled) =
        tokio::task::spawn_blocking(move || compiler.compile(&component).map(|compiled| (component, compiled)))
            .await
            .map_err(|_| RegisterError::Interrupted)?
            .map_err(|e| RegisterError::InvalidComponent(e.to_string()))?;
    let row = plugins::put_as(pool, actor, tenant, name, &component, manifest).await?;
    sandbox.keep(compiled).await;
    Ok(row)
}
