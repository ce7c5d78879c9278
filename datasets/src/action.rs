//! The action schema: what an agent can do, including `ask`, and the user's `say` reply.
//!
//! An action is a JSON object tagged by `action` (ARCHITECTURE.md, "The agent protocol"). Coordinates are
//! integers in whatever frame the caller is in (screen pixels in datasets, the model frame in prompts;
//! see `frame.rs`); a model may write them as floats, which are rounded on parsing. Click-like actions
//! may name an `element` from the observation's element list instead of, or beside, `x`/`y`.

use serde::{Deserialize, Deserializer, Serialize};

/// Rounds a JSON number (integer or float) to the nearest `i32`; models often write `540.0`.
fn de_coord<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    let v = f64::deserialize(d)?;
    if !v.is_finite() || v.abs() > i32::MAX as f64 {
        return Err(serde::de::Error::custom(format!("coordinate {v} is not a finite pixel position")));
    }
    Ok(v.round() as i32)
}

fn de_opt_coord<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i32>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(deserialize_with = "de_coord")] i32);
    Ok(Option::<W>::deserialize(d)?.map(|W(v)| v))
}

/// Where a click-like action lands: a point, an element of the observation, or both.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct Target {
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_opt_coord")]
    pub x: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_opt_coord")]
    pub y: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub element: Option<String>,
}

impl Target {
    pub fn point(x: i32, y: i32) -> Self {
        Self { x: Some(x), y: Some(y), element: None }
    }

    pub fn xy(&self) -> Option<(i32, i32)> {
        self.x.zip(self.y)
    }
}

/// Two points: the start and end of a swipe or drag.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    #[serde(deserialize_with = "de_coord")]
    pub x1: i32,
    #[serde(deserialize_with = "de_coord")]
    pub y1: i32,
    #[serde(deserialize_with = "de_coord")]
    pub x2: i32,
    #[serde(deserialize_with = "de_coord")]
    pub y2: i32,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Up,
    Down,
    Left,
    Right,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum DoneStatus {
    Success,
    Infeasible,
}

/// What an `ask` asks for: a choice among options on the screen, or a value only the user knows.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum AskKind {
    Selection,
    Specification,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct AskOption {
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The agent's follow-up question (Navi-plus ASK).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub question: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<AskOption>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<AskKind>,
}

/// One agent action. Serialised as `{"action": "<name>", ...fields}`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    Click(Target),
    LongPress(Target),
    DoubleClick(Target),
    RightClick(Target),
    Type {
        text: String,
    },
    Scroll {
        #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_opt_coord")]
        x: Option<i32>,
        #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_opt_coord")]
        y: Option<i32>,
        direction: Direction,
    },
    Swipe(Segment),
    Drag(Segment),
    Press {
        key: String,
    },
    Hotkey {
        keys: Vec<String>,
    },
    OpenApp {
        name: String,
    },
    Wait {
        seconds: f64,
    },
    Ask(Ask),
    Answer {
        text: String,
    },
    Done {
        status: DoneStatus,
    },
}

/// Every action name, in schema order (for prompts and error messages).
pub const ACTION_NAMES: [&str; 15] = [
    "click",
    "long_press",
    "double_click",
    "right_click",
    "type",
    "scroll",
    "swipe",
    "drag",
    "press",
    "hotkey",
    "open_app",
    "wait",
    "ask",
    "answer",
    "done",
];

