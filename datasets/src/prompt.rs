//! Prompt construction: from an episode step (or a live session) to chat messages, and to training
//! samples with the spans that carry loss.
//!
//! Layout of one step's prompt:
//! - system: the action space (with `ask`), the coordinate frame, the answer format;
//! - user: the task, the history (earlier actions and every ASK/SAY pair, including one asked at *this*
//!   step), the last k screenshots, the current screenshot and optionally its element list;
//! - assistant: the target action (the only text that carries loss).
//!
//! The dialogue sits in the history text, before the screenshots, and not as chat turns after them: the
//! model is causal, so only text that comes before the screen tokens can shape what they compute. An
//! answer appended after the screenshot reaches the screen only through the last positions, which a
//! small model does not learn to do (the demo acted on the answer in 35 of 189 asked steps that way).
//! The cost is one more prefill per asked step on a server that caches prompt prefixes.
//!
//! All coordinates in the prompt are in the model frame ([`FrameMap`]); datasets keep screen pixels.
//! For an ambiguous episode the annotated step gives two samples: target = the `ask`; then, with the ask
//! and the SAY turn appended to the history, target = the real action.

use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::action::{Action, Turn};
use crate::episode::{Element, LoadedEpisode};
use crate::frame::{FrameError, FrameKind, FrameMap, ResizeBounds};
use crate::language::{ActionLanguage, Inexpressible};

/// How prompts are built.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, clap::Args)]
pub struct PromptConfig {
    /// Coordinate frame the model reads and writes.
    #[arg(long, value_enum, default_value_t = FrameKind::Resized)]
    pub frame: FrameKind,
    /// The image processor's min_pixels (decides the resized frame).
    #[arg(long, default_value_t = crate::frame::DEFAULT_MIN_PIXELS)]
    pub min_pixels: usize,
    /// The image processor's max_pixels.
    #[arg(long, default_value_t = crate::frame::DEFAULT_MAX_PIXELS)]
    pub max_pixels: usize,
    /// Earlier screenshots to include besides the current one.
    #[arg(long, default_value_t = 0)]
    pub history_images: usize,
    /// Include the element list when the step has one.
    #[arg(long, default_value_t = false)]
    pub elements: bool,
    /// The system prompt: the full action space, or one line (small models trained from scratch).
    #[arg(long, value_enum, default_value_t = SystemPrompt::Full)]
    #[serde(default)]
    pub system_prompt: SystemPrompt,
    /// The side of one model token in pixels (patch x merge): the model's, not a flag.
    #[arg(skip = crate::frame::QWEN2_TOKEN_SIDE)]
    #[serde(default = "crate::frame::qwen2_token_side")]
    pub token_side: usize,
    /// The action language the model reads and writes (its system prompt, its actions' text).
    #[arg(long, value_enum, default_value_t = ActionLanguage::AskguiJson)]
    #[serde(default)]
    pub action_language: ActionLanguage,
}

/// Which system prompt the agent is given. A model must be served with the one it was trained with.
///
/// In askgui JSON `Full` is [`system_prompt`] and `Compact` is [`COMPACT_SYSTEM_PROMPT`]; every action
/// language has both ([`ActionLanguage::system_prompt`]). The variants' doc comments are `--system-prompt`'s
/// help; why `compact` exists is in docs/flags.md.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SystemPrompt {
    /// Every action with its fields, the frame and when to ask.
    #[default]
    Full,
    /// One line, for small models trained from scratch on one app world.
    Compact,
}

/// The [`SystemPrompt::Compact`] text of askgui JSON.
pub const COMPACT_SYSTEM_PROMPT: &str =
    "GUI agent. Answer with the next action as JSON; ask when the task misses a detail.";

impl Default for PromptConfig {
    fn default() -> Self {
        Self {
            frame: FrameKind::Resized,
            min_pixels: crate::frame::DEFAULT_MIN_PIXELS,
            max_pixels: crate::frame::DEFAULT_MAX_PIXELS,
            history_images: 0,
            elements: false,
            system_prompt: SystemPrompt::Full,
            token_side: crate::frame::QWEN2_TOKEN_SIDE,
            action_language: ActionLanguage::AskguiJson,
        }
    }
}

