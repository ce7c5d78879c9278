//! The server's settings: command-line flags, each also readable from an `ASKGUI_SERVE_*` environment
//! variable (clap `env`), so a container can be configured without a command line.
//!
//! The same struct is serialised (serde) into the log line written at start, with the API key redacted,
//! so a log always says what the server was running with. `predict` is a subcommand for one step without
//! a server (a smoke test of a checkpoint).

use std::path::PathBuf;

use askgui_data::prompt::SystemPrompt;
pub use askgui_data::AdapterArg;
use askgui_data::{ActionLanguage, FrameKind};
use askgui_model::{DTypeChoice, DeviceKind, KernelChoice, Quantize};
use clap::{Args, Parser, Subcommand};
use serde::{Serialize, Serializer};

/// The command line of `askgui-serve`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "askgui-serve",
    version,
    about = "askgui's inference server: the next GUI action over HTTP",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(flatten)]
    pub serve: Config,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Load the model and answer one step for a screenshot, with no server; prints the JSON answer.
    Predict(PredictArgs),
}

fn redact<S: Serializer>(key: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(_) => s.serialize_str("<redacted>"),
        None => s.serialize_none(),
    }
}

/// Everything the server runs with.
#[derive(Args, Debug, Clone, Serialize)]
pub struct Config {
    /// The base model: a local checkpoint directory or a hub id (required to serve).
    // Not `required`: clap would then demand it before `predict` too; `check` enforces it.
    #[arg(long, env = "ASKGUI_SERVE_MODEL", default_value = "")]
    pub model: String,
    /// A LoRA adapter, NAME=DIR, or DIR named after its folder (repeat the flag; comma-separated in the
    /// environment variable). Requests pick it by NAME.
    #[arg(long = "adapter", env = "ASKGUI_SERVE_ADAPTERS", value_delimiter = ',')]
    pub adapters: Vec<AdapterArg>,
    /// The address to listen on (0.0.0.0: every interface).
    #[arg(long, env = "ASKGUI_SERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// The port to listen on.
    #[arg(long, env = "ASKGUI_SERVE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// When set, every endpoint but /health and /metrics needs `Authorization: Bearer KEY`.
    #[arg(long, env = "ASKGUI_SERVE_API_KEY", hide_env_values = true)]
    #[serde(serialize_with = "redact")]
    pub api_key: Option<String>,
    /// The most jobs the backend decodes together (continuous batching: new jobs join between forwards).
    #[arg(long, env = "ASKGUI_SERVE_MAX_BATCH", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batch: u32,
    /// MiB of prompt KV caches kept, so that a prompt sharing a beginning with a recent one prefills
    /// only the rest (0: off).
    #[arg(long, env = "ASKGUI_SERVE_PREFIX_CACHE_MB", default_value_t = 256)]
    pub prefix_cache_mb: usize,
    /// MiB for the KV caches of every running job and cached prefix together; a prompt that does not fit
    /// drops cached prefixes, then is answered 503 with Retry-After (0: no bound).
    #[arg(long, env = "ASKGUI_SERVE_KV_CACHE_MB", default_value_t = 4096.0)]
    pub kv_cache_mb: f64,
    /// Jobs waiting for the backend beyond this are refused with 429.
    #[arg(long, env = "ASKGUI_SERVE_MAX_QUEUE", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_queue: u32,
    /// Images with more pixels (width x height, read from the header before decoding) are refused.
    #[arg(long, env = "ASKGUI_SERVE_MAX_IMAGE_PIXELS", default_value_t = 16_777_216)]
    pub max_image_pixels: u64,
    /// A session is forgotten after this many idle seconds.
    #[arg(long, env = "ASKGUI_SERVE_SESSION_TTL", default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    pub session_ttl: u64,
    /// The most live sessions; creating one more is refused with 429.
    #[arg(long, env = "ASKGUI_SERVE_MAX_SESSIONS", default_value_t = 1024)]
    pub max_sessions: usize,
    /// The largest request body (JSON with base64 images), in bytes; larger bodies get 413.
    #[arg(long, env = "ASKGUI_SERVE_MAX_BODY_BYTES", default_value_t = 33_554_432)]
    pub max_body_bytes: usize,
    /// The answer length, in tokens, when a request does not say.
    #[arg(long, env = "ASKGUI_SERVE_MAX_TOKENS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// HTTP worker threads (0: one per CPU core).
    #[arg(long, env = "ASKGUI_SERVE_WORKERS", default_value_t = 0)]
    pub workers: usize,
    /// The system prompt the model was trained with (`compact`: the demo's models) [default: the
    /// askgui.json of the adapters or of the model folder, else full].
    #[arg(long, env = "ASKGUI_SERVE_SYSTEM_PROMPT", value_enum)]
    pub system_prompt: Option<SystemPrompt>,
    /// The image processor's min_pixels [default: the askgui.json of the adapters or of the model folder,
    /// else the checkpoint's preprocessor_config.json].
    #[arg(long, env = "ASKGUI_SERVE_MIN_PIXELS")]
    pub min_pixels: Option<usize>,
    /// The image processor's max_pixels (the model's view of a screenshot) [default: as --min-pixels].
    #[arg(long, env = "ASKGUI_SERVE_MAX_PIXELS")]
    pub max_pixels: Option<usize>,
    /// The coordinate frame the model reads and writes [default: the askgui.json of the adapters or of
    /// the model folder, else resized].
    #[arg(long, env = "ASKGUI_SERVE_FRAME", value_enum)]
    pub frame: Option<FrameKind>,
    /// The action language the model writes (the OpenAI endpoint returns its text, the agent API the
    /// action) [default: the askgui.json of the adapters or of the model folder, else askgui].
    #[arg(long, env = "ASKGUI_SERVE_ACTION_LANGUAGE", value_enum)]
    pub action_language: Option<ActionLanguage>,
    /// Whether a request's element list goes into the prompt [default: the askgui.json of the adapters or
    /// of the model folder, else true].
    #[arg(long, env = "ASKGUI_SERVE_ELEMENTS", num_args = 0..=1, default_missing_value = "true")]
    pub elements: Option<bool>,
    /// Earlier screenshots a step's prompt shows before the current one (`--history-images` of training)
    /// [default: the askgui.json of the adapters or of the model folder, else 0].
    #[arg(long, env = "ASKGUI_SERVE_HISTORY_IMAGES")]
    pub history_images: Option<usize>,
    /// The pause threshold of requests that give none: `ask` exactly when p(ask) is at least this
    /// [default: each adapter's calibrated level in its askgui.json, else the model's own choice].
    #[arg(long, env = "ASKGUI_SERVE_PAUSE_THRESHOLD")]
    pub pause_threshold: Option<f64>,
    /// Where the model runs: `auto` is the first CUDA GPU when the binary is built with
    /// `--features cuda` and one is present, else the CPU.
    #[arg(long, env = "ASKGUI_SERVE_DEVICE", value_enum, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// Weight dtype: `auto` is bf16 on a GPU and f32 on the CPU.
    #[arg(long, env = "ASKGUI_SERVE_DTYPE", value_enum, default_value_t = DTypeChoice::Auto)]
    pub dtype: DTypeChoice,
    /// Chunked prefill: a new prompt runs at most this many tokens per forward, so that the answers
    /// being decoded beside it wait for one chunk per step, not for the whole prompt.
    #[arg(long, env = "ASKGUI_SERVE_PREFILL_CHUNK", default_value_t = crate::model_backend::PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// `int8`: weight-only int8 linears (per-row scales, f32 accumulation), a quarter of f32's weight
    /// bytes, for local CPU serving; embeddings and norms stay in --dtype. See the README for its error.
    #[arg(long, env = "ASKGUI_SERVE_QUANTIZE", value_enum, default_value_t = Quantize::None)]
    pub quantize: Quantize,
    /// `reference` runs plain-candle ops instead of askgui's kernels (slower; for a GPU they fail on).
    #[arg(long, env = "ASKGUI_SERVE_KERNELS", value_enum, default_value_t = KernelChoice::Askgui)]
    pub kernels: KernelChoice,
    /// Log request fields the server does not know, instead of refusing the request with a 400.
    #[arg(long, env = "ASKGUI_SERVE_LENIENT_REQUESTS")]
    pub lenient_requests: bool,
    /// When the model fails to load, keep serving /health and 503s instead of exiting non-zero.
    #[arg(long, env = "ASKGUI_SERVE_STAY_UP_ON_LOAD_FAILURE")]
    pub stay_up_on_load_failure: bool,
    /// Do not serve the playground page at `/` (the API only).
    #[arg(long, env = "ASKGUI_SERVE_NO_UI")]
    pub no_ui: bool,
    /// Serve the deterministic stub backend instead of a model (front-end development, smoke tests).
    #[arg(long, env = "ASKGUI_SERVE_STUB", hide = true)]
    pub stub: bool,
}

