//! End-to-end tests of the converters: the real ScreenAgent sample (skipped with a message when the data
//! folder is absent), small AndroidControl, Multimodal-Mind2Web and GUI-Odyssey records written to their
//! schemas in a temporary folder. (AndroidControl's published TFRecords: `convert_tfrecord.rs`.) Every
//! output must validate with zero problems, and actions and coordinates are checked against the raw
//! records.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Result;
use askgui_data::action::{Action, Direction, DoneStatus, Target};
use askgui_data::convert::{
    base64_encode, convert_android_control, convert_android_control_with, convert_mind2web, convert_mind2web_with,
    convert_screenagent, convert_screenagent_with, key_name, ConvertError, BAD_RECORD,
};
use serde_json::{json, Value};

use common::*;

fn screenagent_sample() -> Option<PathBuf> {
    let dir = std::env::var_os("ASKGUI_SCREENAGENT").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/screenagent-train-sample")
    });
    dir.is_dir().then_some(dir)
}

#[test]
fn screenagent_sample_converts_and_validates() -> Result<()> {
    let Some(input) = screenagent_sample() else {
        eprintln!("SKIPPED screenagent test: no ../shared/data/screenagent-train-sample (or set ASKGUI_SCREENAGENT)");
        return Ok(());
    };
    let out = temp_dir("screenagent");
    let report = convert_screenagent(&input, &out)?;
    let episodes = assert_valid(&out)?;

    // Tally the raw records independently: every mouse action but a move is a step, and so is every
    // keyboard and wait action; a move not followed by a drag is a reported hover; a session whose last
    // record only evaluates `sub_task_success` ends with `done`.
    let (mut sessions, mut expected_steps, mut hovers, mut dones) = (0, 0, 0, 0);
    let mut dirs: Vec<PathBuf> =
        fs::read_dir(&input)?.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect();
    dirs.sort();
    for dir in &dirs {
        let mut files: Vec<PathBuf> = fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with("_translate.json"))
            .collect();
        files.sort();
        if files.is_empty() {
            continue;
        }
        sessions += 1;
        let mut last_only_success = false;
        for f in &files {
            let rec = read_json(f)?;
            let actions = rec["actions"].as_array().cloned().unwrap_or_default();
            let mut gui = 0;
            for (k, a) in actions.iter().enumerate() {
                match (a["action_type"].as_str(), a["mouse_action_type"].as_str()) {
                    (Some("MouseAction"), Some("move")) => {
                        hovers += usize::from(
                            actions.get(k + 1).and_then(|n| n["mouse_action_type"].as_str()) != Some("drag"),
                        );
                    }
                    (Some("MouseAction" | "KeyboardAction" | "WaitAction"), _) => gui += 1,
                    _ => {}
                }
            }
            expected_steps += gui;
            last_only_success = gui == 0 && actions.iter().any(|a| a["situation"].as_str() == Some("sub_task_success"));
        }
        dones += usize::from(last_only_success);
    }
    assert_eq!(report.episodes, sessions);
    assert_eq!(episodes.len(), sessions);
    assert_eq!(report.steps, expected_steps + dones, "{:#?}", report.skipped);
    assert_eq!(report.skipped.iter().filter(|s| s.contains("hover")).count(), hovers, "{:#?}", report.skipped);
    let done_steps = episodes
        .iter()
        .filter(|e| matches!(e.episode.steps.last().map(|s| &s.action), Some(Action::Done { .. })))
        .count();
    assert_eq!(done_steps, dones);

    // Every click lands on a `mouse_position` of the raw record its screenshot came from.
    for ep in &episodes {
        let session = ep.episode.id.strip_prefix("screenagent-").expect("id prefix");
        for (i, s) in ep.episode.steps.iter().enumerate() {
            let Some(t) = s.action.target() else { continue };
            let image = Path::new(&s.screenshot).file_name().and_then(|n| n.to_str()).expect("image name");
            let stem = image.trim_end_matches(".jpg").trim_end_matches(".png");
            let rec = read_json(&input.join(session).join(format!("{stem}_translate.json")))?;
            let hit = rec["actions"].as_array().into_iter().flatten().any(|a| {
                a["mouse_position"]["width"].as_i64() == t.x.map(i64::from)
                    && a["mouse_position"]["height"].as_i64() == t.y.map(i64::from)
            });
            assert!(hit, "{} step {i}: {:?} is in no raw mouse_position of {image}", ep.episode.id, s.action);
        }
    }

    // A known record: click the search box, type the query, press Return (-> enter).
    let (session, stamp) = ("02ea503d419c440cbda9e42263706d6a", "2023-12-20_19-33-28-140419");
    if input.join(session).is_dir() {
        let rec = read_json(&input.join(session).join(format!("{stem}_translate.json", stem = stamp)))?;
        let raw = &rec["actions"];
        let ep = episodes.iter().find(|e| e.episode.id == format!("screenagent-{session}")).expect("session episode");
        assert_eq!(ep.episode.task, rec["task_prompt_en"].as_str().unwrap());
        assert_eq!((ep.episode.screen.width, ep.episode.screen.height), (1024, 768));
        let steps: Vec<&Action> = ep
            .episode
            .steps
            .iter()
            .filter(|s| s.screenshot.ends_with(&format!("{stamp}.jpg")))
            .map(|s| &s.action)
            .collect();
        let (x, y) =
            (raw[0]["mouse_position"]["width"].as_i64().unwrap(), raw[0]["mouse_position"]["height"].as_i64().unwrap());
        assert_eq!((x, y), (487, 193));
        assert_eq!(steps[0], &Action::Click(Target::point(487, 193)));
        assert_eq!(steps[1], &Action::Type { text: raw[1]["keyboard_text"].as_str().unwrap().to_string() });
        assert_eq!(steps[2], &Action::Press { key: "enter".into() });
        assert_eq!(steps.len(), 3);
        assert_eq!(ep.episode.steps.last().unwrap().action, Action::Done { status: DoneStatus::Success });
        // The sample's known totals: 24 sessions; 183 GUI actions + 23 final successes.
        if input.ends_with("screenagent-train-sample") {
            assert_eq!((report.episodes, report.steps), (24, 206));
        }
    }
    fs::remove_dir_all(&out)?;
    Ok(())
}