impl PromptConfig {
    pub fn frame_map(&self, width: u32, height: u32) -> Result<FrameMap, FrameError> {
        FrameMap::new(
            self.frame,
            width,
            height,
            ResizeBounds { min_pixels: self.min_pixels, max_pixels: self.max_pixels, token_side: self.token_side },
        )
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text { text: String },
    Image { path: PathBuf },
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: Vec<Part>,
    /// Whether this message is a training target.
    #[serde(default)]
    pub loss: bool,
}

impl ChatMessage {
    fn text(role: &str, text: String, loss: bool) -> Self {
        Self { role: role.into(), content: vec![Part::Text { text }], loss }
    }
}

/// The system prompt: the action space, the frame and the answer format.
pub fn system_prompt(frame: FrameKind) -> String {
    let coords = frame_sentence(frame);
    format!(
        "You are a GUI agent. You see a screenshot and a task, and you answer with the next action as one JSON object.\n\
Actions:\n\
{{\"action\":\"click\",\"x\":X,\"y\":Y}} (also long_press, double_click, right_click; \"element\":ID may name an element)\n\
{{\"action\":\"type\",\"text\":TEXT}}\n\
{{\"action\":\"scroll\",\"x\":X,\"y\":Y,\"direction\":\"up|down|left|right\"}}\n\
{{\"action\":\"swipe\",\"x1\":X1,\"y1\":Y1,\"x2\":X2,\"y2\":Y2}} (also drag)\n\
{{\"action\":\"press\",\"key\":KEY}} {{\"action\":\"hotkey\",\"keys\":[KEYS]}} {{\"action\":\"open_app\",\"name\":NAME}} {{\"action\":\"wait\",\"seconds\":S}}\n\
{{\"action\":\"ask\",\"question\":TEXT,\"options\":[{{\"label\":TEXT}}],\"kind\":\"selection|specification\"}}\n\
{{\"action\":\"answer\",\"text\":TEXT}} {{\"action\":\"done\",\"status\":\"success|infeasible\"}}\n\
When the task leaves out a detail that only the user knows and the screen does not decide it, ask instead of guessing; \
otherwise act. {coords}"
    )
}

/// The sentence of the system prompt that says the frame (every language's prompt ends with it).
pub fn frame_sentence(frame: FrameKind) -> &'static str {
    match frame {
        FrameKind::Resized => "Coordinates are absolute pixels of the screenshot as you see it.",
        FrameKind::Relative1000 => "Coordinates are relative: 0..1000 across the width and down the height.",
        FrameKind::Screen => "Coordinates are pixels of the original screen.",
    }
}

impl SystemPrompt {
    /// The system message for the coordinate frame `frame`.
    pub fn text(self, frame: FrameKind) -> String {
        match self {
            SystemPrompt::Full => system_prompt(frame),
            SystemPrompt::Compact => COMPACT_SYSTEM_PROMPT.to_string(),
        }
    }
}

/// What the agent sees at one step.
#[derive(Debug, Clone)]
pub struct StepContext<'a> {
    pub task: &'a str,
    /// Everything before this step, in screen pixels: actions, asks and SAY turns, all listed in the
    /// history text (trailing ask/say turns were asked at this very step).
    pub history: &'a [Turn],
    /// Earlier screenshots (oldest first) followed by the current one.
    pub screenshots: Vec<PathBuf>,
    pub elements: Option<&'a [Element]>,
    pub frame: FrameMap,
    pub system: SystemPrompt,
    /// The language of the system prompt and of the history's actions.
    pub language: ActionLanguage,
}

/// The history lines, each action in `language`; element ids only when the prompt lists the elements
/// (`with_ids`). An action the language cannot say is an error naming it.
fn history_text(
    turns: &[Turn],
    frame: &FrameMap,
    with_ids: bool,
    language: ActionLanguage,
) -> Result<String, Inexpressible> {
    let mut out = String::new();
    let mut n = 0;
    for t in turns {
        match t {
            Turn::Agent { action: Action::Ask(a) } => out.push_str(&format!("ASK: {}\n", a.question)),
            Turn::Agent { action } => {
                n += 1;
                let a = frame.action_to_model(action);
                let a = if with_ids { a } else { a.without_element() };
                out.push_str(&format!("{n}. {}\n", language.render(&a)?));
            }
            Turn::Say { text } => out.push_str(&format!("SAY: {text}\n")),
        }
    }
    Ok(out)
}

