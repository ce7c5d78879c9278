//! Step matching: is a predicted action the annotated one?
//!
//! Which rules score a step depends on where its episode came from ([`RuleSet`], `--match-rules`, by
//! default chosen from the converter's id prefix): AndroidControl, Mind2Web and GUI-Odyssey episodes are
//! scored as those datasets' published evaluations score them ([`published`]); every other episode (the synthetic
//! world) by our own rules, made explicit and configurable ([`MatchConfig`], also clap arguments):
//! - the action types must be equal (`click` never matches `long_press`);
//! - click-like actions (click, long_press, double_click, right_click): when the annotated action has a
//!   *target element* (the element it names, or else the smallest element of the step's list that contains
//!   its point and covers at most `max_box_fraction` of the screen), the predicted point must lie inside
//!   that element's box (or the prediction names the same element). Otherwise the points must be within
//!   `distance` of each other in screen-normalised coordinates:
//!   `sqrt(((x_p - x_g) / W)^2 + ((y_p - y_g) / H)^2) <= distance` (AITW's 0.14, "14% of the screen").
//!   With `box_or_distance` (AITW's own rule), being inside the box OR within the distance suffices;
//! - `type` and `answer`: token F1 of lower-cased alphanumeric tokens `> text_f1` (both empty: a match);
//! - `scroll`: same direction; `swipe`: same dominant direction of motion; `drag`: both end points within
//!   `distance`;
//! - `press`: same normalised key (case, `KEYCODE_`/`key_` prefixes, separators and common aliases such as
//!   return/enter, esc/escape ignored); `hotkey`: the same set of normalised keys; `open_app`: the same
//!   name once lower-cased with everything but letters and digits removed;
//! - `wait`: any wait; `done`: same status; `ask`: any ask (its content is scored separately).

pub mod published;

use askgui_data::{Action, Direction, Element, Episode, Screen, Segment, Target};
use serde::{Deserialize, Serialize};

/// Which rules score the steps of an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RuleSet {
    /// By the episode's source: ids `androidcontrol-...`, `mind2web-...` and `guiodyssey-...` (the
    /// converters' prefixes) get that dataset's rules, every other episode the synthetic world's.
    #[default]
    Auto,
    /// Our rules (the --match-* flags) for every episode.
    Synthetic,
    /// AITW's action matching, with text compared.
    AndroidControl,
    /// Mind2Web's element accuracy and operation F1 = 1.
    #[value(name = "mind2web", alias = "mind2-web")]
    #[serde(rename = "mind2web", alias = "mind2-web")]
    Mind2Web,
    /// GUI-Odyssey's own action matching.
    GuiOdyssey,
}

impl RuleSet {
    /// The rules that score episode `id`: itself, or for `Auto` the one its id prefix names.
    pub fn resolve(self, id: &str) -> RuleSet {
        match self {
            RuleSet::Auto if id.starts_with("androidcontrol-") => RuleSet::AndroidControl,
            RuleSet::Auto if id.starts_with("mind2web-") => RuleSet::Mind2Web,
            // Not AndroidControl's AITW rule, though both are Android: GUI-Odyssey's evaluation compares
            // text leniently and scrolls by direction, where AITW compares no text and gestures by axis.
            RuleSet::Auto if id.starts_with("guiodyssey-") => RuleSet::GuiOdyssey,
            RuleSet::Auto => RuleSet::Synthetic,
            other => other,
        }
    }
}

