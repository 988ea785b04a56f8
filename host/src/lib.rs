//! agent-host: durable AI-agent runs on plain PostgreSQL.
//!
//! A run is a row. HTTP enqueues it (`api`), a dispatcher claims it (`worker`),
//! an agent executes it behind the [`agent::Agent`] interface, and every write
//! the worker makes goes through `db`, fenced by the claim token.

pub mod agent;
pub mod api;
pub mod cli;
pub mod cluster;
pub mod db;
pub mod error;
pub mod hub;
pub mod metrics;
pub mod run;
pub mod sandbox;
pub mod service;
pub mod stream;
pub mod telemetry;
pub mod text;
pub mod tools;
pub mod worker;
