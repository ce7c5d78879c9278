//! askgui-serve: the next GUI action over HTTP.
//!
//! Layers (ARCHITECTURE.md, "Serving"): actix-web handlers ([`agent_routes`], [`openai`], [`server`]; what
//! they share is [`state::AppState`]) -> the engine ([`engine`]: a bounded queue and one backend thread) -> a
//! [`backend::Backend`] that owns the model ([`model_backend::ModelBackend`]; [`stub::StubBackend`] in tests).
//! Handlers parse and check requests and decode images ([`images`]); they never touch tensors. The model
//! backend batches concurrent jobs continuously ([`batcher`]) and reuses prompt prefixes ([`askgui_runtime::prefix_cache`]).
//! Request bodies are parsed strictly ([`strict`]: an unknown field is a 400 naming it). Errors map to
//! statuses in [`error`]; sessions live in [`sessions`]; Prometheus metrics in [`metrics`]; the playground
//! page in [`ui`].
//!
//! To run a server on a free port with some backend (what the tests do):
//!
//! ```no_run
//! use askgui_serve::{config::Config, server, stub::StubBackend};
//! let mut config = Config::for_model("stub-model");
//! config.port = 0;
//! let handle = server::start(config, Box::new(|| Ok(Box::new(StubBackend::new("stub-model", &[])) as _))).unwrap();
//! println!("{}", handle.url("/health"));
//! handle.stop();
//! ```

pub mod agent_routes;
pub mod backend;
pub mod batcher;
pub mod config;
pub mod cpu;
pub mod drain;
pub mod engine;
pub mod error;
pub mod images;
pub mod metrics;
pub mod model_backend;
pub mod openai;
pub mod predict;
pub mod server;
pub mod sessions;
pub mod state;
pub mod strict;
pub mod stub;
pub mod tool_calls;
pub mod ui;

pub use config::{Cli, Command, Config, PredictArgs};
pub use engine::{BackendFactory, BoxError, Engine, LoadState};
pub use server::{run, start, ServerHandle};
