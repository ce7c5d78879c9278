//! `askgui.json`: the prompt and image settings an adapter (or a merged model) was trained with, written
//! beside `adapter_config.json` by askgui-train and read by askgui-eval and askgui-serve as their defaults.
//!
//! Key choice: the card holds exactly what changes what the model sees (the system prompt, the action
//! language, the coordinate frame, the history and element settings, the image processor's pixel bounds), resolved (never "0: the
//! checkpoint's"), and the one decoding default chosen on data: the pause level `askgui-eval calibrate`
//! picked on a validation split ([`CardPause`]), which a request's own `pause_threshold` overrides. Unknown keys are ignored and `version` says the layout, so an older reader loads a newer
//! card. A flag given on the command line still wins over the card, with a warning naming the setting.
//! [`AdapterArg`] is the one `--adapter NAME=DIR` (or `DIR`, named after its folder) of every binary.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::frame::FrameKind;
use crate::language::ActionLanguage;
use crate::prompt::{PromptConfig, SystemPrompt};

/// The card's file name, in an adapter or model folder.
pub const FILE: &str = "askgui.json";
/// The card layout this code writes.
pub const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CardError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not an askgui adapter card ({source}); delete it or fix it (see docs/training.md)")]
    Parse { path: String, source: serde_json::Error },
}

/// The settings an adapter was trained with.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AdapterCard {
    /// The card layout ([`VERSION`]).
    pub version: u32,
    /// The askgui release that wrote it.
    pub askgui_version: String,
    pub prompt: CardPrompt,
    pub image: CardImage,
    /// The calibrated pause level (absent until `askgui-eval calibrate` writes one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<CardPause>,
}

/// The pause level chosen on a validation split: serve and eval answer `ask` exactly when the model's
/// `ask_probability` is at least `threshold`, unless a request or flag gives its own.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CardPause {
    pub threshold: f64,
    /// The per-step ask false-positive bound it was chosen under.
    pub target_fpr: f64,
    /// The episode file it was chosen on.
    pub episodes: String,
    /// Strict ASK F1 and per-step ask FPR at `threshold` on those episodes.
    pub strict_f1: Option<f64>,
    pub fpr: Option<f64>,
    /// Whether some threshold met `target_fpr` there (else `threshold` is the one with the lowest FPR).
    pub bound_met: bool,
}

/// What the prompt renderer was given.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CardPrompt {
    pub system_prompt: SystemPrompt,
    /// The coordinate frame the model reads and writes.
    pub frame: FrameKind,
    /// Earlier screenshots shown besides the current one.
    pub history_images: usize,
    /// Whether the element list was in the prompt.
    pub elements: bool,
    /// Most recent history lines kept in training prompts (0: all); eval and serve keep every line.
    #[serde(default)]
    pub history_length: usize,
    /// The action language the model writes; absent (as in every card before languages) for askgui's
    /// JSON, so a JSON adapter's card reads as it always did.
    #[serde(default, skip_serializing_if = "is_askgui")]
    pub action_language: ActionLanguage,
}

fn is_askgui(l: &ActionLanguage) -> bool {
    *l == ActionLanguage::AskguiJson
}

/// The image processor's bounds (they decide the resized frame).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CardImage {
    pub min_pixels: usize,
    pub max_pixels: usize,
}

impl AdapterCard {
    /// The card of a run whose prompts were built with `prompt` (pixel bounds resolved) and
    /// `history_length`.
    pub fn new(prompt: &PromptConfig, history_length: usize) -> Self {
        Self {
            version: VERSION,
            askgui_version: env!("CARGO_PKG_VERSION").to_string(),
            prompt: CardPrompt {
                system_prompt: prompt.system_prompt,
                frame: prompt.frame,
                history_images: prompt.history_images,
                elements: prompt.elements,
                history_length,
                action_language: prompt.action_language,
            },
            image: CardImage { min_pixels: prompt.min_pixels, max_pixels: prompt.max_pixels },
            pause: None,
        }
    }

    /// The calibrated pause threshold, if any.
    pub fn pause_threshold(&self) -> Option<f64> {
        self.pause.as_ref().map(|p| p.threshold)
    }

    /// Writes `dir/askgui.json`.
    pub fn write(&self, dir: &Path) -> Result<(), CardError> {
        let path = dir.join(FILE);
        let text = serde_json::to_string_pretty(self).expect("the card serialises") + "\n";
        std::fs::write(&path, text).map_err(|source| CardError::Io { path: path.display().to_string(), source })
    }

