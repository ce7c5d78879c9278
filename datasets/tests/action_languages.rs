//! Property tests of the action languages: every protocol action, with random fields, renders and parses
//! back to itself in every language (to the language's normal form where it says two of ours alike);
//! text the parsers accept (written the ways the agents write it) round-trips; an action a language
//! cannot say is refused by name. Then real outputs of UI-TARS-1.5 and the tool-call agents parse to the
//! actions they mean.

mod actions;

use actions::action;
use askgui_data::language::LANGUAGES;
use askgui_data::{Action, Action::*};
use askgui_data::{
    ActionLanguage, Ask, AskKind, AskOption, Direction, DoneStatus, FrameKind, FrameMap, ResizeBounds, Segment, Target,
};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

/// A few hundred cases from a fixed seed: the same cases on every run.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 300,
        rng_seed: RngSeed::Fixed(0x5eed_1a46),
        failure_persistence: None,
        ..Default::default()
    }
}

/// Whether `lang` can say `a`, decided from the languages' documents, not from the code under test:
/// neither UI-TARS nor the tool calls name elements (they point at pixels); UI-TARS's `finished()`
/// has no failure status, and its hotkey separates keys by spaces.
fn expressible(lang: ActionLanguage, a: &Action) -> bool {
    let pointing = |t: &Target| t.element.is_none() && t.xy().is_some();
    let plain = |k: &String| !k.is_empty() && !k.chars().any(char::is_whitespace);
    match (lang, a) {
        (ActionLanguage::AskguiJson, _) => true,
        (_, Click(t) | LongPress(t) | DoubleClick(t) | RightClick(t)) => pointing(t),
        (ActionLanguage::UiTars, Done { status: DoneStatus::Infeasible }) => false,
        (ActionLanguage::UiTars, Press { key }) => key == "back" || key == "home" || plain(key),
        (ActionLanguage::UiTars, Hotkey { keys }) => keys.iter().all(plain),
        _ => true,
    }
}