/// The thresholds of step matching.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct MatchConfig {
    /// Click-like actions without a target box: the largest screen-normalised distance that matches.
    #[arg(long = "match-distance", default_value_t = 0.14)]
    pub distance: f64,
    /// `type`/`answer` texts match when their token F1 is strictly above this.
    #[arg(long = "match-text-f1", default_value_t = 0.5)]
    pub text_f1: f64,
    /// A box inferred from the annotated point (no element named) is used only when it covers at most
    /// this fraction of the screen.
    #[arg(long = "match-max-box-fraction", default_value_t = 0.5)]
    pub max_box_fraction: f64,
    /// Do not infer the target element from the annotated point; only a named element gives a box.
    #[arg(long = "match-no-infer-element", default_value_t = false)]
    pub no_infer_element: bool,
    /// AITW's rule: inside the target box OR within the distance (default: the box alone when known).
    #[arg(long = "match-box-or-distance", default_value_t = false)]
    pub box_or_distance: bool,
    /// Count a point on a target box's right or bottom edge as inside (default: boxes are half-open,
    /// `[x1, x2) x [y1, y2)`, as episodes store them).
    #[arg(long = "match-box-edges", default_value_t = false)]
    #[serde(default)]
    pub box_edges: bool,
    /// Which rules score a step: auto (AndroidControl's and Mind2Web's published rules for the episodes
    /// converted from them, ours for the rest), or one set for every episode.
    #[arg(long = "match-rules", value_enum, default_value_t = RuleSet::Auto)]
    #[serde(default)]
    pub rules: RuleSet,
}

impl Default for MatchConfig {
    fn default() -> Self {
        Self {
            distance: 0.14,
            text_f1: 0.5,
            max_box_fraction: 0.5,
            no_infer_element: false,
            box_or_distance: false,
            box_edges: false,
            rules: RuleSet::Auto,
        }
    }
}

impl MatchConfig {
    /// Whether `pred` matches the annotated action of step `step` of `ep`, under the rules of its source.
    pub fn matches_step(&self, pred: &Action, ep: &Episode, step: usize) -> bool {
        let s = &ep.steps[step];
        let els = s.elements.as_deref();
        match self.rules.resolve(&ep.id) {
            RuleSet::AndroidControl => published::android_control(self, pred, &s.action, ep.screen, els),
            RuleSet::Mind2Web => published::mind2web(self, pred, &s.action, ep.screen, els),
            RuleSet::GuiOdyssey => published::gui_odyssey(self, pred, &s.action, ep.screen, els),
            RuleSet::Auto | RuleSet::Synthetic => self.matches(pred, &s.action, ep.screen, els),
        }
    }

    /// Whether `pred` matches the annotated `gold` action of a step on `screen` with `elements`, by our
    /// (synthetic world's) rules.
    pub fn matches(&self, pred: &Action, gold: &Action, screen: Screen, elements: Option<&[Element]>) -> bool {
        match (pred, gold) {
            (Action::Click(p), Action::Click(g))
            | (Action::LongPress(p), Action::LongPress(g))
            | (Action::DoubleClick(p), Action::DoubleClick(g))
            | (Action::RightClick(p), Action::RightClick(g)) => self.targets_match(p, g, screen, elements),
            (Action::Type { text: p }, Action::Type { text: g })
            | (Action::Answer { text: p }, Action::Answer { text: g }) => token_f1(p, g) > self.text_f1,
            (Action::Scroll { direction: p, .. }, Action::Scroll { direction: g, .. }) => p == g,
            (Action::Swipe(p), Action::Swipe(g)) => swipe_direction(p) == swipe_direction(g),
            (Action::Drag(p), Action::Drag(g)) => {
                self.near((p.x1, p.y1), (g.x1, g.y1), screen) && self.near((p.x2, p.y2), (g.x2, g.y2), screen)
            }
            (Action::Press { key: p }, Action::Press { key: g }) => normalize_key(p) == normalize_key(g),
            (Action::Hotkey { keys: p }, Action::Hotkey { keys: g }) => {
                let norm = |ks: &[String]| {
                    let mut v: Vec<String> = ks.iter().map(|k| normalize_key(k)).collect();
                    v.sort();
                    v
                };
                norm(p) == norm(g)
            }
            (Action::OpenApp { name: p }, Action::OpenApp { name: g }) => normalize_name(p) == normalize_name(g),
            (Action::Wait { .. }, Action::Wait { .. }) | (Action::Ask(_), Action::Ask(_)) => true,
            (Action::Done { status: p }, Action::Done { status: g }) => p == g,
            _ => false,
        }
    }