    /// `dir/askgui.json`, or None when `dir` has none (an adapter from elsewhere, or an older askgui's).
    pub fn read(dir: &Path) -> Result<Option<Self>, CardError> {
        let path = dir.join(FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let p = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|source| CardError::Io { path: p.clone(), source })?;
        serde_json::from_str(&text).map(Some).map_err(|source| CardError::Parse { path: p, source })
    }
}

/// `--adapter NAME=DIR` or `--adapter DIR` (named after its folder), as every askgui binary takes it.
/// The name is what requests send in `adapter` and `model`, so it is kept to letters, digits and `-_.:`.
/// A value with `=` is always `NAME=DIR`: a folder whose path holds `=` is given with a name in front.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdapterArg {
    pub name: String,
    pub dir: PathBuf,
}

/// Why an `--adapter` value was refused; each says what to give instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterArgError {
    #[error("the adapter is empty: give NAME=DIR or DIR (e.g. ask=runs/demo/adapter)")]
    Empty,
    #[error("adapter `{0}` has an empty folder: give NAME=DIR (e.g. ask=runs/demo/adapter)")]
    EmptyDir(String),
    #[error("adapter name `{0}`: use letters, digits and - _ . : only (NAME=DIR)")]
    BadName(String),
    #[error(
        "cannot name the adapter after its folder `{0}`: give NAME=DIR with a name of letters, digits and - _ . :"
    )]
    Unnamed(String),
}

/// Whether `name` can name an adapter in requests.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
}

impl AdapterArg {
    /// The folder of an `--adapter` value, for a binary that runs one adapter and never names it (eval,
    /// merge): the same syntax, without the naming.
    pub fn dir_of(s: &str) -> Result<PathBuf, AdapterArgError> {
        Self::parts(s).map(|(_, dir)| dir)
    }

    /// The name, if the value gives one, and the folder.
    fn parts(s: &str) -> Result<(Option<String>, PathBuf), AdapterArgError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(AdapterArgError::Empty);
        }
        let Some((name, dir)) = s.split_once('=') else { return Ok((None, PathBuf::from(s))) };
        let (name, dir) = (name.trim(), dir.trim());
        if !valid_name(name) {
            return Err(AdapterArgError::BadName(name.to_string()));
        }
        if dir.is_empty() {
            return Err(AdapterArgError::EmptyDir(name.to_string()));
        }
        Ok((Some(name.to_string()), PathBuf::from(dir)))
    }
}

impl FromStr for AdapterArg {
    type Err = AdapterArgError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, dir) = Self::parts(s)?;
        if let Some(name) = name {
            return Ok(Self { name, dir });
        }
        // `.`, `..` and `dir/..` have no last component of their own: the folder they stand for has.
        let named = dir.file_name().map(PathBuf::from).or_else(|| dir.canonicalize().ok());
        let name = named.as_deref().and_then(Path::file_name).and_then(|n| n.to_str()).filter(|n| valid_name(n));
        match name {
            Some(name) => Ok(Self { name: name.to_string(), dir }),
            None => Err(AdapterArgError::Unnamed(s.trim().to_string())),
        }
    }
}

/// The prompt flags of eval and serve as given: None where the command line did not name the flag, so
/// that an adapter's card can fill it in; [`PromptConfig::default`]'s values apply where neither does.
#[derive(clap::Args, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct PromptFlags {
    /// Coordinate frame the model reads and writes [default: the adapter's askgui.json, else resized].
    #[arg(long, value_enum)]
    pub frame: Option<FrameKind>,
    /// The image processor's min_pixels [default: the adapter's askgui.json, else the checkpoint's
    /// in-process, 3136 for an endpoint].
    #[arg(long)]
    pub min_pixels: Option<usize>,
    /// The image processor's max_pixels [default: the adapter's askgui.json, else the checkpoint's
    /// in-process, 1003520 for an endpoint].
    #[arg(long)]
    pub max_pixels: Option<usize>,
    /// Earlier screenshots to include besides the current one [default: the adapter's askgui.json, else 0].
    #[arg(long)]
    pub history_images: Option<usize>,
    /// Include the element list when the step has one [default: the adapter's askgui.json, else false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub elements: Option<bool>,
    /// The system prompt (`compact`: one line, for small models trained from scratch) [default: the
    /// adapter's askgui.json, else full].
    #[arg(long, value_enum)]
    pub system_prompt: Option<SystemPrompt>,
    /// The action language the model reads and writes [default: the adapter's askgui.json, else askgui].
    #[arg(long, value_enum)]
    #[serde(default)]
    pub action_language: Option<ActionLanguage>,
}