impl Config {
    /// The defaults of every flag, for `model` (tests and `predict`).
    pub fn for_model(model: impl Into<String>) -> Self {
        let mut cfg = Cli::parse_from(["askgui-serve", "--model", "x"]).serve;
        cfg.model = model.into();
        cfg
    }

    /// What clap cannot check: a model, distinct adapter names, usable limits.
    pub fn check(&self) -> Result<(), String> {
        if self.model.trim().is_empty() {
            return Err("--model (or ASKGUI_SERVE_MODEL) is required: a checkpoint directory or a hub id".into());
        }
        for (i, a) in self.adapters.iter().enumerate() {
            if self.adapters[..i].iter().any(|b| b.name == a.name) {
                return Err(format!("adapter `{}` is given twice", a.name));
            }
            if a.name == self.model {
                return Err(format!("adapter `{}` has the base model's name", a.name));
            }
        }
        if self.pause_threshold.is_some_and(|t| !(0.0..=1.0).contains(&t)) {
            return Err(format!("--pause-threshold {}: give a probability from 0 to 1", self.pause_threshold.unwrap()));
        }
        if self.max_image_pixels == 0 {
            return Err("--max-image-pixels must be at least 1".into());
        }
        if self.max_body_bytes < 1024 {
            return Err(format!(
                "--max-body-bytes {} is too small for any request (at least 1024)",
                self.max_body_bytes
            ));
        }
        Ok(())
    }