/// Chat messages for one step, without the target: the language's system prompt, and the history's
/// actions in the language. An earlier action the language cannot say is an error naming it.
pub fn step_messages(ctx: &StepContext) -> Result<Vec<ChatMessage>, Inexpressible> {
    let language = ctx.language;
    let mut content = vec![Part::Text { text: format!("Task: {}\n", ctx.task) }];
    if !ctx.history.is_empty() {
        let history = history_text(ctx.history, &ctx.frame, ctx.elements.is_some(), language)?;
        content.push(Part::Text { text: format!("History:\n{history}") });
    }
    let (prev, cur) = ctx.screenshots.split_at(ctx.screenshots.len().saturating_sub(1));
    for (i, p) in prev.iter().enumerate() {
        content.push(Part::Text { text: format!("Earlier screenshot {}:", prev.len() - i) });
        content.push(Part::Image { path: p.clone() });
    }
    content.push(Part::Text { text: "Current screenshot:".into() });
    content.extend(cur.iter().map(|p| Part::Image { path: p.clone() }));
    if let Some(els) = ctx.elements {
        let mut t = String::from("Elements:\n");
        for e in els {
            let (x1, y1) = ctx.frame.to_model(e.bbox[0], e.bbox[1]);
            let (x2, y2) = ctx.frame.to_model(e.bbox[2], e.bbox[3]);
            t.push_str(&format!("[{}] {} {:?} ({x1}, {y1}, {x2}, {y2})\n", e.id, e.role, e.text));
        }
        content.push(Part::Text { text: t });
    }
    content.push(Part::Text { text: "Next action?".into() });

    Ok(vec![
        ChatMessage::text("system", language.system_prompt(ctx.system, ctx.frame.kind), false),
        ChatMessage { role: "user".into(), content, loss: false },
    ])
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SampleKind {
    /// A plain step: target = the step's action.
    Act,
    /// The annotated step of an ambiguous task: target = the ask.
    Ask,
    /// The same step after the SAY turn: target = the real action.
    ActAfterSay,
    /// A later step of an ambiguous task, once a question was answered (a SAY turn in its history): target
    /// = the step's action.
    ActInDialog,
    /// [`TaskMode::Language`]: an annotated question and its answer as plain text.
    Language,
    /// [`TaskMode::Describe`]: what the screen shows.
    Describe,
}

/// One training sample: messages whose last assistant message is the target.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Sample {
    pub episode: String,
    pub step: usize,
    pub kind: SampleKind,
    pub messages: Vec<ChatMessage>,
    /// The target action in the model frame.
    pub target: Action,
}

/// Which task the samples are built on.
///
/// The variants' doc comments are `--task-mode`'s help; what each mode is for (grounding, the dialogues'
/// words, screen reading) is in docs/flags.md. A `Describe` sample's task is [`DESCRIBE_TASK`].
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum TaskMode {
    /// The ambiguous task where there is one (with ask samples), else the full task.
    #[default]
    Ambiguous,
    /// Always the full task; no ask samples.
    Full,
    /// Each step alone, its instruction ("Select Oat milk") as the task, no history: grounding practice.
    Steps,
    /// Each annotated question (the ask's JSON) and the user's answer as plain text: no system prompt,
    /// task or screenshot.
    Language,
    /// Screen reading: for each screenshot with an element list, an `answer` listing the elements'
    /// texts in order.
    Describe,
}

/// The task of a [`TaskMode::Describe`] sample.
pub const DESCRIBE_TASK: &str = "Read the screen";

/// Why an episode gives no samples: its screen has no frame, or a step's action has no words in the
/// action language (named with the step).
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("episode `{episode}` step {step}: {source}")]
    Inexpressible { episode: String, step: usize, source: Inexpressible },
}

