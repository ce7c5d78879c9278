//! The official UI-TARS action parser (`@ui-tars/action-parser`, npm) from Rust tests: run by node through
//! `ui_tars_parser.js` beside this file, and its answers read as protocol actions (its own mapping, written
//! here once), and one action of every kind. Shared by askgui-data's agreement test, askgui-runtime's
//! constrained-decoder test and askgui-serve's OpenAI-endpoint test (`#[path]`). Needs node and `ASKGUI_UI_TARS_NODE_MODULES`, a node_modules folder holding the package
//! (`npm install @ui-tars/action-parser@1.2.3`, which `.ci/run` does).
#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};

use askgui_data::language::py_unescape;
use askgui_data::{Action, Ask, AskKind, AskOption, Direction, DoneStatus, Segment, Target};
use serde_json::Value;

/// The official parser's `parsed` list for each text, or `None` (with a SKIPPED line naming `test`) when
/// `ASKGUI_UI_TARS_NODE_MODULES` is not set.
pub fn parse(texts: &[String], test: &str) -> Option<Vec<Value>> {
    let Some(modules) = std::env::var_os("ASKGUI_UI_TARS_NODE_MODULES") else {
        eprintln!(
            "SKIPPED {test}: set ASKGUI_UI_TARS_NODE_MODULES to a node_modules folder with @ui-tars/action-parser"
        );
        return None;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../datasets/tests/official/ui_tars_parser.js");
    let mut node = Command::new("node")
        .arg(script)
        .env("NODE_PATH", &modules)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("ASKGUI_UI_TARS_NODE_MODULES is set, so node must be on PATH");
    node.stdin.take().unwrap().write_all(serde_json::to_string(texts).unwrap().as_bytes()).unwrap();
    let out = node.wait_with_output().unwrap();
    assert!(out.status.success(), "node failed: {}", String::from_utf8_lossy(&out.stdout));
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// The official parser's answer for one text, as a protocol action (its own mapping, written here).
pub fn action(parsed: &Value) -> Action {
    let list = parsed.as_array().expect("a list of actions");
    assert_eq!(list.len(), 1, "one action: {parsed}");
    let (kind, inputs) = (list[0]["action_type"].as_str().unwrap(), &list[0]["action_inputs"]);
    let text = |k: &str| inputs[k].as_str().map(|s| py_unescape(s).unwrap());
    let point = |k: &str| {
        let v: Vec<f64> = serde_json::from_str(inputs[k].as_str()?).unwrap();
        Some((v[0].round() as i32, v[1].round() as i32))
    };
    let target = || {
        let (x, y) = point("start_box").unwrap();
        Target::point(x, y)
    };
    match kind {
        "click" => Action::Click(target()),
        "left_double" => Action::DoubleClick(target()),
        "right_single" => Action::RightClick(target()),
        "long_press" => Action::LongPress(target()),
        "drag" => {
            let ((x1, y1), (x2, y2)) = (point("start_box").unwrap(), point("end_box").unwrap());
            Action::Drag(Segment { x1, y1, x2, y2 })
        }
        "scroll" => {
            let p = point("start_box");
            let direction = serde_json::from_value::<Direction>(Value::String(text("direction").unwrap())).unwrap();
            Action::Scroll { x: p.map(|p| p.0), y: p.map(|p| p.1), direction }
        }
        "type" => Action::Type { text: text("content").unwrap() },
        "hotkey" => {
            let keys: Vec<String> = text("key").unwrap().split(' ').map(String::from).collect();
            if keys.len() == 1 {
                Action::Press { key: keys[0].clone() }
            } else {
                Action::Hotkey { keys }
            }
        }
        "press_home" => Action::Press { key: "home".into() },
        "press_back" => Action::Press { key: "back".into() },
        "open_app" => Action::OpenApp { name: text("app_name").unwrap() },
        "wait" => Action::Wait { seconds: text("time").map_or(5.0, |t| t.parse().unwrap()) },
        "finished" => match text("content") {
            Some(text) => Action::Answer { text },
            None => Action::Done { status: DoneStatus::Success },
        },
        "call_user" => Action::Ask(Ask {
            question: text("content").unwrap(),
            options: text("options").map_or(vec![], |o| serde_json::from_str::<Vec<AskOption>>(&o).unwrap()),
            kind: text("kind").map(|k| serde_json::from_value::<AskKind>(Value::String(k)).unwrap()),
        }),
        other => panic!("the official parser read an action askgui does not write: {other}"),
    }
}

/// One action of every kind the protocol has, and the variants a language writes differently (a scroll with
/// and without a point, the three keys UI-TARS names apart, asks with and without options and kind, both
/// waits' spellings, each `done`), for the tests that run every kind through a language.
pub fn every_action_kind() -> Vec<Action> {
    let option = |l: &str| AskOption { label: l.into(), detail: None };
    let ask = |options: Vec<AskOption>, kind| Action::Ask(Ask { question: "Which size?".into(), options, kind });
    vec![
        Action::Click(Target::point(10, 20)),
        Action::DoubleClick(Target::point(100, 5)),
        Action::RightClick(Target::point(0, 0)),
        Action::LongPress(Target::point(3, 70)),
        Action::Drag(Segment { x1: 1, y1: 2, x2: 30, y2: 40 }),
        Action::Swipe(Segment { x1: 10, y1: 80, x2: 10, y2: 5 }),
        Action::Scroll { x: Some(50), y: Some(40), direction: Direction::Down },
        Action::Scroll { x: None, y: None, direction: Direction::Left },
        Action::Type { text: "oat milk".into() },
        Action::Press { key: "enter".into() },
        Action::Press { key: "back".into() },
        Action::Press { key: "home".into() },
        Action::Hotkey { keys: vec!["ctrl".into(), "shift".into(), "t".into()] },
        Action::OpenApp { name: "Shop".into() },
        Action::Wait { seconds: 3.0 },
        Action::Wait { seconds: 5.0 },
        ask(vec![], None),
        ask(vec![option("Small"), option("Large")], Some(AskKind::Selection)),
        ask(vec![], Some(AskKind::Specification)),
        Action::Answer { text: "42".into() },
        Action::Done { status: DoneStatus::Success },
        Action::Done { status: DoneStatus::Infeasible },
    ]
}