/// The card's value where the flag is unset; the flag's, with a warning, where both are set and differ.
fn pick<T: PartialEq + Serialize + Copy>(name: &str, card: Option<T>, flag: Option<T>) -> Option<T> {
    match (card, flag) {
        (Some(c), Some(f)) if c != f => {
            let (f, c) = (flag_value(&f), flag_value(&c));
            tracing::warn!(
                "--{name} {f} overrides the adapter's askgui.json ({name} = {c}): the model was trained with {c}"
            );
            flag
        }
        (c, f) => f.or(c),
    }
}

/// A setting as its flag is written (`compact`, `relative1000`, `12544`, `true`): the serde names of
/// the settings' enums are their flag values.
pub fn flag_value<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(e) => format!("<{e}>"),
    }
}

impl PromptFlags {
    /// Every option of `cfg`, as if given on the command line.
    pub fn given(cfg: &PromptConfig) -> Self {
        Self {
            frame: Some(cfg.frame),
            min_pixels: Some(cfg.min_pixels),
            max_pixels: Some(cfg.max_pixels),
            history_images: Some(cfg.history_images),
            elements: Some(cfg.elements),
            system_prompt: Some(cfg.system_prompt),
            action_language: Some(cfg.action_language),
        }
    }

    /// These flags with `card`'s settings where a flag is unset; a flag that differs from the card wins
    /// and is warned about.
    pub fn with_card(&self, card: Option<&AdapterCard>) -> Self {
        let Some(c) = card else { return self.clone() };
        Self {
            frame: pick("frame", Some(c.prompt.frame), self.frame),
            min_pixels: pick("min-pixels", Some(c.image.min_pixels), self.min_pixels),
            max_pixels: pick("max-pixels", Some(c.image.max_pixels), self.max_pixels),
            history_images: pick("history-images", Some(c.prompt.history_images), self.history_images),
            elements: pick("elements", Some(c.prompt.elements), self.elements),
            system_prompt: pick("system-prompt", Some(c.prompt.system_prompt), self.system_prompt),
            action_language: pick("action-language", Some(c.prompt.action_language), self.action_language),
        }
    }

    /// The prompt layout: each set option, [`PromptConfig::default`]'s value for the others.
    pub fn config(&self) -> PromptConfig {
        self.config_in(PromptConfig::default().frame)
    }

