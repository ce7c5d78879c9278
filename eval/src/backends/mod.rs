//! The agents the evaluator can run: the model in this process ([`inprocess`]), any OpenAI-compatible
//! chat-completions endpoint ([`openai`]), or an askgui-serve server through its agent API
//! ([`EndpointAgent`], wire types in `askgui_data::agent_api`), chosen from the command line by
//! [`BackendArgs`].
//!
//! The in-process agent and askgui-serve answer through the same agent runtime (`askgui_runtime`): the
//! training prompt, and the server's decoding with the options of [`DecodingArgs`], so a checkpoint is
//! scored exactly as it is served. The OpenAI backend builds the training prompt itself, decodes as the
//! endpoint does, and converts the answer from the model's coordinate frame back to screen pixels.

mod endpoint;
mod http;
pub mod inprocess;
mod memo;
pub mod openai;

use std::path::PathBuf;

use anyhow::{bail, Context};
use askgui_data::agent_api::StepOptions;
use askgui_data::prompt::StepContext;
use askgui_data::{Action, ActionLanguage, ChatMessage, FrameMap, PromptConfig, PromptFlags};
use askgui_model::{DTypeChoice, DeviceKind, KernelChoice, LoadOptions};

use crate::agent::{Agent, AgentError, Prediction, StepInput};

pub use endpoint::{EndpointAgent, EndpointConfig};
pub use inprocess::InProcessAgent;
pub use memo::MemoAgent;
pub use openai::{OpenAiAgent, OpenAiConfig};

/// Which agent to evaluate, and how to prompt it.
#[derive(clap::Args, Debug, Clone)]
pub struct BackendArgs {
    /// In-process: a Qwen2.5-VL / Qwen2-VL checkpoint directory or hub id (runs on --device).
    #[arg(long)]
    pub model: Option<String>,
    /// A LoRA adapter (PEFT format) applied to --model: DIR, or NAME=DIR as askgui-serve takes it.
    #[arg(long, value_parser = askgui_data::AdapterArg::dir_of)]
    pub adapter: Option<PathBuf>,
    /// An OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 (requests go to {base}/chat/completions).
    #[arg(long)]
    pub openai_base: Option<String>,
    /// An askgui-serve server root, e.g. http://127.0.0.1:8000 (requests go to {base}/v1/agent/step).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// The LoRA adapter --endpoint should answer with, by the name the server knows it under.
    #[arg(long)]
    pub endpoint_adapter: Option<String>,
    /// The model name to send to --openai-base.
    #[arg(long)]
    pub openai_model: Option<String>,
    /// Environment variable holding the endpoint's API key (no Authorization header when unset).
    #[arg(long, default_value = "OPENAI_API_KEY")]
    pub api_key_env: String,
    /// Per-request timeout for the endpoint, in seconds.
    #[arg(long, default_value_t = 120.0)]
    pub timeout_s: f64,
    /// Retries after the first attempt on transport errors, 429 and 5xx.
    #[arg(long, default_value_t = 2)]
    pub retries: u32,
    /// Delay before the first retry, in milliseconds; doubles on each further retry (at most 60 s).
    #[arg(long, default_value_t = 1000)]
    pub backoff_ms: u64,
    /// The longest answer, in tokens.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub decoding: DecodingArgs,
    /// Where `--model` runs: `auto` is the first CUDA GPU when the binary is built with `--features
    /// cuda` and one is present, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// Weight dtype of `--model`: `auto` is bf16 on a GPU and f32 on the CPU.
    #[arg(long, value_enum, default_value_t = DTypeChoice::Auto)]
    pub dtype: DTypeChoice,
    /// `reference` runs `--model` on plain-candle ops instead of askgui's kernels (slower; for a GPU they fail on).
    #[arg(long, value_enum, default_value_t = KernelChoice::Askgui)]
    pub kernels: KernelChoice,
    /// The prompt flags; an unset one takes the value of `--adapter`'s (or a local `--model`'s)
    /// askgui.json in-process, else its default.
    #[command(flatten)]
    pub prompt: PromptFlags,
}

/// How askgui's runtime decodes an answer (`--model` and `--endpoint`), as askgui-serve's
/// `options` do.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DecodingArgs {
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Seed of the sampler (used when --temperature is above 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// `false` lets the model write the action's arguments freely; by default they follow the action's
    /// schema, so every answer parses.
    #[arg(long)]
    pub constrain: Option<bool>,
    /// Answer `ask` exactly when the model's probability of `ask` is at least this (0..=1).
    #[arg(long)]
    pub pause_threshold: Option<f64>,
}

impl DecodingArgs {
    /// The agent API's options for answers of at most `max_tokens` tokens.
    pub fn options(&self, max_tokens: usize) -> StepOptions {
        StepOptions {
            max_tokens: Some(max_tokens),
            temperature: self.temperature,
            seed: self.seed,
            constrain: self.constrain,
            pause_threshold: self.pause_threshold,
            coordinates: None,
        }
    }

    fn given(&self) -> bool {
        self.temperature.is_some() || self.seed.is_some() || self.constrain.is_some() || self.pause_threshold.is_some()
    }
}

