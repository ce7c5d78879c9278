//! `askgui-serve`: parses the command line and hands over to the library (`server::run`, `predict`).
//!
//! The one thing decided here is which backend to load: [`load_backend`] builds it from the settings, on
//! the backend thread for the server and directly for `predict`.

use std::io::IsTerminal;

use anyhow::Context;
use askgui_serve::backend::Backend;
use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use askgui_serve::stub::StubBackend;
use askgui_serve::{BoxError, Cli, Command, Config};
use clap::Parser;

/// The backend for these settings: the deterministic stub with `--stub`, else the model.
fn load_backend(cfg: &Config) -> Result<Box<dyn Backend>, BoxError> {
    if cfg.stub {
        let names: Vec<&str> = cfg.adapters.iter().map(|a| a.name.as_str()).collect();
        tracing::warn!("serving the stub backend: its answers are fixed rules, not a model");
        let language = cfg.action_language.unwrap_or_default();
        return Ok(Box::new(StubBackend::new(&cfg.model, &names).with_language(language)));
    }
    load_model(cfg)
}

/// The model backend: the checkpoint and its adapters, on `--device`.
fn load_model(cfg: &Config) -> Result<Box<dyn Backend>, BoxError> {
    Ok(Box::new(ModelBackend::load(&ModelBackendConfig::from(cfg))?))
}

fn main() -> anyhow::Result<()> {
    askgui_model::pin_cpu_threads();
    askgui_serve::cpu::tune_for_serving();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,actix_server=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Predict(args)) => {
            let cfg = args.config();
            let mut backend = load_backend(&cfg).map_err(|e| anyhow::anyhow!(e)).context("loading the backend")?;
            let resp = askgui_serve::predict::predict(backend.as_mut(), &args)?;
            println!("{}", serde_json::to_string_pretty(&resp)?);
            Ok(())
        }
        None => {
            let cfg = cli.serve;
            cfg.check().map_err(anyhow::Error::msg)?;
            let for_thread = cfg.clone();
            let factory: askgui_serve::BackendFactory = Box::new(move || load_backend(&for_thread));
            // The error says what failed and what to do (a port in use, a model that did not load).
            actix_web::rt::System::new().block_on(askgui_serve::run(cfg, factory)).map_err(anyhow::Error::from)
        }
    }
}