impl Action {
    pub fn name(&self) -> &'static str {
        match self {
            Action::Click(_) => "click",
            Action::LongPress(_) => "long_press",
            Action::DoubleClick(_) => "double_click",
            Action::RightClick(_) => "right_click",
            Action::Type { .. } => "type",
            Action::Scroll { .. } => "scroll",
            Action::Swipe(_) => "swipe",
            Action::Drag(_) => "drag",
            Action::Press { .. } => "press",
            Action::Hotkey { .. } => "hotkey",
            Action::OpenApp { .. } => "open_app",
            Action::Wait { .. } => "wait",
            Action::Ask(_) => "ask",
            Action::Answer { .. } => "answer",
            Action::Done { .. } => "done",
        }
    }

    pub fn is_ask(&self) -> bool {
        matches!(self, Action::Ask(_))
    }

    /// The click-like target, if this is a click, long press, double or right click.
    pub fn target(&self) -> Option<&Target> {
        match self {
            Action::Click(t) | Action::LongPress(t) | Action::DoubleClick(t) | Action::RightClick(t) => Some(t),
            _ => None,
        }
    }

    /// Every point the action carries, in order.
    pub fn points(&self) -> Vec<(i32, i32)> {
        match self {
            Action::Click(t) | Action::LongPress(t) | Action::DoubleClick(t) | Action::RightClick(t) => {
                t.xy().into_iter().collect()
            }
            Action::Scroll { x: Some(x), y: Some(y), .. } => vec![(*x, *y)],
            Action::Swipe(s) | Action::Drag(s) => vec![(s.x1, s.y1), (s.x2, s.y2)],
            _ => vec![],
        }
    }

    /// The same action without the element id of a click-like target that also has a point. An id only
    /// means something to a model that is shown the element list; one that is not would learn ids from
    /// their numbering instead (a world whose confirm button is always `e4` gives it away without a
    /// look at the screen).
    pub fn without_element(&self) -> Action {
        let mut a = self.clone();
        if let Action::Click(t) | Action::LongPress(t) | Action::DoubleClick(t) | Action::RightClick(t) = &mut a {
            if t.xy().is_some() {
                t.element = None;
            }
        }
        a
    }

    /// The same action with every point passed through `f` (a change of coordinate frame).
    pub fn map_points(&self, f: impl Fn(i32, i32) -> (i32, i32)) -> Action {
        let mut a = self.clone();
        match &mut a {
            Action::Click(t) | Action::LongPress(t) | Action::DoubleClick(t) | Action::RightClick(t) => {
                if let Some((x, y)) = t.xy() {
                    let (nx, ny) = f(x, y);
                    (t.x, t.y) = (Some(nx), Some(ny));
                }
            }
            Action::Scroll { x, y, .. } => {
                if let (Some(px), Some(py)) = (*x, *y) {
                    let (nx, ny) = f(px, py);
                    (*x, *y) = (Some(nx), Some(ny));
                }
            }
            Action::Swipe(s) | Action::Drag(s) => {
                (s.x1, s.y1) = f(s.x1, s.y1);
                (s.x2, s.y2) = f(s.x2, s.y2);
            }
            _ => {}
        }
        a
    }

    /// Checks what serde cannot: a click-like action needs both `x` and `y`, or an `element`; texts,
    /// keys, questions are non-empty; `wait` is a finite, non-negative time.
    pub fn check(&self) -> Result<(), String> {
        let nonempty = |field: &str, s: &str| {
            if s.trim().is_empty() {
                Err(format!("`{}` needs a non-empty `{field}`", self.name()))
            } else {
                Ok(())
            }
        };
        match self {
            Action::Click(t) | Action::LongPress(t) | Action::DoubleClick(t) | Action::RightClick(t) => {
                match (t.x, t.y, &t.element) {
                    (Some(_), Some(_), _) | (None, None, Some(_)) => Ok(()),
                    (Some(_), None, _) => Err(format!("`{}` has `x` but no `y`", self.name())),
                    (None, Some(_), _) => Err(format!("`{}` has `y` but no `x`", self.name())),
                    (None, None, None) => Err(format!("`{}` needs `x` and `y`, or `element`", self.name())),
                }
            }
            Action::Scroll { x, y, .. } if x.is_some() != y.is_some() => {
                Err("`scroll` needs both `x` and `y`, or neither".into())
            }
            Action::Type { text } => nonempty("text", text),
            Action::Press { key } => nonempty("key", key),
            Action::Hotkey { keys } if keys.is_empty() || keys.iter().any(|k| k.trim().is_empty()) => {
                Err("`hotkey` needs a non-empty list of non-empty `keys`".into())
            }
            Action::OpenApp { name } => nonempty("name", name),
            Action::Wait { seconds } if !seconds.is_finite() || *seconds < 0.0 => {
                Err(format!("`wait` needs a non-negative number of `seconds`, got {seconds}"))
            }
            Action::Ask(a) => nonempty("question", &a.question),
            Action::Answer { text } => nonempty("text", text),
            _ => Ok(()),
        }
    }

    /// The compact JSON the model is trained to write, e.g. `{"action":"click","x":540,"y":1210}`.
    pub fn render(&self) -> String {
        serde_json::to_string(self).expect("actions always serialise")
    }
}

/// One turn of the agent/user dialogue inside an episode's history.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "turn", rename_all = "snake_case")]
pub enum Turn {
    /// The agent acted (an `ask` is an action too).
    Agent { action: Action },
    /// The user's reply to an `ask`.
    Say { text: String },
}