/// Every training sample of an episode, its prompts and targets in `cfg`'s action language. A target is
/// the language's [`ActionLanguage::normal_form`] of the step's action, so that it is what parsing the
/// target text gives back.
pub fn episode_samples(ep: &LoadedEpisode, cfg: &PromptConfig, mode: TaskMode) -> Result<Vec<Sample>, SampleError> {
    let language = cfg.action_language;
    let e = &ep.episode;
    let frame = cfg.frame_map(e.screen.width, e.screen.height)?;
    let ambiguous = mode == TaskMode::Ambiguous && e.is_ambiguous();
    let task = if ambiguous { e.ambiguous_task.as_deref().unwrap_or(&e.task) } else { &e.task };
    if mode == TaskMode::Language {
        return language_samples(e, language);
    }
    let mut past: Vec<Turn> = Vec::new();
    let mut out = Vec::new();
    for (i, step) in e.steps.iter().enumerate() {
        let (task, mut history) = match (mode, step.instruction.as_deref()) {
            (TaskMode::Steps, None) => continue,
            (TaskMode::Steps, Some(instruction)) => (instruction, Vec::new()),
            (TaskMode::Describe, _) if step.elements.is_none() => continue,
            (TaskMode::Describe, _) => (DESCRIBE_TASK, Vec::new()),
            _ => (task, std::mem::take(&mut past)),
        };
        let alone = matches!(mode, TaskMode::Steps | TaskMode::Describe);
        let first = if alone { i } else { i.saturating_sub(cfg.history_images) };
        let screenshots = (first..=i).map(|j| ep.image_path(j)).collect();
        let elements = if cfg.elements { step.elements.as_deref() } else { None };
        let named = |source| SampleError::Inexpressible { episode: e.id.clone(), step: i, source };
        let mut push = |history: &[Turn], kind: SampleKind, target: &Action| -> Result<(), SampleError> {
            let ctx = StepContext {
                task,
                history,
                screenshots: Clone::clone(&screenshots),
                elements,
                frame,
                system: cfg.system_prompt,
                language,
            };
            // Without the element list in the prompt, the target is the point alone.
            let target = frame.action_to_model(target);
            let target = if elements.is_some() { target } else { target.without_element() };
            let mut messages = step_messages(&ctx).map_err(named)?;
            messages.push(ChatMessage::text("assistant", language.render(&target).map_err(named)?, true));
            let target = language.normal_form(&target);
            out.push(Sample { episode: e.id.clone(), step: i, kind, messages, target });
            Ok(())
        };
        match (&step.ask, ambiguous) {
            _ if mode == TaskMode::Describe => {
                let texts: Vec<&str> = step.elements.iter().flatten().map(|e| e.text.as_str()).collect();
                push(&history, SampleKind::Describe, &Action::Answer { text: texts.join("; ") })?;
            }
            (Some(ask), true) => {
                let ask_action = ask.action();
                push(&history, SampleKind::Ask, &ask_action)?;
                history.push(Turn::Agent { action: ask_action });
                history.push(Turn::Say { text: ask.answer.clone() });
                push(&history, SampleKind::ActAfterSay, &step.action)?;
            }
            _ => {
                let answered = history.iter().any(|t| matches!(t, Turn::Say { .. }));
                push(&history, if answered { SampleKind::ActInDialog } else { SampleKind::Act }, &step.action)?
            }
        }
        history.push(Turn::Agent { action: step.action.clone() });
        past = history;
    }
    Ok(out)
}

/// [`TaskMode::Language`] samples of an episode: one per annotated question, written in `language`.
fn language_samples(e: &crate::episode::Episode, language: ActionLanguage) -> Result<Vec<Sample>, SampleError> {
    let asks = e.steps.iter().enumerate().filter_map(|(i, s)| Some((i, s.ask.as_ref()?)));
    asks.map(|(step, ask)| {
        let target = ask.action();
        let named = |source| SampleError::Inexpressible { episode: e.id.clone(), step, source };
        let text = format!("{}\n{}", language.render(&target).map_err(named)?, ask.answer);
        Ok(Sample {
            episode: e.id.clone(),
            step,
            kind: SampleKind::Language,
            messages: vec![ChatMessage::text("assistant", text, true)],
            target,
        })
    })
    .collect()
}

/// Special strings of the Qwen2-VL chat format.
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";
/// One image placeholder; the model's processor expands the pad to one token per merged patch.
pub const IMAGE_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// A sample rendered in ChatML: the text, the byte spans that carry loss (each target's content and its
/// `<|im_end|>`), and the images in the order of their placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub loss_spans: Vec<Range<usize>>,
    pub images: Vec<PathBuf>,
}

