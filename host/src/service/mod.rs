//! Services both APIs share (the native API in `api`, the Responses API in
//! `api::responses`): enqueue (`submit`), plugin registration (`plugins`),
//! per-tenant quotas (`quota`), the rule for text the database cannot store
//! (`storable`), and a Responses request as a submission (`responses`). They
//! speak typed errors, never HTTP; each API maps those to its own wire answers.

pub mod plugins;
pub mod quota;
pub mod responses;
pub mod schedules;
pub mod submit;
pub mod tokens;