#[test]
fn screenagent_bad_input_says_what_is_wrong() -> Result<()> {
    let dir = temp_dir("screenagent-bad");
    let e = convert_screenagent(&dir, &dir.join("out")).unwrap_err();
    assert!(matches!(e, ConvertError::NoScreenAgentRecords { .. }), "{e}");
    assert!(e.to_string().contains("_translate.json"), "{e}");

    // One session: a malformed record and a good one.
    let s = dir.join("sess1");
    fs::create_dir_all(s.join("images"))?;
    fs::write(s.join("images/a.png"), png(40, 30, [1, 2, 3]))?;
    fs::write(s.join("2024-01-01_00-00-00-000000_translate.json"), "{\"actions\": [")?;
    let good = json!({"task_prompt_en": "Open the menu", "video_width": 40, "video_height": 30,
        "saved_image_name": "a.png",
        "actions": [{"action_type": "MouseAction", "mouse_action_type": "click", "mouse_button": "left",
                     "mouse_position": {"width": 5, "height": 6}},
                    {"action_type": "MouseAction", "mouse_action_type": "click", "mouse_button": "left",
                     "mouse_position": {"width": 50, "height": 6}},
                    {"action_type": "KeyboardAction", "keyboard_action_type": "press", "keyboard_key": "Ctrl+A"},
                    {"action_type": "KeyboardAction", "keyboard_action_type": "press",
                     "keyboard_key": ["Control_L", "Shift_L", "`"]},
                    {"action_type": "KeyboardAction", "keyboard_action_type": "press", "keyboard_key": "BackSpace"},
                    {"action_type": "MouseAction", "mouse_action_type": "scroll_up", "scroll_repeat": 3}]});
    fs::write(s.join("2024-01-01_00-00-01-000000_translate.json"), good.to_string())?;
    let out = dir.join("out");
    // By default the truncated record stops the conversion, naming its file.
    let e = convert_screenagent(&dir, &out).unwrap_err();
    assert!(matches!(e, ConvertError::BadRecord { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("sess1/2024-01-01_00-00-00-000000_translate.json") && msg.contains("not valid JSON"), "{msg}");
    assert!(msg.contains("--skip-bad-records"), "{msg}");
    let report = convert_screenagent_with(&dir, &out, SKIP_BAD)?;
    let eps = assert_valid(&out)?;
    assert_eq!((report.episodes, report.steps), (1, 5));
    let acts: Vec<&Action> = eps[0].episode.steps.iter().map(|s| &s.action).collect();
    assert_eq!(
        acts,
        [
            &Action::Click(Target::point(5, 6)),
            &Action::Hotkey { keys: vec!["ctrl".into(), "a".into()] },
            &Action::Hotkey { keys: vec!["ctrl".into(), "shift".into(), "`".into()] },
            &Action::Press { key: "backspace".into() },
            &Action::Scroll { x: None, y: None, direction: Direction::Up },
        ]
    );
    assert_eq!(
        (key_name("Return"), key_name("Page_Down"), key_name("Super_L"), key_name("+")),
        ("enter".into(), "pagedown".into(), "super".into(), "+".into())
    );
    let bad = report
        .skipped
        .iter()
        .find(|l| l.contains("2024-01-01_00-00-00-000000_translate.json"))
        .expect("bad record named");
    assert!(bad.contains("not valid JSON"), "{bad}");
    assert!(
        report.skipped.iter().any(|l| l.contains("action 1") && l.contains("outside the 40x30 screen")),
        "{:?}",
        report.skipped
    );
    assert_eq!(report.skip_counts.get(BAD_RECORD), Some(&2), "{:?}", report.skip_counts);
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn android_control_converts_and_validates() -> Result<()> {
    let dir = temp_dir("android");
    let (w, h) = (60, 120);
    let colours = [[200, 0, 0], [0, 200, 0], [0, 0, 200], [90, 90, 90]];
    fs::create_dir_all(dir.join("shots"))?;
    fs::write(dir.join("shots/7_2.png"), png(w, h, colours[2]))?;
    let b64 = |i: usize| base64_encode(&png(w, h, colours[i]));
    let ep7 = json!({
        "episode_id": 7, "goal": "Search for oat milk in the shop app",
        "screenshots": [b64(0), format!("data:image/png;base64,{}", b64(1)), "shots/7_2.png", b64(3)],
        "screenshot_widths": [w, w, w, w], "screenshot_heights": [h, h, h, h],
        "accessibility_trees": ["", "", "", ""],
        "actions": [r#"{"action_type":"open_app","app_name":"Shop"}"#,
                    r#"{"action_type":"click","x":30.4,"y":41}"#,
                    r#"{"action_type":"type","x":10,"y":100,"text":"oat milk"}"#],
        "step_instructions": ["Open the Shop app", "Tap the search bar", "Search for oat milk"]});
    let ep8 = json!({
        "episode_id": "8", "goal": "Scroll, go back and home",
        "screenshots": [b64(0), b64(1), b64(2), b64(3), b64(0), b64(1), b64(2)],
        "actions": [json!({"action_type": "scroll", "direction": "down"}),
                    json!({"action_type": "long_press", "x": 5, "y": 6}),
                    json!({"action_type": "navigate_back"}), json!({"action_type": "wait"}),
                    json!({"action_type": "input_text", "text": "hi"}), json!({"action_type": "navigate_home"})],
        "step_instructions": ["Scroll down", "Hold the item", "Go back", "Wait", "Type hi", "Go home"]});
    // Line 3: not JSON. Line 4: the second action is off-screen: the episode is cut before it.
    let ep9 = json!({"episode_id": 9, "goal": "Cut short", "screenshots": [b64(0), b64(1), b64(2)],
        "actions": [r#"{"action_type":"click","x":1,"y":2}"#, r#"{"action_type":"click","x":1000,"y":2}"#]});
    let ep10 = json!({"episode_id": 10, "goal": "Unknown", "screenshots": [b64(0), b64(1)],
        "actions": [r#"{"action_type":"teleport"}"#]});
    let lines = [ep7.to_string(), ep8.to_string(), "{not json".into(), ep9.to_string(), ep10.to_string()];
    let input = dir.join("android.jsonl");
    fs::write(&input, lines.join("\n") + "\n")?;
    let out = dir.join("out");
    let e = convert_android_control(&input, &out).unwrap_err().to_string();
    assert!(e.contains("android.jsonl line 3") && e.contains("not valid JSON"), "{e}");
    let report = convert_android_control_with(&input, &out, SKIP_BAD)?;
    let eps = assert_valid(&out)?;
    assert_eq!(report.episodes, 3, "{:#?}", report.skipped);
    assert_eq!(
        eps.iter().map(|e| e.episode.id.as_str()).collect::<Vec<_>>(),
        ["androidcontrol-7", "androidcontrol-8", "androidcontrol-9"]
    );

    let e7 = &eps[0];
    assert_eq!((e7.episode.screen.width, e7.episode.screen.height), (w, h));
    assert_eq!(e7.episode.task, "Search for oat milk in the shop app");
    let acts: Vec<&Action> = e7.episode.steps.iter().map(|s| &s.action).collect();
    assert_eq!(
        acts,
        [
            &Action::OpenApp { name: "Shop".into() },
            &Action::Click(Target::point(30, 41)),
            &Action::Click(Target::point(10, 100)),
            &Action::Type { text: "oat milk".into() },
            &Action::Press { key: "enter".into() },
            &Action::Done { status: DoneStatus::Success },
        ]
    );
    let instr: Vec<Option<&str>> = e7.episode.steps.iter().map(|s| s.instruction.as_deref()).collect();
    assert_eq!(instr[..3], [Some("Open the Shop app"), Some("Tap the search bar"), Some("Search for oat milk")]);
    assert_eq!(instr[5], None, "the final `done` has no step instruction");
    // Each step shows the screenshot of its own index (base64, data URL, file path, final state).
    for (step, shot) in [(0, 0), (1, 1), (2, 2), (4, 2), (5, 3)] {
        assert_eq!(pixel(e7, step, 3, 3), colours[shot], "step {step}");
    }

    let acts8: Vec<&Action> = eps[1].episode.steps.iter().map(|s| &s.action).collect();
    assert_eq!(
        acts8,
        [
            &Action::Scroll { x: None, y: None, direction: Direction::Down },
            &Action::LongPress(Target::point(5, 6)),
            &Action::Press { key: "back".into() },
            &Action::Wait { seconds: 2.0 },
            &Action::Type { text: "hi".into() },
            &Action::Press { key: "home".into() },
            &Action::Done { status: DoneStatus::Success },
        ]
    );
    assert_eq!(eps[2].episode.steps.len(), 1, "cut before the off-screen click, so no `done` either");
    assert_eq!(report.steps, 6 + 7 + 1);
    let skipped = report.skipped.join("\n");
    assert!(skipped.contains("line 3") && skipped.contains("not valid JSON"), "{skipped}");
    assert!(
        skipped.contains("line 4 (episode 9) action 1") && skipped.contains("outside the 60x120 screen"),
        "{skipped}"
    );
    assert!(skipped.contains("line 5 (episode 10) action 0") && skipped.contains("teleport"), "{skipped}");
    assert_eq!(report.skip_counts.get(BAD_RECORD), Some(&3), "{:?}", report.skip_counts);
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn android_control_with_nothing_usable_is_an_error() -> Result<()> {
    let dir = temp_dir("android-bad");
    let input = dir.join("a.jsonl");
    fs::write(&input, "{\"episode_id\": 1, \"goal\": \"g\", \"screenshots\": [\"nope\"], \"actions\": []}\n")?;
    let e = convert_android_control_with(&input, &dir.join("out"), SKIP_BAD).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ConvertError::NothingConverted { count: 1, .. }), "{msg}");
    assert!(msg.contains("line 1") && msg.contains("0 actions"), "{msg}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

fn m2w_row(aid: &str, uid: &str, index: usize, op: Value, rect: &str, shot: &str) -> Value {
    let attrs = json!({"bounding_box_rect": rect, "class": "btn"}).to_string();
    let cand = json!({"tag": "button", "is_original_target": true, "is_top_level_target": true,
                      "backend_node_id": format!("n{index}"), "attributes": attrs});
    json!({"annotation_id": aid, "action_uid": uid, "website": "example", "domain": "Travel", "subdomain": "Airlines",
           "confirmed_task": "Find one-way flights from New York to Boston for 2 adults",
           "screenshot": shot, "operation": op.to_string(), "pos_candidates": [cand.to_string()], "neg_candidates": [],
           "target_action_index": index.to_string(), "target_action_reprs": "[button]  Search -> CLICK",
           "action_reprs": []})
}

#[test]
fn mind2web_converts_and_validates() -> Result<()> {
    let dir = temp_dir("mind2web");
    fs::create_dir_all(dir.join("pages"))?;
    fs::write(dir.join("pages/p2.png"), png(80, 90, [0, 0, 250]))?;
    let short = base64_encode(&png(80, 100, [250, 0, 0]));
    let tall = base64_encode(&png(80, 140, [0, 250, 0]));
    let rows = [
        // Out of order on purpose: the converter orders by `target_action_index`.
        m2w_row(
            "t1",
            "u2",
            2,
            json!({"op": "SELECT", "original_op": "SELECT", "value": "2 adults"}),
            "5,60,20,10",
            "pages/p2.png",
        ),
        m2w_row("t1", "u0", 0, json!({"op": "TYPE", "original_op": "TYPE", "value": "Boston"}), "10,20,30,10", &short),
        m2w_row("t1", "u1", 1, json!({"op": "CLICK", "original_op": "CLICK", "value": ""}), "40.5,120,20,11.5", &tall),
        m2w_row("t1", "u3", 3, json!({"op": "CLICK", "original_op": "ENTER", "value": ""}), "0,0,10,10", &short),
        // Task t2: its second row has no positive candidate, so the episode is cut after the first.
        m2w_row("t2", "v0", 0, json!({"op": "CLICK", "original_op": "CLICK"}), "1,1,5,5", &short),
    ];
    let mut lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    let mut no_cand = m2w_row("t2", "v1", 1, json!({"op": "CLICK"}), "1,1,5,5", &short);
    no_cand["pos_candidates"] = json!([]);
    lines.push(no_cand.to_string());
    lines.push("[1, 2".into());
    let input = dir.join("m2w.jsonl");
    fs::write(&input, lines.join("\n"))?;
    let out = dir.join("out");
    let e = convert_mind2web(&input, &out).unwrap_err().to_string();
    assert!(e.contains("m2w.jsonl line 7") && e.contains("not valid JSON"), "{e}");
    let report = convert_mind2web_with(&input, &out, SKIP_BAD)?;
    let eps = assert_valid(&out)?;
    assert_eq!(report.episodes, 2, "{:#?}", report.skipped);
    let t1 = &eps[0];
    assert_eq!(t1.episode.id, "mind2web-t1");
    assert_eq!((t1.episode.screen.width, t1.episode.screen.height), (80, 140), "the tallest page");
    let el = |i: usize| t1.episode.steps[i].elements.as_ref().expect("elements")[0].clone();
    let click = |x, y, id: &str| Action::Click(Target { x: Some(x), y: Some(y), element: Some(id.into()) });
    let acts: Vec<Action> = t1.episode.steps.iter().map(|s| s.action.clone()).collect();
    assert_eq!(
        acts,
        [
            click(25, 25, "n0"),
            Action::Type { text: "Boston".into() },
            click(50, 126, "n1"),
            click(15, 65, "n2"),
            Action::Type { text: "2 adults".into() },
            Action::Press { key: "enter".into() },
        ]
    );
    assert_eq!(el(0).bbox, [10, 20, 40, 30]);
    assert_eq!(el(2).bbox, [40, 120, 61, 132], "fractional boxes grow to whole pixels");
    assert_eq!(el(2).role, "button");
    assert_eq!(el(2).text, "Search");
    // Shorter pages are padded white below; their own pixels stay where they were.
    assert_eq!(pixel(t1, 0, 5, 5), [250, 0, 0]);
    assert_eq!(pixel(t1, 0, 5, 130), [255, 255, 255]);
    assert_eq!(pixel(t1, 2, 5, 130), [0, 250, 0]);
    assert_eq!(pixel(t1, 3, 5, 85), [0, 0, 250]);
    assert_eq!(pixel(t1, 3, 5, 95), [255, 255, 255]);

    assert_eq!(eps[1].episode.steps.len(), 1);
    let skipped = report.skipped.join("\n");
    assert!(
        skipped.contains("m2w.jsonl task t2")
            && skipped.contains("line 6")
            && skipped.contains("no positive candidate"),
        "{skipped}"
    );
    assert!(skipped.contains("line 7") && skipped.contains("not valid JSON"), "{skipped}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A test-split record (`<timestamp>.json`, English-only fields) as the public repository writes them.
fn screenagent_test_record(image: &str, status: &str, current: &str, actions: Value) -> Value {
    json!({"task_prompt": "Open the file menu", "send_prompt": "...", "status": status,
           "LLM_response": "...", "LLM_response_editer": "...", "video_height": 30, "video_width": 40,
           "saved_image_name": image, "current_task": current, "actions": actions})
}

#[test]
fn screenagent_test_layout_converts_and_counts_its_skips() -> Result<()> {
    let dir = temp_dir("screenagent-test-layout");
    let s = dir.join("abc123");
    fs::create_dir_all(s.join("images"))?;
    for (i, name) in ["2024-01-13_21-34-31-146954.png", "2024-01-13_21-37-47-367890.png"].iter().enumerate() {
        fs::write(s.join("images").join(name), png(40, 30, [i as u8 * 100, 0, 0]))?;
    }
    let mouse = |kind: &str, x: i32, y: i32| {
        json!({"action_type": "MouseAction", "mouse_action_type": kind, "mouse_button": "left",
               "mouse_position": {"width": x, "height": y}})
    };
    let plan = screenagent_test_record(
        "2024-01-13_21-34-31-146954.png",
        "planning",
        "Open the menu",
        json!([{"action_type": "PlanAction", "element": "Open the menu"}]),
    );
    let act = screenagent_test_record(
        "2024-01-13_21-34-31-146954.png",
        "acting",
        "Open the menu",
        json!([mouse("down", 3, 4), mouse("up", 3, 4), mouse("down", 5, 6), mouse("up", 20, 25),
               {"action_type": "MouseAction", "mouse_action_type": "move", "mouse_position": {"width": 1, "height": 1}}]),
    );
    let eval = screenagent_test_record(
        "2024-01-13_21-37-47-367890.png",
        "evaluating",
        "Open the menu",
        json!([{"action_type": "EvaluateSubTaskAction", "situation": "sub_task_success"}]),
    );
    fs::write(s.join("2024-01-13_21-34-31-146954.json"), plan.to_string())?;
    fs::write(s.join("2024-01-13_21-35-00-000000.json"), act.to_string())?;
    fs::write(s.join("2024-01-13_21-37-47-367890.json"), eval.to_string())?;
    fs::write(s.join("2024-01-13_21-37-47-367890_neg_eval.json"), eval.to_string())?;
    fs::write(s.join(".DS_Store"), "not a record")?;
    // A session whose screenshots were not published.
    let bare = dir.join("noimages9");
    fs::create_dir_all(&bare)?;
    fs::write(bare.join("2024-01-13_22-00-00-000000.json"), act.to_string())?;

    let out = dir.join("out");
    let report = convert_screenagent(&dir, &out)?;
    let eps = assert_valid(&out)?;
    assert_eq!((report.episodes, report.steps), (1, 3), "{:#?}", report.skipped);
    let ep = &eps[0].episode;
    assert_eq!((ep.id.as_str(), ep.task.as_str()), ("screenagent-abc123", "Open the file menu"));
    let acts: Vec<&Action> = ep.steps.iter().map(|s| &s.action).collect();
    let drag = Action::Drag(askgui_data::action::Segment { x1: 5, y1: 6, x2: 20, y2: 25 });
    assert_eq!(acts, [&Action::Click(Target::point(3, 4)), &drag, &Action::Done { status: DoneStatus::Success }]);
    assert_eq!(ep.steps[0].instruction.as_deref(), Some("Open the menu"), "the test split's current_task");
    let counts: Vec<(&str, usize)> = report.skip_counts.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        counts,
        [
            ("hover (mouse move without a drag)", 1),
            ("negative example record (_neg_eval)", 1),
            ("planning or evaluation action", 2),
            ("session without screenshots", 1),
        ]
    );
    let bare_line = report.skipped.iter().find(|l| l.contains("no screenshots")).expect("bare session reported");
    assert!(bare_line.contains(&bare.display().to_string()), "{bare_line}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Every split of the public repository that is present (train `_translate.json`, test `<timestamp>.json`):
/// each converts with no bad record, validates, and has one episode per session with screenshots.
#[test]
fn screenagent_published_splits_convert_and_validate() -> Result<()> {
    let Some(root) = std::env::var_os("ASKGUI_SCREENAGENT_REPO").map(PathBuf::from).filter(|p| p.is_dir()) else {
        eprintln!("SKIPPED screenagent split test: set ASKGUI_SCREENAGENT_REPO to a ScreenAgent checkout");
        return Ok(());
    };
    for split in ["train", "test"] {
        let input = root.join("data/ScreenAgent").join(split);
        if !input.is_dir() {
            eprintln!("SKIPPED screenagent {split} split: no {}", input.display());
            continue;
        }
        let out = temp_dir(&format!("screenagent-{split}"));
        let report = convert_screenagent(&input, &out)?;
        let episodes = assert_valid(&out)?;
        let with_images = fs::read_dir(&input)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("images").is_dir())
            .count();
        assert_eq!(episodes.len(), with_images, "{split}: {:?}", report.skip_counts);
        assert!(!report.skip_counts.contains_key(BAD_RECORD), "{split}: {:?}", report.skip_counts);
        let negatives: usize =
            report.skip_counts.iter().filter(|(k, _)| k.starts_with("negative")).map(|(_, v)| v).sum();
        assert!(negatives > 0, "{split}: the published splits hold _neg_ records");
        fs::remove_dir_all(&out)?;
    }
    Ok(())
}

/// A GUI-Odyssey annotation with every field `introduction.md` documents.
fn odyssey_annotation(id: &str, steps: Value) -> Value {
    json!({"episode_id": id,
           "device_info": {"product": "sdk_gphone64", "release_version": "14", "sdk_version": "34",
                           "h": 2400, "w": 1080, "device_name": "Pixel 7 Pro"},
           "task_info": {"category": "Multi_Apps", "app": ["DuckDuckGo", "TickTick"],
                         "meta_task": "Search for the next {} and set a reminder.",
                         "task": "Search for the next Fashion Week and set a reminder.",
                         "instruction": "Use DuckDuckGo to find the next Fashion Week, then set a reminder in TickTick."},
           "step_length": steps.as_array().map_or(0, Vec::len), "steps": steps})
}

fn odyssey_step(i: usize, shot: &str, action: &str, info: Value) -> Value {
    json!({"step": i, "screenshot": shot, "action": action, "info": info, "ps": "",
           "description": "a screen", "intention": "go on", "context": "so far",
           "low_level_instruction": format!("step {i}"), "sam2_bbox": []})
}

#[test]
fn gui_odyssey_converts_and_validates() -> Result<()> {
    let dir = temp_dir("odyssey");
    let (w, h) = (50, 100);
    fs::create_dir_all(dir.join("annotations"))?;
    fs::create_dir_all(dir.join("screenshots"))?;
    for i in 0..8 {
        fs::write(dir.join(format!("screenshots/e1_{i}.png")), png(w, h, [i as u8 * 30, 0, 0]))?;
    }
    let shot = |i: usize| format!("e1_{i}.png");
    let steps = json!([
        odyssey_step(0, &shot(0), "CLICK", json!([[500, 250]])),
        odyssey_step(1, &shot(1), "LONG_PRESS", json!([[1000, 1000]])),
        odyssey_step(2, &shot(2), "SCROLL", json!([[500, 800], [500, 200]])),
        odyssey_step(3, &shot(3), "TYPE", json!("fashion week")),
        odyssey_step(4, &shot(4), "CLICK", json!("KEY_BACK")),
        odyssey_step(5, &shot(5), "CLICK", json!("KEY_HOME")),
        odyssey_step(6, &shot(6), "CLICK", json!("KEY_APPSELECT")),
        odyssey_step(7, &shot(7), "COMPLETE", json!("")),
    ]);
    fs::write(dir.join("annotations/e1.json"), odyssey_annotation("e1", steps).to_string())?;
    let missing = json!([odyssey_step(0, "gone.png", "CLICK", json!([[1, 1]]))]);
    fs::write(dir.join("annotations/e2.json"), odyssey_annotation("e2", missing).to_string())?;
    fs::write(dir.join("annotations/e3.json"), "{\"episode_id\": \"e3\", \"steps\": [")?;

    let out = dir.join("out");
    let e = askgui_data::convert::convert_gui_odyssey(&dir, &out).unwrap_err().to_string();
    assert!(e.contains("annotations/e2.json") && e.contains("gone.png"), "{e}");
    let report = askgui_data::convert::convert_gui_odyssey_with(&dir, &out, SKIP_BAD)?;
    let eps = assert_valid(&out)?;
    assert_eq!((report.episodes, report.steps), (1, 8));
    assert_eq!(report.skip_counts.get(BAD_RECORD), Some(&2), "{:#?}", report.skipped);
    assert!(report.skipped.iter().any(|l| l.contains("e3.json") && l.contains("not valid JSON")));
    let ep = &eps[0].episode;
    assert_eq!(ep.id, "guiodyssey-e1");
    assert!(ep.task.starts_with("Use DuckDuckGo"));
    assert_eq!((ep.screen.width, ep.screen.height), (w, h), "the screenshots' size, coordinates scaled to it");
    let acts: Vec<&Action> = ep.steps.iter().map(|s| &s.action).collect();
    let swipe = Action::Swipe(askgui_data::action::Segment { x1: 25, y1: 80, x2: 25, y2: 20 });
    assert_eq!(
        acts,
        [
            &Action::Click(Target::point(25, 25)),
            &Action::LongPress(Target::point(49, 99)),
            &swipe,
            &Action::Type { text: "fashion week".into() },
            &Action::Press { key: "back".into() },
            &Action::Press { key: "home".into() },
            &Action::Press { key: "app_switch".into() },
            &Action::Done { status: DoneStatus::Success },
        ]
    );
    assert_eq!(ep.steps[3].instruction.as_deref(), Some("step 3"));
    assert_eq!(pixel(&eps[0], 2, 1, 1), [60, 0, 0], "each step keeps its own screenshot");
    fs::remove_dir_all(&dir)?;
    Ok(())
}