/// Renders messages in Qwen's ChatML; with `generation_prompt`, ends with an open assistant turn.
pub fn render_chatml(messages: &[ChatMessage], generation_prompt: bool) -> Rendered {
    let mut text = String::new();
    let mut loss_spans = Vec::new();
    let mut images = Vec::new();
    for m in messages {
        text.push_str(&format!("{IM_START}{}\n", m.role));
        let start = text.len();
        for p in &m.content {
            match p {
                Part::Text { text: t } => text.push_str(t),
                Part::Image { path } => {
                    text.push_str(IMAGE_PLACEHOLDER);
                    images.push(path.clone());
                }
            }
        }
        text.push_str(IM_END);
        if m.loss {
            loss_spans.push(start..text.len());
        }
        text.push('\n');
    }
    if generation_prompt {
        text.push_str(&format!("{IM_START}assistant\n"));
    }
    Rendered { text, loss_spans, images }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::Target;
    use crate::episode::{Episode, Platform, Screen, Step, StepAsk};

    fn episode(ambiguous: bool) -> LoadedEpisode {
        let step = |x: i32, ask: Option<StepAsk>| Step {
            screenshot: format!("images/{x}.png"),
            elements: None,
            instruction: None,
            informative: Some(ask.is_some()),
            action: Action::Click(Target::point(x, 100)),
            ask,
        };
        let ask =
            StepAsk { question: "Which milk?".into(), answer: "Oat, please.".into(), options: vec![], kind: None };
        LoadedEpisode {
            episode: Episode {
                id: "e1".into(),
                platform: Platform::Android,
                screen: Screen { width: 1000, height: 2000 },
                task: "Buy oat milk".into(),
                ambiguous_task: ambiguous.then(|| "Buy milk".into()),
                steps: vec![step(10, None), step(20, Some(ask)), step(30, None)],
            },
            base: PathBuf::from("data"),
            line: 1,
        }
    }

    #[test]
    fn ambiguous_step_gives_ask_then_action_after_say() {
        let cfg = PromptConfig { frame: FrameKind::Relative1000, ..Default::default() };
        let s = episode_samples(&episode(true), &cfg, TaskMode::Ambiguous).unwrap();
        let kinds: Vec<_> = s.iter().map(|s| s.kind).collect();
        assert_eq!(kinds, [SampleKind::Act, SampleKind::Ask, SampleKind::ActAfterSay, SampleKind::ActInDialog]);
        assert!(s[1].target.is_ask());
        assert_eq!(s[2].target, Action::Click(Target::point(20, 50)), "relative frame: 20/1000 -> 20, 100/2000 -> 50");
        // The sample after SAY lists the ask and the answer as the last history lines, before the
        // screenshot, where the screen tokens can read them.
        let m = &s[2].messages;
        assert_eq!(m.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), ["system", "user", "assistant"]);
        let r = render_chatml(m, false);
        let (say, screen) = (r.text.find("ASK: Which milk?\nSAY: Oat, please.\n"), r.text.find("Current screenshot:"));
        assert!(say.is_some() && say < screen, "{}", r.text);
        assert_eq!(r.loss_spans.len(), 1);
        // The ask sample itself has no dialogue yet.
        assert!(!render_chatml(&s[1].messages, false).text.contains("ASK:"));
        // The last step lists the earlier ask/say in its history text and uses the ambiguous task.
        let r = render_chatml(&s[3].messages, false);
        assert!(
            r.text.contains("Task: Buy milk\n") && r.text.contains("ASK: Which milk?\nSAY: Oat, please.\n"),
            "{}",
            r.text
        );
        assert_eq!(r.images, [PathBuf::from("data/images/30.png")]);
        // Only the target carries loss.
        assert_eq!(r.loss_spans.len(), 1);
        assert_eq!(&r.text[r.loss_spans[0].clone()], format!("{}{IM_END}", s[3].target.render()));
        // Full mode: no ask samples.
        let s = episode_samples(&episode(true), &cfg, TaskMode::Full).unwrap();
        assert!(s.iter().all(|s| s.kind == SampleKind::Act) && s.len() == 3);
    }

    #[test]
    fn steps_mode_gives_each_instructed_step_alone() {
        let mut ep = episode(true);
        ep.episode.steps[0].instruction = Some("Open the Shop app".into());
        ep.episode.steps[1].instruction = Some("Select Oat milk".into());
        let cfg = PromptConfig { history_images: 1, ..Default::default() };
        let s = episode_samples(&ep, &cfg, TaskMode::Steps).unwrap();
        // Step 2 has no instruction; step 1's ask is not used.
        assert_eq!(
            s.iter().map(|s| (s.step, s.kind)).collect::<Vec<_>>(),
            [(0, SampleKind::Act), (1, SampleKind::Act)]
        );
        let r = render_chatml(&s[1].messages, false);
        assert!(r.text.contains("Task: Select Oat milk\n") && !r.text.contains("History"), "{}", r.text);
        assert_eq!(r.images, [PathBuf::from("data/images/20.png")], "no earlier screenshots without history");
        let full = episode_samples(&ep, &cfg, TaskMode::Full).unwrap();
        assert_eq!(s[1].target, full[1].target, "the same action, in the same frame");
    }

    #[test]
    fn element_ids_only_with_the_element_list() {
        let mut ep = episode(false);
        for s in ep.episode.steps.iter_mut() {
            if let Action::Click(t) = &mut s.action {
                t.element = Some("e4".into());
            }
            s.elements = Some(vec![crate::episode::Element {
                id: "e4".into(),
                role: "button".into(),
                text: "Send".into(),
                bbox: [0, 0, 50, 200],
            }]);
        }
        let ids = |cfg: &PromptConfig| {
            let s = episode_samples(&ep, cfg, TaskMode::Full).unwrap();
            let last = render_chatml(&s[2].messages, false).text;
            (s[2].target.target().unwrap().element.clone(), last.matches("\"element\":\"e4\"").count())
        };
        // Without the list the model cannot know ids: neither the target nor the history carries them.
        assert_eq!(ids(&PromptConfig::default()), (None, 0));
        // With it, the target and both earlier actions in the history name the element.
        assert_eq!(ids(&PromptConfig { elements: true, ..Default::default() }), (Some("e4".into()), 3));
    }

    #[test]
    fn describe_mode_lists_each_screens_elements() {
        let mut ep = episode(false);
        let el = |id: &str, text: &str| crate::episode::Element {
            id: id.into(),
            role: "button".into(),
            text: text.into(),
            bbox: [0, 0, 10, 10],
        };
        ep.episode.steps[1].elements = Some(vec![el("e0", "Milk"), el("e1", "Oat milk"), el("e2", "Soy milk")]);
        let s = episode_samples(&ep, &PromptConfig::default(), TaskMode::Describe).unwrap();
        assert_eq!(s.iter().map(|s| (s.step, s.kind)).collect::<Vec<_>>(), [(1, SampleKind::Describe)]);
        assert_eq!(s[0].target, Action::Answer { text: "Milk; Oat milk; Soy milk".into() });
        let r = render_chatml(&s[0].messages, false);
        assert!(r.text.contains(&format!("Task: {DESCRIBE_TASK}\n")) && !r.text.contains("History"), "{}", r.text);
        assert_eq!(r.images, [PathBuf::from("data/images/20.png")]);
    }

    #[test]
    fn language_mode_gives_each_question_and_answer_as_bare_text() {
        let cfg = PromptConfig::default();
        let s = episode_samples(&episode(true), &cfg, TaskMode::Language).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].step, s[0].kind), (1, SampleKind::Language));
        let r = render_chatml(&s[0].messages, false);
        // No system prompt, no task, no screenshot: the question's JSON and the answer, all of it loss.
        assert!(r.images.is_empty() && !r.text.contains("system") && !r.text.contains("Task:"), "{}", r.text);
        assert!(r.text.contains("\"question\":\"Which milk?\"") && r.text.contains("\nOat, please."), "{}", r.text);
        assert_eq!(r.loss_spans.len(), 1);
        let mut plain = episode(false);
        plain.episode.steps[1].ask = None;
        assert!(episode_samples(&plain, &cfg, TaskMode::Language).unwrap().is_empty(), "no question, no sample");
    }

    #[test]
    fn history_images_and_generation_prompt() {
        let cfg = PromptConfig { history_images: 1, ..Default::default() };
        let s = episode_samples(&episode(false), &cfg, TaskMode::Ambiguous).unwrap();
        assert_eq!(s.len(), 3);
        let r = render_chatml(&s[2].messages[..2], true);
        assert_eq!(r.images, [PathBuf::from("data/images/20.png"), PathBuf::from("data/images/30.png")]);
        assert!(r.text.ends_with("<|im_start|>assistant\n") && r.loss_spans.is_empty());
        assert_eq!(r.text.matches(IMAGE_PLACEHOLDER).count(), 2);
    }
}