    /// The settings as one JSON line, the API key redacted.
    pub fn to_log_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("<config not serialisable: {e}>"))
    }
}

/// `askgui-serve predict`.
#[derive(Args, Debug, Clone)]
pub struct PredictArgs {
    /// The base model: a local checkpoint directory or a hub id.
    #[arg(long, env = "ASKGUI_SERVE_MODEL")]
    pub model: String,
    /// The screenshot (PNG or JPEG).
    #[arg(long)]
    pub image: PathBuf,
    /// The task, as a user would give it.
    #[arg(long)]
    pub task: String,
    /// A LoRA adapter to answer with: NAME=DIR, or DIR named after its folder.
    #[arg(long)]
    pub adapter: Option<AdapterArg>,
    /// The longest answer, in tokens.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Serve the deterministic stub backend instead of a model.
    #[arg(long, hide = true)]
    pub stub: bool,
}

impl PredictArgs {
    /// The adapter's name.
    pub fn adapter_name(&self) -> Option<String> {
        self.adapter.as_ref().map(|a| a.name.clone())
    }

    /// The server settings a backend is loaded with for this one step.
    pub fn config(&self) -> Config {
        let mut cfg = Config::for_model(self.model.clone());
        cfg.adapters = self.adapter.iter().cloned().collect();
        cfg.max_batch = 1;
        cfg.max_tokens = self.max_tokens;
        cfg.stub = self.stub;
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_with_defaults_and_adapters() {
        let cli = Cli::parse_from([
            "askgui-serve",
            "--model",
            "m",
            "--adapter",
            "a=/x/a",
            "--adapter",
            "b=rel/b",
            "--api-key",
            "secret",
            "--port",
            "0",
        ]);
        assert!(cli.command.is_none());
        let c = cli.serve;
        assert_eq!(c.model, "m");
        assert_eq!(c.adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!((c.port, c.max_batch, c.max_queue, c.max_tokens), (0, 16, 64, 256));
        assert_eq!((c.max_image_pixels, c.session_ttl, c.max_sessions), (16_777_216, 1800, 1024));
        assert_eq!(c.max_body_bytes, 33_554_432);
        let line = c.to_log_line();
        assert!(line.contains("<redacted>") && !line.contains("secret"), "{line}");
    }

    #[test]
    fn predict_needs_no_server_flags() {
        let cli = Cli::parse_from(["askgui-serve", "predict", "--model", "m", "--image", "s.png", "--task", "t"]);
        let Some(Command::Predict(p)) = cli.command else { panic!("not predict") };
        assert_eq!((p.model.as_str(), p.task.as_str()), ("m", "t"));
        // The one adapter syntax: a bare folder is named after itself, NAME=DIR names it.
        for (flag, name, dir) in [("/a/navi-lora", "navi-lora", "/a/navi-lora"), ("ask=/a/x", "ask", "/a/x")] {
            let cli = Cli::parse_from([
                "askgui-serve",
                "predict",
                "--model",
                "m",
                "--image",
                "s",
                "--task",
                "t",
                "--adapter",
                flag,
            ]);
            let Some(Command::Predict(p)) = cli.command else { panic!("not predict") };
            let want = AdapterArg { name: name.into(), dir: dir.into() };
            assert_eq!((p.adapter_name().as_deref(), p.config().adapters), (Some(name), vec![want]));
        }
    }

    #[test]
    fn a_bare_adapter_folder_is_served_under_its_folder_name() {
        let c =
            Cli::parse_from(["askgui-serve", "--model", "m", "--adapter", "runs/demo/adapter/", "--adapter", "b=x"])
                .serve;
        let names: Vec<&str> = c.adapters.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["adapter", "b"]);
        assert_eq!(c.adapters[0].dir, PathBuf::from("runs/demo/adapter/"));
    }

    #[test]
    fn the_default_address_is_the_playground_url_the_demo_prints() {
        // askgui-train demo ends with "open http://127.0.0.1:8000/" (train/src/demo.rs, PLAYGROUND_URL)
        // after a serve command without --host or --port.
        let c = Cli::parse_from(["askgui-serve", "--model", "m"]).serve;
        assert_eq!(format!("http://{}:{}/", c.host, c.port), "http://127.0.0.1:8000/");
        assert!(!c.no_ui, "the page is served by default");
    }

    #[test]
    fn every_card_setting_has_a_flag() {
        let c = Cli::parse_from([
            "askgui-serve",
            "--model",
            "m",
            "--system-prompt",
            "compact",
            "--frame",
            "relative1000",
            "--min-pixels",
            "3136",
            "--max-pixels",
            "12544",
            "--elements",
            "false",
            "--pause-threshold",
            "0.5",
        ])
        .serve;
        assert_eq!(c.system_prompt, Some(SystemPrompt::Compact));
        assert_eq!(c.frame, Some(FrameKind::Relative1000));
        assert_eq!((c.min_pixels, c.max_pixels), (Some(3136), Some(12544)));
        assert_eq!((c.elements, c.pause_threshold), (Some(false), Some(0.5)));
        // `--elements` alone is true; unset is the card's.
        assert_eq!(Cli::parse_from(["askgui-serve", "--model", "m", "--elements"]).serve.elements, Some(true));
        assert_eq!(Cli::parse_from(["askgui-serve", "--model", "m"]).serve.elements, None);
        let over = Cli::parse_from(["askgui-serve", "--model", "m", "--pause-threshold", "1.5"]).serve;
        assert!(over.check().unwrap_err().contains("from 0 to 1"));
    }

    #[test]
    fn bad_adapters_and_zero_limits_are_refused() {
        for bad in ["../x=/d", "a b=/d", "a=", "", "/models/my adapter"] {
            let e = Cli::try_parse_from(["askgui-serve", "--model", "m", "--adapter", bad]).unwrap_err().to_string();
            assert!(e.contains("NAME=DIR"), "`{bad}`: {e}");
        }
        assert!(Cli::try_parse_from(["askgui-serve", "--model", "m", "--max-batch", "0"]).is_err());
        assert!(Cli::parse_from(["askgui-serve"]).serve.check().is_err(), "the model is required");
        assert!(Cli::parse_from(["askgui-serve", "--model", "m", "--adapter", "a=x,a=y"]).serve.check().is_err());
        assert_eq!(Cli::parse_from(["askgui-serve", "--model", "m"]).serve.check(), Ok(()));
    }
}
