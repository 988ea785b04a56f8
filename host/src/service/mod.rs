//! Services both APIs share (the native API in `api`, the Responses API in
//! `api::responses`): enqueue (`submit`), plugin registration (`plugins`),
//! per-tenant quotas (`quota`), schedules (`schedules`), tokens with their
//! audit rows (`tokens`), and a Responses request as a submission
//! (`responses`). Text the database cannot store is refused by the rule in
//! `crate::text`. They
//! speak typed errors, never HTTP; each API maps those to its own wire answers.

pub mod children;
pub mod plugins;
pub mod quota;
pub mod responses;
pub mod schedules;
pub mod submit;
pub mod tokens;
