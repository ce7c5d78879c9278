//! Constrained decoding covers the whole action schema: every action kind, element targets from the
//! request's list only, an `ask` with options and a kind, coordinates inside the frame, and text-only
//! steps answered by element; every answer validates.
//!
//! The model is steered instead of trained: [`Steer`] stands in for the forward and gives each token a
//! high logit when its text continues a target answer, so the decoder writes the target wherever the
//! schema allows it, and the checks see what the constraints do where it does not (an unknown element, a
//! point off the screen, too many options).

#[path = "../../datasets/tests/official/mod.rs"]
mod official;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use askgui_data::agent_api::StepOptions;
use askgui_data::{parse_answer, Action, Element, PromptConfig};
use askgui_model::Qwen2Vl;
use askgui_runtime::{Forward, ImageInput, Item, ItemOut, Runtime, Step, MAX_ASK_OPTIONS};
use candle_core::{DType, Device};

/// The runtime of the tiny fixture (its tokenizer and config; the steered "model" never runs it), and
/// every token's text.
fn runtime() -> &'static (Runtime, Vec<String>) {
    static RT: OnceLock<(Runtime, Vec<String>)> = OnceLock::new();
    RT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl");
        let model = Qwen2Vl::load(&dir.display().to_string(), &Device::Cpu, DType::F32).unwrap();
        let prompt = PromptConfig { elements: true, ..PromptConfig::default() };
        let rt = Runtime::new(&model, prompt).unwrap().with_prefix_cache(0);
        let vocab = model.cfg.text.vocab_size as u32;
        let texts = (0..vocab).map(|t| rt.tokenizer().decode(&[t], false).unwrap_or_default()).collect();
        (rt, texts)
    })
}

/// A forward that favours the tokens continuing `target` (the whole answer, after the prompt):
/// each token whose text is a prefix of what is left gets `10 + its length`, every other token 0. It
/// keeps the sequence's tokens by position, so forks (options scored together, [`Item::forks`]) and the
/// chosen continuation each see their own text.
struct Steer<'t> {
    texts: &'t [String],
    target: String,
    seen: RefCell<BTreeMap<u32, u32>>,
    prompt_end: Cell<Option<u32>>,
}

impl<'t> Steer<'t> {
    fn new(texts: &'t [String], answer: &str) -> Self {
        Self { texts, target: answer.to_string(), seen: RefCell::default(), prompt_end: Cell::new(None) }
    }

    fn row(&self, seen: &BTreeMap<u32, u32>, end: u32, at: u32) -> Vec<f32> {
        let so_far: String = seen.range(end + 1..at + 1).map(|(_, &t)| self.texts[t as usize].as_str()).collect();
        let mut row = vec![0f32; self.texts.len()];
        if let Some(rest) = self.target.strip_prefix(so_far.as_str()) {
            for (t, s) in self.texts.iter().enumerate() {
                if !s.is_empty() && rest.starts_with(s.as_str()) {
                    row[t] = 10.0 + s.len() as f32;
                }
            }
        }
        row
    }
}

impl Forward for Steer<'_> {
    fn run(&self, items: Vec<Item>) -> askgui_runtime::Result<Vec<ItemOut>> {
        let mut outs = Vec::new();
        for it in items {
            let mut seen = self.seen.borrow_mut();
            let last = it.positions.last().expect("tokens")[0];
            // The first item is the prompt: the answer starts after it.
            let end = *self.prompt_end.get().get_or_insert(last);
            self.prompt_end.set(Some(end));
            // Each fork sees its own tokens: one run after another, each row read after its run is in.
            let runs = if it.forks.is_empty() { vec![it.ids.len()] } else { it.forks.clone() };
            let first_wanted = it.ids.len() - it.logits_rows;
            let (mut logits, mut start) = (Vec::new(), 0);
            for n in runs {
                for (&id, p) in it.ids[start..start + n].iter().zip(&it.positions[start..]) {
                    seen.insert(p[0], id);
                }
                let wanted = first_wanted.max(start)..start + n;
                logits.extend(it.positions[wanted].iter().map(|p| self.row(&seen, end, p[0])));
                start += n;
            }
            outs.push(ItemOut { cache: it.cache, logits });
        }
        Ok(outs)
    }

    fn adapter(&self) -> Option<&str> {
        None
    }
}

fn elements(ids: &[&str]) -> Vec<Element> {
    let el = |(i, id): (usize, &&str)| Element {
        id: id.to_string(),
        role: "button".into(),
        text: format!("Item {i}"),
        bbox: [4, 4 + 10 * i as i32, 60, 12 + 10 * i as i32],
    };
    ids.iter().enumerate().map(el).collect()
}