    /// [`Self::config`] with `native` as the frame when none is set: the action language's own
    /// ([`ActionLanguage::native_frame`]), else the model family's (relative 0-1000 for Qwen3-VL).
    pub fn config_in(&self, native: FrameKind) -> PromptConfig {
        let d = PromptConfig::default();
        let language = self.action_language.unwrap_or(d.action_language);
        PromptConfig {
            frame: self.frame.or(language.native_frame()).unwrap_or(native),
            min_pixels: self.min_pixels.unwrap_or(d.min_pixels),
            max_pixels: self.max_pixels.unwrap_or(d.max_pixels),
            history_images: self.history_images.unwrap_or(d.history_images),
            elements: self.elements.unwrap_or(d.elements),
            system_prompt: self.system_prompt.unwrap_or(d.system_prompt),
            token_side: d.token_side,
            action_language: language,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card() -> AdapterCard {
        let p = PromptConfig { max_pixels: 57_344, system_prompt: SystemPrompt::Compact, ..Default::default() };
        AdapterCard::new(&p, 4)
    }

    #[test]
    fn a_card_round_trips_and_ignores_keys_it_does_not_know() {
        let dir = std::env::temp_dir().join(format!("askgui-card-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(AdapterCard::read(&dir).unwrap(), None);
        card().write(&dir).unwrap();
        assert_eq!(AdapterCard::read(&dir).unwrap(), Some(card()));
        let mut v: serde_json::Value = serde_json::to_value(card()).unwrap();
        v["prompt"]["a_later_setting"] = 1.into();
        v["later_section"] = serde_json::json!({"x": 1});
        std::fs::write(dir.join(FILE), v.to_string()).unwrap();
        assert_eq!(AdapterCard::read(&dir).unwrap(), Some(card()));
        std::fs::write(dir.join(FILE), "{").unwrap();
        assert!(AdapterCard::read(&dir).unwrap_err().to_string().contains(FILE));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_card_names_a_language_other_than_askguis_json() {
        let json = serde_json::to_value(card()).unwrap();
        assert!(json["prompt"].get("action_language").is_none(), "a JSON adapter's card is as before: {json}");
        let p = PromptConfig { action_language: ActionLanguage::UiTars, ..Default::default() };
        let ui_tars = AdapterCard::new(&p, 0);
        let v = serde_json::to_value(&ui_tars).unwrap();
        assert_eq!(v["prompt"]["action_language"], "ui-tars", "the flag's value");
        assert_eq!(serde_json::from_value::<AdapterCard>(v).unwrap(), ui_tars);
        let old: AdapterCard = serde_json::from_value(json).unwrap();
        assert_eq!(old.prompt.action_language, ActionLanguage::AskguiJson, "an older card reads as JSON");
    }

    #[test]
    fn an_adapter_is_name_equals_dir_or_a_folder_named_after_itself() {
        let parse = |s: &str| s.parse::<AdapterArg>();
        let arg = |name: &str, dir: &str| Ok(AdapterArg { name: name.into(), dir: dir.into() });
        assert_eq!(parse("navi=/models/navi-lora"), arg("navi", "/models/navi-lora"));
        assert_eq!(parse(" navi = rel/x "), arg("navi", "rel/x"), "spaces around the parts go");
        // Only the first `=` splits: the folder keeps the rest.
        assert_eq!(parse("a=/runs/lr=2e-4"), arg("a", "/runs/lr=2e-4"));
        // A bare folder is named after its last component, with or without a trailing slash.
        assert_eq!(parse("runs/demo/checkpoint-000100"), arg("checkpoint-000100", "runs/demo/checkpoint-000100"));
        assert_eq!(parse("runs/ask/"), arg("ask", "runs/ask/"));
        // `.` names the current folder by its own name (whatever it is here, as long as it is a valid one).
        let here = std::env::current_dir().unwrap();
        let here = here.file_name().unwrap().to_str().unwrap();
        if valid_name(here) {
            assert_eq!(parse("."), arg(here, "."));
        }
        assert_eq!(parse(""), Err(AdapterArgError::Empty));
        assert_eq!(parse("a="), Err(AdapterArgError::EmptyDir("a".into())));
        assert_eq!(parse("../x=/d"), Err(AdapterArgError::BadName("../x".into())));
        assert_eq!(parse("a b=/d"), Err(AdapterArgError::BadName("a b".into())));
        assert_eq!(parse("=/d"), Err(AdapterArgError::BadName(String::new())));
        assert_eq!(parse("/models/my adapter"), Err(AdapterArgError::Unnamed("/models/my adapter".into())));
        assert!(parse("/").unwrap_err().to_string().contains("give NAME=DIR"));
        // Where no name is needed, the folder alone is taken as it is, and NAME=DIR is checked alike.
        assert_eq!(AdapterArg::dir_of("/models/my adapter"), Ok(PathBuf::from("/models/my adapter")));
        assert_eq!(AdapterArg::dir_of("ask=runs/x"), Ok(PathBuf::from("runs/x")));
        assert_eq!(AdapterArg::dir_of("a b=/d"), Err(AdapterArgError::BadName("a b".into())));
    }

    #[test]
    fn the_card_fills_unset_flags_and_a_given_flag_wins() {
        let unset = PromptFlags::default();
        assert_eq!(unset.config(), PromptConfig::default(), "no card, no flags: today's defaults");
        let c = unset.with_card(Some(&card())).config();
        assert_eq!((c.max_pixels, c.system_prompt), (57_344, SystemPrompt::Compact));
        let flags = PromptFlags { max_pixels: Some(12_544), ..Default::default() };
        let c = flags.with_card(Some(&card())).config();
        assert_eq!((c.max_pixels, c.system_prompt), (12_544, SystemPrompt::Compact));
    }

    #[test]
    fn the_language_travels_in_the_card_and_picks_the_frame_no_one_gives() {
        let p = PromptConfig {
            action_language: ActionLanguage::ToolCall,
            frame: FrameKind::Relative1000,
            ..Default::default()
        };
        let read = PromptFlags::default().with_card(Some(&AdapterCard::new(&p, 0))).config();
        assert_eq!((read.action_language, read.frame), (ActionLanguage::ToolCall, FrameKind::Relative1000));
        // Without --frame or a card, the tool-call language points in its own 0-1000 (not the family's
        // resized pixels); a given --frame still wins.
        let flags = PromptFlags { action_language: Some(ActionLanguage::ToolCall), ..Default::default() };
        assert_eq!(flags.config_in(FrameKind::Resized).frame, FrameKind::Relative1000);
        let flags = PromptFlags { frame: Some(FrameKind::Screen), ..flags };
        assert_eq!(flags.config_in(FrameKind::Resized).frame, FrameKind::Screen);
        // askgui JSON has no frame of its own: the family's applies.
        assert_eq!(PromptFlags::default().config_in(FrameKind::Relative1000).frame, FrameKind::Relative1000);
    }
}
