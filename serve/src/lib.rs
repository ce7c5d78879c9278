//! askgui-serve: the next GUI action over HTTP.
//!
//! Layers (ARCHITECTURE.md, "Serving"): actix-web handlers -> the engine ([`engine`]: a bounded queue and
//! one backend thread) -> a [`backend::Backend`] that owns the model ([`model_backend::ModelBackend`]).

pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod images;
pub mod metrics;
pub mod model_backend;
pub mod sessions;
