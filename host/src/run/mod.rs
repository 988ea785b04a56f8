//! A run's host side: what a claimed run may do, and how it can fail.
//!
//! - [`error`]: refusals and failure reasons (a leaf: imports nothing of the crate).

pub mod error;