fn screenshot(w: u32, h: u32) -> ImageInput {
    ImageInput { image: Arc::new(image::RgbImage::new(w, h)), hash: (u64::from(w) << 32) | u64::from(h) }
}

/// The constrained answer steered toward `target`, with a `w`x`h` screenshot (or none: a text-only step
/// on a `w`x`h` screen) and the elements `ids`: the parsed action in the model frame, the frame, the raw
/// text.
fn answer(target: &str, shot: bool, (w, h): (u32, u32), ids: &[&str]) -> (Action, (u32, u32), String) {
    let (rt, texts) = runtime();
    let shots = if shot { vec![screenshot(w, h)] } else { vec![] };
    let els = elements(ids);
    let step =
        Step { task: "Buy oat milk", history: &[], screenshots: &shots, elements: Some(&els), screen: Some((w, h)) };
    let opts = StepOptions::default();
    let out = rt.step(&Steer::new(texts, target), &step, &opts, &|| false).unwrap();
    let (_, model) = out.parsed.unwrap_or_else(|e| panic!("{target}: {e}: {}", out.raw));
    model.check().unwrap_or_else(|e| panic!("{target}: {e}: {}", out.raw));
    (model, out.frame.model, out.raw)
}

#[test]
fn every_action_kind_is_written_as_steered() {
    let ids = ["e1", "e2", "e3"];
    let targets = [
        r#"{"action":"click","x":10,"y":20}"#,
        r#"{"action":"click","x":10,"y":20,"element":"e2"}"#,
        r#"{"action":"long_press","x":3,"y":70}"#,
        r#"{"action":"double_click","x":100,"y":5,"element":"e3"}"#,
        r#"{"action":"right_click","x":0,"y":0}"#,
        r#"{"action":"type","text":"oat milk"}"#,
        r#"{"action":"scroll","x":50,"y":40,"direction":"down"}"#,
        r#"{"action":"swipe","x1":10,"y1":80,"x2":10,"y2":5}"#,
        r#"{"action":"drag","x1":1,"y1":2,"x2":30,"y2":40}"#,
        r#"{"action":"press","key":"enter"}"#,
        r#"{"action":"hotkey","keys":["ctrl","shift","t"]}"#,
        r#"{"action":"open_app","name":"Shop"}"#,
        r#"{"action":"wait","seconds":3}"#,
        r#"{"action":"ask","question":"Which size?"}"#,
        r#"{"action":"ask","question":"Which size?","options":[{"label":"Small"},{"label":"Large"}],"kind":"selection"}"#,
        r#"{"action":"ask","question":"What date?","kind":"specification"}"#,
        r#"{"action":"answer","text":"42"}"#,
        r#"{"action":"done","status":"infeasible"}"#,
    ];
    for t in targets {
        let (got, frame, raw) = answer(t, true, (112, 84), &ids);
        assert_eq!(frame, (112, 84), "the screenshot is not resized at these bounds");
        assert_eq!(got, parse_answer(t).unwrap().action, "{t}: wrote {raw}");
    }
    let names: std::collections::BTreeSet<&str> =
        targets.iter().map(|t| parse_answer(t).unwrap().action.name()).collect();
    assert_eq!(names.len(), askgui_data::action::ACTION_NAMES.len(), "every action kind");
}