    fn targets_match(&self, p: &Target, g: &Target, screen: Screen, elements: Option<&[Element]>) -> bool {
        let find = |id: &str| elements.and_then(|els| els.iter().find(|e| e.id == id));
        let gold_box = self.gold_element(g, screen, elements);
        if let (Some(b), Some(pid)) = (gold_box, p.element.as_deref()) {
            if b.id == pid {
                return true;
            }
        }
        // The predicted point: its own, or the centre of the element it names.
        let Some(pp) = p.xy().or_else(|| p.element.as_deref().and_then(find).map(Element::center)) else {
            return false;
        };
        let in_box = gold_box.map(|b| self.inside(b, pp.0, pp.1));
        let gp = g.xy().or_else(|| g.element.as_deref().and_then(find).map(Element::center));
        let near = gp.is_some_and(|gp| self.near(pp, gp, screen));
        match in_box {
            Some(inside) if self.box_or_distance => inside || near,
            Some(inside) => inside,
            None => near,
        }
    }

    /// The annotated action's target element: the one it names, else (unless disabled) the smallest
    /// element containing its point that is not larger than `max_box_fraction` of the screen.
    fn gold_element<'e>(&self, g: &Target, screen: Screen, elements: Option<&'e [Element]>) -> Option<&'e Element> {
        let els = elements?;
        if let Some(id) = g.element.as_deref() {
            if let Some(e) = els.iter().find(|e| e.id == id) {
                return Some(e);
            }
        }
        if self.no_infer_element {
            return None;
        }
        let (x, y) = g.xy()?;
        let screen_area = f64::from(screen.width.max(1)) * f64::from(screen.height.max(1));
        els.iter()
            .filter(|e| self.inside(e, x, y) && (area(e) as f64) <= self.max_box_fraction * screen_area)
            .min_by_key(|e| area(e))
    }

    /// Whether `(x, y)` is in `e`'s box: half-open as stored, or with its right and bottom edges when
    /// `box_edges` is set.
    fn inside(&self, e: &Element, x: i32, y: i32) -> bool {
        let [x1, y1, x2, y2] = e.bbox;
        match self.box_edges {
            true => x >= x1 && x <= x2 && y >= y1 && y <= y2,
            false => e.contains(x, y),
        }
    }

    /// Whether two points are within `distance` in screen-normalised coordinates.
    pub fn near(&self, a: (i32, i32), b: (i32, i32), screen: Screen) -> bool {
        normalized_distance(a, b, screen) <= self.distance
    }
}

fn area(e: &Element) -> i64 {
    let [x1, y1, x2, y2] = e.bbox;
    (i64::from(x2) - i64::from(x1)).max(0) * (i64::from(y2) - i64::from(y1)).max(0)
}

/// `sqrt((dx / W)^2 + (dy / H)^2)`; a zero-sized screen side counts as 1 pixel.
pub fn normalized_distance(a: (i32, i32), b: (i32, i32), screen: Screen) -> f64 {
    let dx = (f64::from(a.0) - f64::from(b.0)) / f64::from(screen.width.max(1));
    let dy = (f64::from(a.1) - f64::from(b.1)) / f64::from(screen.height.max(1));
    (dx * dx + dy * dy).sqrt()
}

/// Lower-cased runs of letters and digits.
pub fn tokens(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric()).filter(|t| !t.is_empty()).map(str::to_lowercase).collect()
}

/// Token F1 (SQuAD style, multiset overlap): `2 * overlap / (|pred| + |gold|)`; 1 when both are empty.
pub fn token_f1(pred: &str, gold: &str) -> f64 {
    let p = tokens(pred);
    let mut g = tokens(gold);
    if p.is_empty() && g.is_empty() {
        return 1.0;
    }
    let total = p.len() + g.len();
    let mut overlap = 0usize;
    for t in &p {
        if let Some(i) = g.iter().position(|x| x == t) {
            g.swap_remove(i);
            overlap += 1;
        }
    }
    2.0 * overlap as f64 / total as f64
}

