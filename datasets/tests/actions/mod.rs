//! Random protocol actions for the property tests (every action kind, every optional field).
#![allow(dead_code)]

use askgui_data::{Action, Ask, AskKind, AskOption, Direction, DoneStatus, Segment, Target};
use proptest::prelude::*;

/// Printable text including quotes, backslashes, braces, `:`/`=`/`<`/`|`/`>`, newlines and unicode,
/// never blank.
pub fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 {}\"'\\\\:,.!?=<>|_\né中-]{0,24}[a-zA-Z0-9]"
}

pub fn coord() -> impl Strategy<Value = i32> {
    -5000i32..5000
}

pub fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        (coord(), coord()).prop_map(|(x, y)| Target::point(x, y)),
        "e[0-9]{1,3}".prop_map(|e| Target { x: None, y: None, element: Some(e) }),
        (coord(), coord(), "e[0-9]{1,3}").prop_map(|(x, y, e)| Target { x: Some(x), y: Some(y), element: Some(e) }),
    ]
}

pub fn segment() -> impl Strategy<Value = Segment> {
    (coord(), coord(), coord(), coord()).prop_map(|(x1, y1, x2, y2)| Segment { x1, y1, x2, y2 })
}

/// A key name: mostly plain (`enter`, `ctrl`), sometimes `back`/`home`, sometimes any text.
pub fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z][a-z0-9_]{0,7}",
        1 => prop_oneof![Just("back".to_string()), Just("home".to_string())],
        1 => text(),
    ]
}

/// Any action of the protocol, every field random.
pub fn action() -> impl Strategy<Value = Action> {
    let dir = prop_oneof![Just(Direction::Up), Just(Direction::Down), Just(Direction::Left), Just(Direction::Right)];
    let option = (text(), proptest::option::of(text())).prop_map(|(label, detail)| AskOption { label, detail });
    let kind = proptest::option::of(prop_oneof![Just(AskKind::Selection), Just(AskKind::Specification)]);
    prop_oneof![
        target().prop_map(Action::Click),
        target().prop_map(Action::LongPress),
        target().prop_map(Action::DoubleClick),
        target().prop_map(Action::RightClick),
        text().prop_map(|text| Action::Type { text }),
        (proptest::option::of((coord(), coord())), dir).prop_map(|(p, direction)| Action::Scroll {
            x: p.map(|p| p.0),
            y: p.map(|p| p.1),
            direction
        }),
        segment().prop_map(Action::Swipe),
        segment().prop_map(Action::Drag),
        key().prop_map(|key| Action::Press { key }),
        proptest::collection::vec(key(), 1..4).prop_map(|keys| Action::Hotkey { keys }),
        text().prop_map(|name| Action::OpenApp { name }),
        (0u32..600).prop_map(|t| Action::Wait { seconds: t as f64 / 4.0 }),
        (text(), proptest::collection::vec(option, 0..4), kind)
            .prop_map(|(question, options, kind)| Action::Ask(Ask { question, options, kind })),
        text().prop_map(|text| Action::Answer { text }),
        prop_oneof![Just(DoneStatus::Success), Just(DoneStatus::Infeasible)].prop_map(|status| Action::Done { status }),
    ]
}
