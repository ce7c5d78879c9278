//! What every HTTP handler shares: the engine, the sessions, the configuration and the start time.
//!
//! Key choice: this sits below both the server and the route modules, so that dependencies point one
//! way: `server` builds the state and mounts the routes, the routes (`agent_routes`, `openai`) read the
//! state, and neither this file nor the routes import `server`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::Config;
use crate::engine::{BackendFactory, Engine};
use crate::metrics::Metrics;
use crate::sessions::SessionStore;

/// What every handler shares.
pub struct AppState {
    pub engine: Engine,
    pub sessions: SessionStore,
    pub config: Config,
    /// Unix seconds when the server started.
    pub started: u64,
}

impl AppState {
    pub fn new(config: Config, factory: BackendFactory) -> Self {
        let metrics = Arc::new(Metrics::default());
        let engine = Engine::start(factory, config.max_queue as usize, config.max_batch as usize, metrics);
        let sessions = SessionStore::new(Duration::from_secs(config.session_ttl), config.max_sessions);
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Self { engine, sessions, config, started }
    }
}
