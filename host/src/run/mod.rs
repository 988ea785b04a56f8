//! A run's host side: what a claimed run may do. The layers import only
//! those before them: (`crate::error`, `crate::text`) -> `config`,
//! `manifest` -> `journal` -> `record` -> (`crate::tools`) -> `host`.
//!
//! - [`config`]: [`config::RunConfig`], a run's config parsed once at claim.
//! - [`manifest`]: a plugin's grants and limits, with defaults and ceilings.
//! - [`journal`]: the run's journal writer (coalesced deltas, fenced flushes).
//! - [`record`]: a resumable run's call log: its host calls recorded, fenced,
//!   and replayed on a resumed attempt.
//! - [`host`]: [`host::RunHost`], every import a run can make.

/// Refusals and failure reasons: a leaf of the crate, re-exported here.
pub use crate::error;
pub mod config;
pub mod host;
pub mod journal;
pub mod manifest;
pub mod record;
