//! Streams of a run, as services any API can encode: the journal tail
//! (`tail`), the Responses API's view of a run over it (`responses`: the
//! response object and its numbered events), and the one server-sent-events
//! decoder (`decode`) for bodies this crate reads. Wire formats live with the
//! APIs (`api`), not here.

pub mod a2a;
pub mod decode;
pub mod feed;
pub mod mcp;
pub mod responses;
pub mod tail;
