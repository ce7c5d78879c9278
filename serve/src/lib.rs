//! askgui-serve: the next GUI action over HTTP.
//!
//! Layers (ARCHITECTURE.md, "Serving"): actix-web handlers -> the engine (a bounded queue and one backend
//! thread) -> a [`backend::Backend`] that owns the model ([`model_backend::ModelBackend`]).

pub mod backend;
pub mod model_backend;
