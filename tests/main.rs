//! The integration suites, one module per file, in one test binary: they
//! share `support` (a private PostgreSQL cluster for the binary, or the
//! server in DATABASE_URL; a fresh database per test) and link the host
//! once. `tests/faults.rs` is a binary of its own: it crashes and restarts
//! its cluster under whatever is connected.
//!
//! One suite: `cargo test -p agent-host --test it streams::`; one test: its
//! name, e.g. `cargo test -p agent-host --test it retention_trims`.

mod support;

mod a2a;
mod agent_test;
mod api;
mod approvals;
mod config;
mod console;
mod dev;
mod docs;
mod eager;
mod edge;
mod fork;
mod guests;
mod hooks;
mod http_tool;
mod hub;
mod inspect;
mod lifecycle;
mod mcp;
mod mcp_server;
mod models;
mod openapi;
mod operator;
mod plans;
mod processes;
mod projects;
mod responses;
mod resume;
mod run_core;
mod run_host;
mod sandbox;
mod steer;
mod stop;
mod streams;
mod subagents;
mod throughput;
mod tools;
mod traces;
