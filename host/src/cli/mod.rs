//! The command line: the clap definitions with every flag's environment
//! variable and default (`args`), `serve` and the one-shot commands that
//! open the database (`serve`), the client of a running host's HTTP API
//! (`client`), the reference pages written from the code (`doc`), what a
//! plugin is and may do (`inspect`), and plugin
//! projects outside the repository: `new` and `build` (`project`) and
//! `test`, their scripted turns on a private host (`agent_test`), and
//! `dev`, the author's build-register-run loop (`dev`).

pub mod agent_test;
pub mod args;
pub mod client;
pub mod dev;
pub mod doc;
pub mod inspect;
pub mod project;
pub mod serve;