/// The dominant direction of a swipe's motion (ties go to the horizontal axis); None when it does not move.
fn swipe_direction(s: &Segment) -> Option<Direction> {
    let (dx, dy) = (i64::from(s.x2) - i64::from(s.x1), i64::from(s.y2) - i64::from(s.y1));
    if dx == 0 && dy == 0 {
        return None;
    }
    Some(if dx.abs() >= dy.abs() {
        if dx > 0 {
            Direction::Right
        } else {
            Direction::Left
        }
    } else if dy > 0 {
        Direction::Down
    } else {
        Direction::Up
    })
}

/// A key name without case, `KEYCODE_`/`key_` prefixes or separators, with common aliases folded.
pub fn normalize_key(k: &str) -> String {
    let mut s = k.trim().to_lowercase();
    for prefix in ["keycode_", "key_"] {
        if let Some(rest) = s.strip_prefix(prefix) {
            s = rest.to_string();
        }
    }
    let s: String = s.chars().filter(|c| c.is_alphanumeric()).collect();
    let alias = match s.as_str() {
        "return" | "enterkey" => "enter",
        "esc" => "escape",
        "del" => "delete",
        "backspace" | "bksp" => "backspace",
        "goback" | "navigateback" | "navback" => "back",
        "gohome" | "navigatehome" | "navhome" => "home",
        "control" | "ctl" => "ctrl",
        "command" | "cmd" | "meta" | "super" | "win" | "windows" => "meta",
        "option" | "opt" => "alt",
        other => other,
    };
    alias.to_string()
}