/// The only places a language reads back another action than the one written (documented in
/// `ActionLanguage::normal_form`): a one-key hotkey is a press; UI-TARS's drag is our drag and swipe.
fn merged(lang: ActionLanguage, a: &Action) -> bool {
    match (lang, a) {
        (ActionLanguage::AskguiJson, _) => false,
        (_, Hotkey { keys }) => keys.len() == 1,
        (ActionLanguage::UiTars, Swipe(_)) => true,
        _ => false,
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_action_renders_and_parses_back_or_is_refused_by_name(a in action()) {
        for lang in LANGUAGES {
            let normal = lang.normal_form(&a);
            prop_assert_eq!(normal != a, merged(lang, &a), "{}: normal form of {:?} is {:?}", lang.name(), a, normal);
            match lang.render(&a) {
                Ok(text) => {
                    prop_assert!(expressible(lang, &a), "{} wrote {:?} for {:?}", lang.name(), text, a);
                    let parsed = lang.parse(&text).map_err(|e| TestCaseError::fail(format!("{}: {text:?}: {e}", lang.name())))?;
                    prop_assert_eq!(parsed.action, normal, "{}: {:?}", lang.name(), text);
                    prop_assert_eq!(parsed.thought, None);
                }
                Err(e) => {
                    prop_assert!(!expressible(lang, &a), "{} refused {:?}: {}", lang.name(), a, e);
                    prop_assert_eq!(e.action, a.name());
                    let msg = e.to_string();
                    prop_assert!(msg.contains(lang.name()) && msg.contains(&format!("`{}`", a.name())), "{}", msg);
                }
            }
        }
    }

    #[test]
    fn points_are_written_in_the_languages_frame(
        w in 200u32..3000, h in 200u32..3000, fx in 0f64..1.0, fy in 0f64..1.0, lang_i in 1usize..3
    ) {
        prop_assume!(w.max(h) as f64 / w.min(h) as f64 <= 20.0);
        let lang = LANGUAGES[lang_i];
        let frame = lang.native_frame().expect("UI-TARS and the tool calls have a frame of their own");
        let m = FrameMap::new(frame, w, h, ResizeBounds::default()).unwrap();
        let screen = Click(Target::point((fx * (w - 1) as f64) as i32, (fy * (h - 1) as f64) as i32));
        let model = m.action_to_model(&screen);
        let (x, y) = model.points()[0];
        let text = lang.render(&model).unwrap();
        // UI-TARS writes `(x,y)` in pixels of the resized image; the tool calls `[x, y]` in 0-1000.
        let written = match frame {
            FrameKind::Resized => format!("({x},{y})"),
            _ => format!("[{x}, {y}]"),
        };
        prop_assert!(text.contains(&written), "{} not in {}", written, text);
        prop_assert!(x >= 0 && (x as u32) < m.model.0 && y >= 0 && (y as u32) < m.model.1);
        if frame == FrameKind::Relative1000 {
            prop_assert!(x < 1000 && y < 1000);
        }
        prop_assert_eq!(lang.parse(&text).unwrap().action, model);
    }

    #[test]
    fn text_the_parsers_accept_round_trips(a in action(), variant in 0usize..5, thought in "[A-Za-z ,.]{0,30}[a-z]") {
        for lang in [ActionLanguage::UiTars, ActionLanguage::ToolCall] {
            let Ok(text) = lang.render(&a) else { continue };
            let written = agent_variant(lang, &text, variant, &thought);
            let parsed = lang.parse(&written).map_err(|e| TestCaseError::fail(format!("{}: {written:?}: {e}", lang.name())))?;
            prop_assert_eq!(&parsed.action, &lang.normal_form(&a), "{}: {:?}", lang.name(), written);
            // What was read renders again, and that text reads back the same.
            let again = lang.render(&parsed.action).unwrap();
            prop_assert_eq!(lang.parse(&again).unwrap().action, parsed.action);
        }
    }
}

/// `text` as an agent may write it instead: with a thought before it, and in the other spellings each
/// language's parsers accept (UI-TARS: `<|box_start|>` tokens, `point=`, a full-width colon; the tool
/// calls: no newlines inside the tags, compact JSON, the arguments as a JSON string).
fn agent_variant(lang: ActionLanguage, text: &str, variant: usize, thought: &str) -> String {
    match (lang, variant) {
        (ActionLanguage::UiTars, 0) => format!("Thought: {thought}\n{text}"),
        (ActionLanguage::UiTars, 1) => text.replacen("='(", "='<|box_start|>(", 2).replacen(")'", ")<|box_end|>'", 2),
        (ActionLanguage::UiTars, 2) if text.contains("(start_box=") => text.replacen("(start_box=", "(point=", 1),
        (ActionLanguage::UiTars, 3) => format!("Thought: {thought}\n{}", text.replacen("Action:", "Action\u{ff1a}", 1)),
        (ActionLanguage::ToolCall, 0) => format!("{thought}\n{text}"),
        (ActionLanguage::ToolCall, 1) => {
            text.replace("<tool_call>\n", "<tool_call>").replace("\n</tool_call>", "</tool_call>")
        }
        (ActionLanguage::ToolCall, 2 | 3) => {
            let json = text.trim_start_matches("<tool_call>\n").trim_end_matches("\n</tool_call>");
            let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
            if variant == 3 {
                v["arguments"] = serde_json::Value::String(v["arguments"].to_string());
            }
            format!("<tool_call>\n{v}\n</tool_call>")
        }
        _ => text.to_string(),
    }
}

fn ask(question: &str) -> Action {
    Ask(Ask { question: question.into(), options: vec![], kind: None })
}

/// Outputs as UI-TARS-1.5 writes them: the first two are the test cases of the official Python parser
/// (bytedance/UI-TARS, `codes/tests/action_parser_test.py`); the rest are calls of the action spaces
/// of UI-TARS-1.5's `COMPUTER_USE` / `MOBILE_USE` prompts (bytedance/UI-TARS README), including the
/// escapes that prompt asks for and its `[x1, y1, x2, y2]` boxes of UI-TARS-1.0.
#[test]
fn real_ui_tars_outputs_parse_to_what_they_mean() {
    let cases: Vec<(&str, Action)> = vec![
        ("Thought: test\nAction: click(point='<point>200 300</point>')", Click(Target::point(200, 300))),
        ("Thought: test\nAction: click(start_box='<|box_start|>(112,224)<|box_end|>')", Click(Target::point(112, 224))),
        ("Action: left_double(start_box='<|box_start|>(10,20)<|box_end|>')", DoubleClick(Target::point(10, 20))),
        ("Action: right_single(start_box='(7,8)')", RightClick(Target::point(7, 8))),
        // The box's centre: ((100+200)/2, (40+60)/2).
        ("Action: click(start_box='[100, 40, 200, 60]')", Click(Target::point(150, 50))),
        (
            "Action: drag(start_box='<|box_start|>(897,1208)<|box_end|>', end_box='<|box_start|>(244,1208)<|box_end|>')",
            Drag(Segment { x1: 897, y1: 1208, x2: 244, y2: 1208 }),
        ),
        ("Action: hotkey(key='ctrl c')", Hotkey { keys: vec!["ctrl".into(), "c".into()] }),
        ("Action: hotkey(key='enter')", Press { key: "enter".into() }),
        // The prompt's escapes: `\'` is a quote, `\n` at the end submits (a newline in our text).
        ("Thought: Search.\nAction: type(content='Tom\\'s cafe\\n')", Type { text: "Tom's cafe\n".into() }),
        (
            "Action: scroll(start_box='<|box_start|>(500,600)<|box_end|>', direction='down')",
            Scroll { x: Some(500), y: Some(600), direction: Direction::Down },
        ),
        ("Action: wait()", Wait { seconds: 5.0 }),
        ("Action: finished()", Done { status: DoneStatus::Success }),
        ("Action: finished(content='The price is $5.')", Answer { text: "The price is $5.".into() }),
        ("Action: long_press(start_box='<|box_start|>(300,400)<|box_end|>', time='')", LongPress(Target::point(300, 400))),
        ("Action: open_app(app_name='Settings')", OpenApp { name: "Settings".into() }),
        ("Action: press_home()", Press { key: "home".into() }),
        ("Action: press_back()", Press { key: "back".into() }),
        // UI-TARS-1.5 hands over with a bare call_user() and says why in its thought.
        ("Thought: Which of the two accounts should I log in with?\nAction: call_user()", ask("Which of the two accounts should I log in with?")),
    ];
    for (text, want) in cases {
        let got = ActionLanguage::UiTars.parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(got.action, want, "{text}");
    }
    let p = ActionLanguage::UiTars.parse("Thought: test\nAction: click(point='<point>200 300</point>')").unwrap();
    assert_eq!(p.thought.as_deref(), Some("test"));
}

/// Outputs in the form the tool-call agents' own parsers read (Fara-1.5's `_parse_thoughts_and_action`
/// in microsoft/fara `fara15_agent.py`; the Qwen3-VL cookbook's `computer_use` / `mobile_use` tools,
/// QwenLM/Qwen3-VL `cookbooks/utils/agent_function_call.py`): the thought before the tag, the call in it.
#[test]
fn real_tool_call_outputs_parse_to_what_they_mean() {
    let call =
        |tool: &str, args: &str| format!("<tool_call>\n{{\"name\": \"{tool}\", \"arguments\": {args}}}\n</tool_call>");
    let cases: Vec<(String, Action)> = vec![
        (call("computer_use", r#"{"action": "left_click", "coordinate": [500, 300]}"#), Click(Target::point(500, 300))),
        (
            format!(
                "Action: Double-click the WeChat icon on the desktop.\n{}",
                call("computer_use", r#"{"action": "double_click", "coordinate": [54, 311]}"#)
            ),
            DoubleClick(Target::point(54, 311)),
        ),
        (call("computer_use", r#"{"action": "type", "text": "hello, world"}"#), Type { text: "hello, world".into() }),
        (
            call("computer_use", r#"{"action": "key", "keys": ["ctrl", "c"]}"#),
            Hotkey { keys: vec!["ctrl".into(), "c".into()] },
        ),
        (call("computer_use", r#"{"action": "key", "keys": ["Escape"]}"#), Press { key: "Escape".into() }),
        // Positive pixels scroll up, negative down (the cookbook's `pixels`).
        (
            call("computer_use", r#"{"action": "scroll", "pixels": -300}"#),
            Scroll { x: None, y: None, direction: Direction::Down },
        ),
        (call("computer_use", r#"{"action": "wait", "time": 3}"#), Wait { seconds: 3.0 }),
        (call("computer_use", r#"{"action": "answer", "text": "42"}"#), Answer { text: "42".into() }),
        (call("computer_use", r#"{"action": "terminate", "status": "success"}"#), Done { status: DoneStatus::Success }),
        (
            call("computer_use", r#"{"action": "terminate", "status": "failure"}"#),
            Done { status: DoneStatus::Infeasible },
        ),
        (
            call("computer_use", r#"{"action": "ask_user_question", "question": "Which size do you want?"}"#),
            ask("Which size do you want?"),
        ),
        (call("mobile_use", r#"{"action": "click", "coordinate": [12.6, 40.2]}"#), Click(Target::point(13, 40))),
        (
            call("mobile_use", r#"{"action": "swipe", "coordinate": [500, 800], "coordinate2": [500, 200]}"#),
            Swipe(Segment { x1: 500, y1: 800, x2: 500, y2: 200 }),
        ),
        (
            call("mobile_use", r#"{"action": "long_press", "coordinate": [300, 400], "time": 2}"#),
            LongPress(Target::point(300, 400)),
        ),
        (call("mobile_use", r#"{"action": "system_button", "button": "Back"}"#), Press { key: "back".into() }),
        (call("mobile_use", r#"{"action": "open", "text": "Settings"}"#), OpenApp { name: "Settings".into() }),
    ];
    for (text, want) in cases {
        let got = ActionLanguage::ToolCall.parse(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(got.action, want, "{text}");
    }
    // Our ASK with its options and kind: Fara-1.5's question plus two arguments its front end ignores.
    let a = Ask(Ask {
        question: "Which milk?".into(),
        options: vec![
            AskOption { label: "Oat".into(), detail: None },
            AskOption { label: "Soy".into(), detail: Some("1 L".into()) },
        ],
        kind: Some(AskKind::Selection),
    });
    let text = ActionLanguage::ToolCall.render(&a).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(text.trim_start_matches("<tool_call>\n").trim_end_matches("\n</tool_call>")).unwrap();
    assert_eq!(v["arguments"]["action"], "ask_user_question");
    assert_eq!(v["arguments"]["question"], "Which milk?", "Fara-1.5 reads `question`");
    let ui_tars = ActionLanguage::UiTars.render(&a).unwrap();
    assert_eq!(
        ui_tars,
        r#"Action: call_user(content='Which milk?', options='[{"label":"Oat"},{"label":"Soy","detail":"1 L"}]', kind='selection')"#
    );
}

fn episode(actions: Vec<Action>) -> askgui_data::LoadedEpisode {
    use askgui_data::{Episode, Platform, Screen, Step};
    let step = |action| Step {
        screenshot: "s.png".into(),
        elements: None,
        instruction: None,
        informative: None,
        action,
        ask: None,
    };
    askgui_data::LoadedEpisode {
        episode: Episode {
            id: "e7".into(),
            platform: Platform::Android,
            screen: Screen { width: 1000, height: 2000 },
            task: "Find the recipe".into(),
            ambiguous_task: None,
            steps: actions.into_iter().map(step).collect(),
        },
        base: "data".into(),
        line: 1,
    }
}

#[test]
fn validation_and_samples_name_the_step_a_language_cannot_say() {
    let ep = episode(vec![
        Click(Target::point(10, 20)),
        Click(Target { x: None, y: None, element: Some("e4".into()) }),
        Done { status: DoneStatus::Infeasible },
    ]);
    let mut problems = vec![];
    askgui_data::validate::check_language(&ep.episode, ActionLanguage::UiTars, &mut |step, msg| {
        problems.push((step, msg))
    });
    // Step 1 points at an element only, step 2 gives up: UI-TARS says neither; step 0 is fine.
    assert_eq!(problems.iter().map(|p| p.0).collect::<Vec<_>>(), [Some(1), Some(2)], "{problems:?}");
    assert!(problems[0].1.contains("`click`") && problems[1].1.contains("`done`"), "{problems:?}");
    let mut json = vec![];
    askgui_data::validate::check_language(&ep.episode, ActionLanguage::AskguiJson, &mut |s, m| json.push((s, m)));
    assert!(json.is_empty(), "askgui's JSON says everything: {json:?}");

    let cfg = askgui_data::PromptConfig { action_language: ActionLanguage::UiTars, ..Default::default() };
    let e = askgui_data::episode_samples(&ep, &cfg, askgui_data::TaskMode::Full).unwrap_err();
    assert!(e.to_string().contains("episode `e7` step 1") && e.to_string().contains("`click`"), "{e}");
}

#[test]
fn samples_speak_the_language_in_the_prompt_history_and_target() {
    let ep = episode(vec![Click(Target::point(100, 200)), Type { text: "soup".into() }]);
    // 1000x2000 relative: (100, 200) is (100, 100) in 0-1000.
    let json = askgui_data::PromptConfig { frame: FrameKind::Relative1000, ..Default::default() };
    for lang in LANGUAGES {
        let cfg = askgui_data::PromptConfig { action_language: lang, ..json.clone() };
        let s = askgui_data::episode_samples(&ep, &cfg, askgui_data::TaskMode::Full).unwrap();
        let last = &s[1].messages;
        let text = |i: usize| match &last[i].content[0] {
            askgui_data::Part::Text { text } => text.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(text(0), lang.system_prompt(cfg.system_prompt, FrameKind::Relative1000));
        let earlier = lang.render(&Click(Target::point(100, 100))).unwrap();
        let history = last[1].content.iter().find_map(|p| match p {
            askgui_data::Part::Text { text } if text.starts_with("History:") => Some(text.clone()),
            _ => None,
        });
        assert_eq!(history.unwrap(), format!("History:\n1. {earlier}\n"));
        assert_eq!(text(2), lang.render(&s[1].target).unwrap());
        assert_eq!(lang.parse(&text(2)).unwrap().action, s[1].target);
    }
    assert_eq!(json.action_language, ActionLanguage::AskguiJson, "the default language is today's JSON");
}

#[test]
fn every_language_has_its_own_compact_prompt() {
    let ep = episode(vec![Click(Target::point(100, 200))]);
    let compact = askgui_data::PromptConfig { system_prompt: askgui_data::SystemPrompt::Compact, ..Default::default() };
    let mut prompts = Vec::new();
    for lang in LANGUAGES {
        let cfg = askgui_data::PromptConfig { action_language: lang, ..compact.clone() };
        let s = askgui_data::episode_samples(&ep, &cfg, askgui_data::TaskMode::Full).unwrap();
        let system = match &s[0].messages[0].content[0] {
            askgui_data::Part::Text { text } => text.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(system, lang.system_prompt(askgui_data::SystemPrompt::Compact, cfg.frame));
        // One line that names the language's ASK, shorter than the language's full prompt.
        assert!(!system.contains('\n') && system.contains(lang.ask_name()), "{lang:?}: {system}");
        assert!(system.len() < lang.system_prompt(askgui_data::SystemPrompt::Full, cfg.frame).len());
        prompts.push(system);
    }
    assert_eq!(prompts[0], askgui_data::prompt::COMPACT_SYSTEM_PROMPT, "askgui JSON's is today's");
    assert!(prompts[1] != prompts[0] && prompts[2] != prompts[0] && prompts[1] != prompts[2]);
}