#[test]
fn a_text_only_step_targets_an_element() {
    let (got, _, raw) = answer(r#"{"action":"click","element":"e3"}"#, false, (360, 640), &["e1", "e3"]);
    assert_eq!(got, parse_answer(r#"{"action":"click","element":"e3"}"#).unwrap().action, "{raw}");
    // Steered toward a point, a text-only answer still names an element of the list.
    let (got, _, raw) = answer(r#"{"action":"click","x":10,"y":10}"#, false, (360, 640), &["e1", "e3"]);
    let element = got.target().and_then(|t| t.element.clone());
    assert!(element.is_some_and(|e| e == "e1" || e == "e3"), "{raw}");
}

#[test]
fn the_schema_holds_where_the_model_wants_otherwise() {
    // An element that is not listed, a point off the screen.
    let (got, (w, h), raw) = answer(r#"{"action":"click","x":5000,"y":20,"element":"zz"}"#, true, (112, 84), &["e1"]);
    let t = got.target().expect("a click");
    let (x, y) = t.xy().expect("a point");
    assert!((0..w as i32).contains(&x) && (0..h as i32).contains(&y), "({x}, {y}) outside {w}x{h}: {raw}");
    assert!(t.element.as_deref().is_none_or(|e| e == "e1"), "{raw}");
    // A spent budget leaves the optional fields out, and the answer still parses.
    let (rt, texts) = runtime();
    let shots = [screenshot(112, 84)];
    let step = Step { task: "t", history: &[], screenshots: &shots, elements: None, screen: None };
    let full = r#"{"action":"ask","question":"Which size?","options":[{"label":"Small"}],"kind":"selection"}"#;
    let opts = StepOptions { max_tokens: Some(4), ..StepOptions::default() };
    let out = rt.step(&Steer::new(texts, full), &step, &opts, &|| false).unwrap();
    let Ok((_, Action::Ask(short))) = &out.parsed else { panic!("{}", out.raw) };
    assert!(short.options.is_empty() && short.kind.is_none(), "{}", out.raw);
    // Seven options: the answer keeps at most six.
    let labels: Vec<String> = (1..=7).map(|i| format!(r#"{{"label":"o{i}"}}"#)).collect();
    let target = format!(r#"{{"action":"ask","question":"Which?","options":[{}]}}"#, labels.join(","));
    let (got, _, raw) = answer(&target, true, (112, 84), &[]);
    let Action::Ask(ask) = got else { panic!("not an ask: {raw}") };
    assert_eq!(ask.options.len(), MAX_ASK_OPTIONS, "{raw}");
    // No elements listed: no element target.
    let (got, _, raw) = answer(r#"{"action":"click","x":10,"y":20,"element":"e1"}"#, true, (112, 84), &[]);
    assert!(got.target().is_some_and(|t| t.element.is_none()), "{raw}");
}

/// A small deterministic generator (no RNG crate: the same cases on every machine).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

#[test]
fn random_screens_elements_and_targets_always_validate() {
    let mut rng = Lcg(7);
    for case in 0..40 {
        let (w, h) = (56 + 28 * rng.below(8) as u32, 56 + 28 * rng.below(8) as u32);
        let id_names: Vec<String> = (0..rng.below(5)).map(|i| format!("n{}x{i}", rng.below(1000))).collect();
        let ids: Vec<&str> = id_names.iter().map(String::as_str).collect();
        let shot = ids.is_empty() || rng.below(3) > 0;
        let (x, y) = (rng.below(2 * w as u64), rng.below(2 * h as u64));
        let element = match ids.is_empty() || rng.below(2) == 0 {
            true => format!("q{}", rng.below(9)),
            false => ids[rng.below(ids.len() as u64) as usize].to_string(),
        };
        let target = match rng.below(4) {
            0 => format!(r#"{{"action":"click","x":{x},"y":{y},"element":"{element}"}}"#),
            1 => format!(r#"{{"action":"swipe","x1":{x},"y1":{y},"x2":{y},"y2":{x}}}"#),
            2 => format!(r#"{{"action":"scroll","x":{x},"y":{y},"direction":"left"}}"#),
            _ => format!(r#"{{"action":"ask","question":"Q{case}?","options":[{{"label":"{element}"}}]}}"#),
        };
        let (got, (fw, fh), raw) = answer(&target, shot, (w, h), &ids);
        let what = format!("case {case}: {target} on {w}x{h} with {ids:?}: wrote {raw}");
        for (px, py) in got.points() {
            assert!((0..fw as i32).contains(&px) && (0..fh as i32).contains(&py), "{what}");
        }
        if let Some(e) = got.target().and_then(|t| t.element.as_deref()) {
            assert!(ids.contains(&e), "{what}");
        }
        if !shot && got.target().is_some() {
            assert!(got.target().is_some_and(|t| t.element.is_some()), "{what}");
        }
        if let Action::Ask(a) = &got {
            assert!(a.options.len() <= MAX_ASK_OPTIONS, "{what}");
        }
        // Where the target is within the schema, it is what is written.
        let side = u64::from(fw.min(fh));
        let within = match target.split('"').nth(3) {
            Some("click") => shot && x < u64::from(fw) && y < u64::from(fh) && ids.contains(&element.as_str()),
            Some("swipe") => x < side && y < side,
            Some("ask") => true,
            _ => false,
        };
        if within {
            assert_eq!(got, parse_answer(&target).unwrap().action, "{what}");
        }
    }
}

/// Qwen3-VL, with nothing naming a frame, reads and writes relative 0-1000 coordinates
/// (`askgui_runtime::native_frame`), and the constrained answer's point comes back in screen pixels by
/// the frame contract: pixel centres scale, `(v + 0.5) * extent / 1000 - 0.5` rounded, so (500, 250) on a
/// 224x400 screen is (round(111.612), round(99.7)) = (112, 100). A point past the frame is cut at 999.
#[test]
fn qwen3_vl_answers_in_its_native_0_1000_frame_and_the_runtime_returns_screen_pixels() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen3_vl");
    let model = Qwen2Vl::load(&dir.display().to_string(), &Device::Cpu, DType::F32).unwrap();
    let frame = askgui_runtime::native_frame(model.arch());
    assert_eq!(frame, askgui_data::FrameKind::Relative1000);
    let flags = askgui_data::PromptFlags::default();
    let rt = Runtime::new(&model, flags.config_in(frame)).unwrap().with_prefix_cache(0);
    let vocab = model.cfg.text.vocab_size as u32;
    let texts: Vec<String> = (0..vocab).map(|t| rt.tokenizer().decode(&[t], false).unwrap_or_default()).collect();
    let shots = [screenshot(224, 400)];
    let step =
        Step { task: "Buy oat milk", history: &[], screenshots: &shots, elements: None, screen: Some((224, 400)) };
    let opts = StepOptions::default();
    let out = rt.step(&Steer::new(&texts, r#"{"action":"click","x":500,"y":250}"#), &step, &opts, &|| false).unwrap();
    assert_eq!(out.frame.model, (1000, 1000), "{}", out.raw);
    let (screen, model_frame) = out.parsed.unwrap_or_else(|e| panic!("{e}: {}", out.raw));
    assert_eq!(model_frame, parse_answer(r#"{"action":"click","x":500,"y":250}"#).unwrap().action);
    assert_eq!(screen, parse_answer(r#"{"action":"click","x":112,"y":100}"#).unwrap().action);
    let out = rt.step(&Steer::new(&texts, r#"{"action":"click","x":1500,"y":20}"#), &step, &opts, &|| false).unwrap();
    let (_, model_frame) = out.parsed.unwrap_or_else(|e| panic!("{e}: {}", out.raw));
    assert!(model_frame.points().iter().all(|&(x, y)| x < 1000 && y < 1000), "{}", out.raw);
}

/// In UI-TARS's and the tool-call language, the constrained decoder writes each action kind as steered,
/// and the text parses in the language back to the steered action: every name the language has is
/// written (UI-TARS cannot say a failed `done`, so that one is left out there). UI-TARS's texts, the
/// answers askgui-serve returns as they are over the OpenAI endpoint, also go through the official parser
/// (`@ui-tars/action-parser`, when `ASKGUI_UI_TARS_NODE_MODULES` names it), which must read each one as
/// the steered action.
#[test]
fn every_action_kind_of_every_language_is_written_as_steered_and_parses_back() {
    use askgui_data::ActionLanguage;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl");
    let model = Qwen2Vl::load(&dir.display().to_string(), &Device::Cpu, DType::F32).unwrap();
    let vocab = model.cfg.text.vocab_size as u32;
    for language in [ActionLanguage::UiTars, ActionLanguage::ToolCall] {
        let frame = language.native_frame().expect("a frame of its own");
        let prompt = PromptConfig { action_language: language, frame, ..PromptConfig::default() };
        let rt = Runtime::new(&model, prompt).unwrap().with_prefix_cache(0);
        let texts: Vec<String> = (0..vocab).map(|t| rt.tokenizer().decode(&[t], false).unwrap_or_default()).collect();
        let shots = [screenshot(112, 84)];
        let step = Step { task: "Buy oat milk", history: &[], screenshots: &shots, elements: None, screen: None };
        let mut names: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
        let mut written = Vec::new();
        for action in official::every_action_kind() {
            let Ok(target) = language.render(&action) else { continue };
            let out = rt.step(&Steer::new(&texts, &target), &step, &StepOptions::default(), &|| false).unwrap();
            let (_, got) = out.parsed.unwrap_or_else(|e| panic!("{language:?} {target}: {e}: {}", out.raw));
            assert_eq!(out.raw, target, "{language:?}: the steered text is written as it is");
            assert_eq!(got, language.normal_form(&action), "{language:?} {target}");
            written.push((out.raw, got));
            let rest = &target[language.answer_prefix().len()..];
            names.extend(
                language
                    .action_names()
                    .iter()
                    .copied()
                    .filter(|n| rest.starts_with(&format!("{n}{}", language.name_end()))),
            );
        }
        assert_eq!(names.len(), language.action_names().len(), "{language:?}: every action name, got {names:?}");
        if language == ActionLanguage::UiTars {
            let texts: Vec<String> = written.iter().map(|(raw, _)| raw.clone()).collect();
            if let Some(parsed) = official::parse(&texts, "the official parser on the constrained UI-TARS answers") {
                for ((raw, ours), theirs) in written.iter().zip(&parsed) {
                    assert_eq!(&official::action(theirs), ours, "the official parser reads {raw} otherwise: {theirs}");
                }
                eprintln!("the official UI-TARS parser read all {} constrained answers as steered", texts.len());
            }
        }
        // Decoded freely, the answer ends where the language's answer closes (the steering stops there,
        // so any token after it would be noise), quotes and brackets inside its strings included.
        let free = StepOptions { constrain: Some(false), ..StepOptions::default() };
        let said = language.render(&Action::Answer { text: "a) b] \"c\" }".into() }).unwrap();
        let out = rt.step(&Steer::new(&texts, &said), &step, &free, &|| false).unwrap();
        assert_eq!(out.raw, said, "{language:?}");
        // Steered off the frame, the point stays inside it (112x84 pixels, or 0-1000).
        let off = language.render(&Action::Click(askgui_data::Target::point(5000, 20))).unwrap();
        let out = rt.step(&Steer::new(&texts, &off), &step, &StepOptions::default(), &|| false).unwrap();
        let (_, got) = out.parsed.unwrap_or_else(|e| panic!("{language:?}: {e}: {}", out.raw));
        let (w, h) = out.frame.model;
        assert!(got.points().iter().all(|&(x, y)| x < w as i32 && y < h as i32), "{language:?}: {}", out.raw);
    }
}

/// A UI-TARS string never holds what the official parser reads as syntax: steered to ask "Which Action:
/// size?" or to type with a leading space, the decoder leaves the colon (and the space) out, the answer
/// still parses, and (when `ASKGUI_UI_TARS_NODE_MODULES` names it) `@ui-tars/action-parser` reads it as
/// askgui does. Before, such a question ended the answer for both parsers at the inner `Action:`.
#[test]
fn ui_tars_strings_never_hold_the_parsers_syntax() {
    use askgui_data::{ActionLanguage, Ask};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl");
    let model = Qwen2Vl::load(&dir.display().to_string(), &Device::Cpu, DType::F32).unwrap();
    let language = ActionLanguage::UiTars;
    let prompt =
        PromptConfig { action_language: language, frame: language.native_frame().unwrap(), ..PromptConfig::default() };
    let rt = Runtime::new(&model, prompt).unwrap().with_prefix_cache(0);
    let texts: Vec<String> =
        (0..model.cfg.text.vocab_size as u32).map(|t| rt.tokenizer().decode(&[t], false).unwrap_or_default()).collect();
    let shots = [screenshot(112, 84)];
    let step = Step { task: "Buy oat milk", history: &[], screenshots: &shots, elements: None, screen: None };
    let opts = StepOptions { max_tokens: Some(48), ..StepOptions::default() };
    let mut written = Vec::new();
    for steered in [
        "Action: call_user(content='Which Action: size?')",
        "Action: call_user(content='Show the <point> and point=3')",
        "Action: type(content=' oat milk')",
    ] {
        let out = rt.step(&Steer::new(&texts, steered), &step, &opts, &|| false).unwrap();
        let (_, got) = out.parsed.unwrap_or_else(|e| panic!("{steered}: {e}: {}", out.raw));
        let said = match &got {
            Action::Ask(Ask { question, .. }) => question.clone(),
            Action::Type { text } => text.clone(),
            other => panic!("{steered}: {other:?}"),
        };
        for syntax in ["Action:", "point=", "<point>"] {
            assert!(!said.contains(syntax), "{steered}: the string holds {syntax}: {}", out.raw);
        }
        assert!(!said.starts_with(char::is_whitespace), "{steered}: a leading space: {}", out.raw);
        assert_eq!(language.render(&got).unwrap(), out.raw, "{steered}: written as askgui renders it");
        written.push((out.raw, got));
    }
    let raws: Vec<String> = written.iter().map(|(r, _)| r.clone()).collect();
    if let Some(parsed) = official::parse(&raws, "ui_tars_strings_never_hold_the_parsers_syntax") {
        for ((raw, ours), theirs) in written.iter().zip(&parsed) {
            assert_eq!(&official::action(theirs), ours, "the official parser reads {raw} otherwise: {theirs}");
        }
    }
}
