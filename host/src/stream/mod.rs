//! Streams of a run, as services any API can encode: the journal tail
//! (`tail`) and the one server-sent-events decoder (`decode`) for bodies this
//! crate reads. Wire formats live with the APIs (`api`), not here.

pub mod decode;
pub mod tail;
