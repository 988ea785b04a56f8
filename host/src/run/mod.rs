//! A run's host side: what a claimed run may do, and how it can fail. The
//! layers import only those before them:
//! `error` -> `text` -> `manifest` -> `journal` -> (tools) -> `host`.
//!
//! - [`error`]: refusals and failure reasons (a leaf: imports nothing of the crate).
//! - [`text`]: the rule that makes guest, tool and model text storable.
//! - [`manifest`]: a plugin's grants and limits, with defaults and ceilings.
//! - [`journal`]: the run's journal writer (coalesced deltas, fenced flushes).
//! - [`host`]: [`host::RunHost`], every import a run can make.

pub mod error;
pub mod host;
pub mod journal;
pub mod manifest;
pub mod text;