/// An app name lower-cased with only letters and digits kept.
pub fn normalize_name(n: &str) -> String {
    n.chars().filter(|c| c.is_alphanumeric()).flat_map(char::to_lowercase).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use askgui_data::{DoneStatus, Target};

    pub(crate) const SCREEN: Screen = Screen { width: 1000, height: 2000 };

    pub(crate) fn click(x: i32, y: i32) -> Action {
        Action::Click(Target::point(x, y))
    }

    pub(crate) fn el(id: &str, bbox: [i32; 4]) -> Element {
        Element { id: id.into(), role: String::new(), text: String::new(), bbox }
    }

    #[test]
    fn click_distance_is_screen_normalised() {
        let m = MatchConfig::default();
        // dx = 140 px of 1000 = 0.14 exactly: matches (<=).
        assert!(m.matches(&click(640, 1000), &click(500, 1000), SCREEN, None));
        // dx = 0.1, dy = 200/2000 = 0.1: sqrt(0.02) = 0.1414 > 0.14.
        assert!(!m.matches(&click(600, 1200), &click(500, 1000), SCREEN, None));
        // dy = 280 px of 2000 = 0.14: matches; the same pixels horizontally (0.28) do not.
        assert!(m.matches(&click(500, 1280), &click(500, 1000), SCREEN, None));
        assert!(!m.matches(&click(780, 1000), &click(500, 1000), SCREEN, None));
        // Another click-like type never matches.
        assert!(!m.matches(&Action::LongPress(Target::point(500, 1000)), &click(500, 1000), SCREEN, None));
    }

    #[test]
    fn click_inside_target_box() {
        let m = MatchConfig::default();
        let els =
            vec![el("root", [0, 0, 1000, 2000]), el("row", [0, 900, 1000, 1000]), el("other", [0, 1000, 1000, 1100])];
        let gold = click(500, 950);
        // 10 px away but in the next row: outside the box, no match although very near.
        assert!(!m.matches(&click(500, 1005), &gold, SCREEN, Some(&els)));
        // Far along the row but inside it: a match.
        assert!(m.matches(&click(990, 901), &gold, SCREEN, Some(&els)));
        // AITW's OR rule accepts the near miss.
        let aitw = MatchConfig { box_or_distance: true, ..m };
        assert!(aitw.matches(&click(500, 1005), &gold, SCREEN, Some(&els)));
        // Without inference the box is unknown: distance rule.
        let no_infer = MatchConfig { no_infer_element: true, ..m };
        assert!(no_infer.matches(&click(500, 1005), &gold, SCREEN, Some(&els)));
        // A named element, predicted by name or by point.
        let named = Action::Click(Target { x: None, y: None, element: Some("other".into()) });
        assert!(m.matches(&named, &named, SCREEN, Some(&els)));
        assert!(m.matches(&click(10, 1050), &named, SCREEN, Some(&els)));
        assert!(!m.matches(&click(10, 950), &named, SCREEN, Some(&els)));
        // Only the full-screen root contains the point: too large to be a target, distance rule.
        assert!(!m.matches(&click(10, 10), &click(500, 1500), SCREEN, Some(&els[..1])));
    }

    #[test]
    fn box_edges() {
        // Rows [900, 1000) and [1000, 1100) share the line y = 1000; the annotated click is the first
        // row's centre. Half-open boxes (the default): (500, 1000) is the second row's first line, not the
        // first row's, so no match; (999, 950) is the first row's last column, a match; (1000, 950) is
        // past it.
        let els = vec![el("row", [0, 900, 1000, 1000]), el("next", [0, 1000, 1000, 1100])];
        let gold = click(500, 950);
        let m = MatchConfig::default();
        assert!(!m.matches(&click(500, 1000), &gold, SCREEN, Some(&els)));
        assert!(m.matches(&click(999, 950), &gold, SCREEN, Some(&els)));
        assert!(!m.matches(&click(1000, 950), &gold, SCREEN, Some(&els)));
        // With the right and bottom edges inside, both points on the edges match.
        let edges = MatchConfig { box_edges: true, ..m };
        assert!(edges.matches(&click(500, 1000), &gold, SCREEN, Some(&els)));
        assert!(edges.matches(&click(1000, 950), &gold, SCREEN, Some(&els)));
        assert!(!edges.matches(&click(500, 1001), &gold, SCREEN, Some(&els)));
    }

    #[test]
    fn rule_names_on_the_command_line() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            m: MatchConfig,
        }
        use clap::Parser;
        // The names eval/README.md lists, and the earlier spelling of Mind2Web's.
        for (name, rules) in [
            ("synthetic", RuleSet::Synthetic),
            ("android-control", RuleSet::AndroidControl),
            ("mind2web", RuleSet::Mind2Web),
            ("mind2-web", RuleSet::Mind2Web),
            ("gui-odyssey", RuleSet::GuiOdyssey),
        ] {
            let cli = Cli::try_parse_from(["x", "--match-rules", name]).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(cli.m.rules, rules);
        }
        let json = serde_json::to_string(&RuleSet::Mind2Web).unwrap();
        assert_eq!(json, "\"mind2web\"");
        assert_eq!(serde_json::from_str::<RuleSet>("\"mind2-web\"").unwrap(), RuleSet::Mind2Web);
    }

    #[test]
    fn text_scroll_keys_apps() {
        let m = MatchConfig::default();
        let ty = |t: &str| Action::Type { text: t.into() };
        // pred {oat, milk}, gold {oat, milk, latte}: F1 = 2*2/(2+3) = 0.8.
        assert!((token_f1("Oat milk", "oat milk latte") - 0.8).abs() < 1e-12);
        assert!(m.matches(&ty("Oat milk"), &ty("oat milk latte"), SCREEN, None));
        // {oat}, {oat, milk, latte}: 2/4 = 0.5, not strictly above.
        assert!(!m.matches(&ty("oat"), &ty("oat milk latte"), SCREEN, None));
        let sc = |d| Action::Scroll { x: None, y: None, direction: d };
        assert!(m.matches(&sc(Direction::Down), &sc(Direction::Down), SCREEN, None));
        assert!(!m.matches(&sc(Direction::Up), &sc(Direction::Down), SCREEN, None));
        let press = |k: &str| Action::Press { key: k.into() };
        assert!(m.matches(&press("KEYCODE_BACK"), &press("back"), SCREEN, None));
        assert!(m.matches(&press("Return"), &press("enter"), SCREEN, None));
        assert!(!m.matches(&press("home"), &press("back"), SCREEN, None));
        let app = |n: &str| Action::OpenApp { name: n.into() };
        assert!(m.matches(&app("Google Maps"), &app("google-maps"), SCREEN, None));
        let hk = |k: &[&str]| Action::Hotkey { keys: k.iter().map(|s| s.to_string()).collect() };
        assert!(m.matches(&hk(&["c", "Control"]), &hk(&["ctrl", "c"]), SCREEN, None));
        let swipe = |x1, y1, x2, y2| Action::Swipe(Segment { x1, y1, x2, y2 });
        assert!(m.matches(&swipe(500, 1500, 510, 500), &swipe(0, 1900, 0, 100), SCREEN, None));
        assert!(!m.matches(&swipe(500, 500, 500, 1500), &swipe(0, 1900, 0, 100), SCREEN, None));
        let done = |s| Action::Done { status: s };
        assert!(!m.matches(&done(DoneStatus::Success), &done(DoneStatus::Infeasible), SCREEN, None));
        assert!(m.matches(&Action::Wait { seconds: 1.0 }, &Action::Wait { seconds: 3.0 }, SCREEN, None));
    }

    #[test]
    fn rules_follow_the_episode_source() {
        use askgui_data::{Episode, Platform, Step};
        let ep = |id: &str| Episode {
            id: id.into(),
            platform: Platform::Android,
            screen: SCREEN,
            task: "t".into(),
            ambiguous_task: None,
            steps: vec![Step {
                screenshot: "s.png".into(),
                elements: None,
                instruction: None,
                informative: None,
                action: Action::Type { text: "oat milk latte".into() },
                ask: None,
            }],
        };
        assert_eq!(RuleSet::Auto.resolve("androidcontrol-42"), RuleSet::AndroidControl);
        assert_eq!(RuleSet::Auto.resolve("mind2web-abc"), RuleSet::Mind2Web);
        assert_eq!(RuleSet::Auto.resolve("guiodyssey-9"), RuleSet::GuiOdyssey);
        assert_eq!(RuleSet::Auto.resolve("synth-7"), RuleSet::Synthetic);
        assert_eq!(RuleSet::Synthetic.resolve("mind2web-abc"), RuleSet::Synthetic);
        // "oat milk" against "oat milk latte": token F1 0.8 > 0.5 by our rules; the token sets differ, so
        // not under AndroidControl's or Mind2Web's.
        let pred = Action::Type { text: "oat milk".into() };
        let m = MatchConfig::default();
        assert!(m.matches_step(&pred, &ep("synth-7"), 0));
        assert!(!m.matches_step(&pred, &ep("androidcontrol-42"), 0));
        assert!(!m.matches_step(&pred, &ep("mind2web-abc"), 0));
        // GUI-Odyssey's: one text inside the other is enough.
        assert!(m.matches_step(&pred, &ep("guiodyssey-9"), 0));
        let forced = MatchConfig { rules: RuleSet::Synthetic, ..m };
        assert!(forced.matches_step(&pred, &ep("mind2web-abc"), 0));
    }

    #[test]
    fn degenerate_screen_does_not_panic() {
        let m = MatchConfig::default();
        let s = Screen { width: 0, height: 0 };
        assert!(m.matches(&click(0, 0), &click(0, 0), s, None));
        assert!(!m.matches(&click(5, 0), &click(0, 0), s, None));
    }
}
