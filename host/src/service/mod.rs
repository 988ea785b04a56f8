//! Services both APIs share (the native API in `api`, the Responses API
//! next): enqueue (`submit`), plugin registration (`plugins`), per-tenant quotas (`quota`), and the rule
//! for text the database cannot store (`storable`). They speak typed errors,
//! never HTTP; each API maps those to its own wire answers.

pub mod plugins;
pub mod quota;
pub mod schedules;
pub mod storable;
pub mod submit;
pub mod tokens;
