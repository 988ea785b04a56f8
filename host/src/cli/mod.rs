//! The command line: the clap definitions with every flag's environment
//! variable and default (`args`), `serve` and the one-shot commands that
//! open the database (`serve`), the client of a running host's HTTP API
//! (`client`), and the reference page written from the definitions (`doc`).

pub mod args;
pub mod client;
pub mod doc;
pub mod serve;