/// The agent named by the arguments: exactly one of `--model`, `--openai-base` and `--endpoint`.
pub fn from_args(a: &BackendArgs) -> anyhow::Result<Box<dyn Agent>> {
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let options = a.decoding.options(a.max_new_tokens);
    options.check().map_err(|e| anyhow::anyhow!("decoding flags: {e} (--temperature, --pause-threshold)"))?;
    if a.endpoint_adapter.is_some() && a.endpoint.is_none() {
        bail!("--endpoint-adapter is for --endpoint (an askgui-serve server)");
    }
    if let Some(endpoint) = &a.endpoint {
        if a.model.is_some() || a.openai_base.is_some() {
            bail!("give only one of --model (in-process), --openai-base and --endpoint (askgui-serve)");
        }
        if a.adapter.is_some() {
            bail!("--adapter applies to --model; name a server-side adapter with --endpoint-adapter");
        }
        if a.openai_model.is_some() {
            bail!("--openai-model is for --openai-base; an askgui-serve --endpoint serves its own model");
        }
        let cfg = EndpointConfig {
            base: endpoint.clone(),
            adapter: a.endpoint_adapter.clone(),
            timeout_s: a.timeout_s,
            retries: a.retries,
            backoff_ms: a.backoff_ms,
            options,
            elements: a.prompt.elements.unwrap_or(false),
            history_images: a.prompt.history_images,
        };
        return Ok(Box::new(EndpointAgent::new(cfg)?));
    }
    match (&a.model, &a.openai_base) {
        (Some(_), Some(_)) => bail!("give either --model (in-process) or --openai-base (an endpoint), not both"),
        (None, None) => bail!(
            "no agent to evaluate: give --model DIR_OR_HUB_ID (in-process), --openai-base URL --openai-model NAME \
             or --endpoint URL (askgui-serve)"
        ),
        (Some(model), None) => {
            if a.openai_model.is_some() {
                bail!("--openai-model is for --openai-base; --model runs the checkpoint in-process");
            }
            let load = LoadOptions { device: a.device, dtype: a.dtype, kernels: a.kernels };
            let agent = InProcessAgent::load(model, a.adapter.as_deref(), &a.prompt, options, load)
                .with_context(|| format!("loading --model {model}"))?;
            Ok(Box::new(agent))
        }
        (None, Some(base)) => {
            if a.adapter.is_some() {
                bail!("--adapter applies to --model; an endpoint serves its own weights");
            }
            if a.decoding.given() {
                bail!(
                    "--temperature, --seed, --constrain and --pause-threshold are askgui's decoding (--model, \
                     --endpoint); an OpenAI-compatible endpoint decodes greedily here"
                );
            }
            let Some(model) = &a.openai_model else {
                bail!("--openai-base needs --openai-model (the model name the endpoint serves)");
            };
            let cfg = OpenAiConfig {
                base: base.clone(),
                model: model.clone(),
                api_key: std::env::var(&a.api_key_env).ok().filter(|k| !k.trim().is_empty()),
                timeout_s: a.timeout_s,
                retries: a.retries,
                backoff_ms: a.backoff_ms,
                max_tokens: a.max_new_tokens,
                prompt: a.prompt.config(),
            };
            Ok(Box::new(OpenAiAgent::new(cfg)?))
        }
    }
}

/// The screenshots the prompt shows: the current one and at most `history_images` before it.
pub(crate) fn prompt_screenshots(input: &StepInput, cfg: &PromptConfig) -> Result<Vec<PathBuf>, AgentError> {
    if input.screenshots.is_empty() {
        return Err(AgentError::Input(format!(
            "episode {} step {}: no screenshot to show the agent",
            input.episode_id, input.step
        )));
    }
    let first = input.screenshots.len().saturating_sub(cfg.history_images + 1);
    Ok(input.screenshots[first..].to_vec())
}

/// The chat messages of one step in the model frame `frame` and `cfg`'s action language (the same
/// prompt training builds); a history action the language cannot say is an input error naming the step.
pub(crate) fn messages_for(
    input: &StepInput,
    cfg: &PromptConfig,
    frame: FrameMap,
    screenshots: Vec<PathBuf>,
) -> Result<Vec<ChatMessage>, AgentError> {
    let elements = if cfg.elements { input.elements.as_deref() } else { None };
    let ctx = StepContext {
        task: &input.task,
        history: &input.history,
        screenshots,
        elements,
        frame,
        system: cfg.system_prompt,
        language: cfg.action_language,
    };
    askgui_data::step_messages(&ctx)
        .map_err(|e| AgentError::Input(format!("episode {} step {}: {e}", input.episode_id, input.step)))
}

/// The prediction from a raw reply: parsed in `language`, and converted from the model frame to screen
/// pixels.
pub(crate) fn prediction_from_reply(raw: String, frame: &FrameMap, language: ActionLanguage) -> Prediction {
    match language.parse(&raw) {
        Ok(parsed) => {
            let action: Action = frame.action_to_screen(&parsed.action);
            Prediction { action: Some(action), raw, parse_error: None, ask_probability: None }
        }
        Err(e) => Prediction { action: None, raw, parse_error: Some(e.to_string()), ask_probability: None },
    }
}

/// The frame map of the step's screen under `cfg`, or an input error naming the step.
pub(crate) fn frame_for(input: &StepInput, cfg: &PromptConfig) -> Result<FrameMap, AgentError> {
    cfg.frame_map(input.screen.width, input.screen.height)
        .map_err(|e| AgentError::Input(format!("episode {} step {}: {e}", input.episode_id, input.step)))
}
