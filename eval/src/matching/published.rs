//! Step matching of the datasets' own evaluations, for episodes converted from AndroidControl,
//! Multimodal-Mind2Web (Navi-plus §3.1 says it follows them: "the target element and text") and GUI-Odyssey.
//!
//! - AndroidControl publishes no evaluation code (google-research/android_control holds the README and
//!   images only), so its steps use the action matching its authors' group published for AITW
//!   (google-research/android_in_the_wild/action_matching.py), the rule AndroidControl evaluations reuse:
//!   two taps match when they are within 0.14 of the screen, or both inside one of the screen's element
//!   boxes grown by 1.4 times its size; gestures by their main axis; other actions by type. AITW does not
//!   compare typed text, which Navi-plus requires: we compare whitespace token sets, case folded.
//! - Mind2Web (OSU-NLP-Group/Mind2Web, `ActionEvaluatorMultiChoice`): a step is right when the element is
//!   a positive candidate and the operation F1 is 1, i.e. the whitespace token sets of `op value` are
//!   equal (as written, case kept). On screenshots: the point inside the target element's box.
//! - GUI-Odyssey (OpenGVLab/GUI-Odyssey, `src/eval_mm/GUIOdyssey_action_matching.py`): same action type;
//!   click and long press within 0.14 in coordinates normalised by the screen (its 0..1000 grid), or inside
//!   a SAM2 box given beside the dataset (not in converted episodes); text when one trimmed text contains
//!   the other or their normalised Levenshtein similarity is at least 0.5; scroll by its direction; other
//!   actions by type (its home, back and app-switch are types: our key).

use askgui_data::{Action, Element, Screen, Segment, Target};

use super::{normalize_key, normalize_name, MatchConfig};

/// AITW's `ANNOTATION_WIDTH_AUGMENT_FRACTION` and `..._HEIGHT_...`: a box grows by 1.4 times its size
/// (0.7 on each side), clipped at the screen's top-left, its size at most the screen's.
pub const AITW_BOX_AUGMENT: f64 = 1.4;

/// AndroidControl steps (see the module header).
pub fn android_control(
    cfg: &MatchConfig,
    pred: &Action,
    gold: &Action,
    screen: Screen,
    elements: Option<&[Element]>,
) -> bool {
    match (pred, gold) {
        (Action::Click(p), Action::Click(g)) | (Action::LongPress(p), Action::LongPress(g)) => {
            aitw_taps_match(cfg, p, g, screen, elements)
        }
        (Action::Type { text: p }, Action::Type { text: g }) => same_token_set(p, g, true),
        (Action::Scroll { direction: p, .. }, Action::Scroll { direction: g, .. }) => p == g,
        (Action::Swipe(p), Action::Swipe(g)) | (Action::Drag(p), Action::Drag(g)) => main_axis(p) == main_axis(g),
        (Action::Press { key: p }, Action::Press { key: g }) => normalize_key(p) == normalize_key(g),
        (Action::OpenApp { name: p }, Action::OpenApp { name: g }) => normalize_name(p) == normalize_name(g),
        _ => cfg.matches(pred, gold, screen, elements),
    }
}

/// Multimodal-Mind2Web steps (see the module header).
pub fn mind2web(cfg: &MatchConfig, pred: &Action, gold: &Action, screen: Screen, elements: Option<&[Element]>) -> bool {
    match (pred, gold) {
        (Action::Click(p), Action::Click(g))
        | (Action::LongPress(p), Action::LongPress(g))
        | (Action::DoubleClick(p), Action::DoubleClick(g))
        | (Action::RightClick(p), Action::RightClick(g)) => element_match(cfg, p, g, screen, elements),
        (Action::Type { text: p }, Action::Type { text: g }) => same_token_set(p, g, false),
        _ => cfg.matches(pred, gold, screen, elements),
    }
}

/// GUI-Odyssey steps (see the module header).
pub fn gui_odyssey(
    cfg: &MatchConfig,
    pred: &Action,
    gold: &Action,
    screen: Screen,
    elements: Option<&[Element]>,
) -> bool {
    match (pred, gold) {
        (Action::Click(p), Action::Click(g)) | (Action::LongPress(p), Action::LongPress(g)) => {
            match (point_of(p, elements), point_of(g, elements)) {
                (Some(pp), Some(gp)) => cfg.near(pp, gp, screen),
                _ => false,
            }
        }
        (Action::Type { text: p }, Action::Type { text: g }) => odyssey_text_match(p, g),
        // Swipes (its scrolls) by direction, keys, done status: our rules say the same.
        _ => cfg.matches(pred, gold, screen, elements),
    }
}

/// GUI-Odyssey's `TEXT_ANLS_THRESHOLD`: the least `1 - levenshtein / longer length` that matches.
pub const ODYSSEY_TEXT_SIMILARITY: f64 = 0.5;

/// GUI-Odyssey's `text_matching`: after trimming, one text contains the other (so an empty one matches
/// anything, as there), or the normalised Levenshtein similarity (in characters) is at least 0.5.
pub fn odyssey_text_match(pred: &str, gold: &str) -> bool {
    let (p, g) = (pred.trim(), gold.trim());
    if p.contains(g) || g.contains(p) {
        return true;
    }
    let (p, g): (Vec<char>, Vec<char>) = (p.chars().collect(), g.chars().collect());
    let longer = p.len().max(g.len());
    1.0 - levenshtein(&p, &g) as f64 / longer as f64 >= ODYSSEY_TEXT_SIMILARITY
}

/// Edits (insert, delete, substitute) from `a` to `b`.
fn levenshtein(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=a.len()).collect();
    for (j, cb) in b.iter().enumerate() {
        let mut prev = row[0];
        row[0] = j + 1;
        for (i, ca) in a.iter().enumerate() {
            let next = if ca == cb { prev } else { 1 + prev.min(row[i]).min(row[i + 1]) };
            prev = row[i + 1];
            row[i + 1] = next;
        }
    }
    row[a.len()]
}

/// The point of a target: its own, or the centre of the element it names.
fn point_of(t: &Target, elements: Option<&[Element]>) -> Option<(i32, i32)> {
    let find = |id: &str| elements.and_then(|els| els.iter().find(|e| e.id == id));
    t.xy().or_else(|| t.element.as_deref().and_then(find).map(Element::center))
}

/// AITW `_check_tap_actions_match`: within the distance, or both points in one grown element box.
fn aitw_taps_match(cfg: &MatchConfig, p: &Target, g: &Target, screen: Screen, elements: Option<&[Element]>) -> bool {
    let (Some(pp), Some(gp)) = (point_of(p, elements), point_of(g, elements)) else {
        return false;
    };
    if cfg.near(pp, gp, screen) {
        return true;
    }
    elements.unwrap_or_default().iter().any(|e| {
        let b = aitw_grown_box(e, screen);
        inside_inclusive(b, pp) && inside_inclusive(b, gp)
    })
}

/// An element's box grown as AITW grows annotation boxes, `[x1, y1, x2, y2]` in pixels.
pub fn aitw_grown_box(e: &Element, screen: Screen) -> [f64; 4] {
    let [x1, y1, x2, y2] = e.bbox.map(f64::from);
    let (w, h) = (x2 - x1, y2 - y1);
    let left = (x1 - AITW_BOX_AUGMENT * w / 2.0).max(0.0);
    let top = (y1 - AITW_BOX_AUGMENT * h / 2.0).max(0.0);
    let width = (w + AITW_BOX_AUGMENT * w).min(f64::from(screen.width));
    let height = (h + AITW_BOX_AUGMENT * h).min(f64::from(screen.height));
    [left, top, left + width, top + height]
}

fn inside_inclusive(b: [f64; 4], (x, y): (i32, i32)) -> bool {
    let (x, y) = (f64::from(x), f64::from(y));
    x >= b[0] && x <= b[2] && y >= b[1] && y <= b[3]
}

/// AITW `_check_drag_actions_match`: the axis (0: y, 1: x) along which a gesture moves most.
fn main_axis(s: &Segment) -> usize {
    let (dy, dx) = ((i64::from(s.y2) - i64::from(s.y1)).abs(), (i64::from(s.x2) - i64::from(s.x1)).abs());
    // numpy's argmax over (|dy|, |dx|) returns the first maximum: ties go to y.
    usize::from(dx > dy)
}

/// Mind2Web's element accuracy on a screenshot: the prediction names the target element, or its point
/// lies in the target's box (edges included). Without a known box (never in converted episodes), the
/// distance rule.
fn element_match(cfg: &MatchConfig, p: &Target, g: &Target, screen: Screen, elements: Option<&[Element]>) -> bool {
    let target = g.element.as_deref().and_then(|id| elements.and_then(|els| els.iter().find(|e| e.id == id)));
    match target {
        Some(t) if p.element.as_deref() == Some(t.id.as_str()) => true,
        Some(t) => {
            let b = t.bbox.map(f64::from);
            point_of(p, elements).is_some_and(|pp| inside_inclusive(b, pp))
        }
        None => match (point_of(p, elements), point_of(g, elements)) {
            (Some(pp), Some(gp)) => cfg.near(pp, gp, screen),
            _ => false,
        },
    }
}

/// Mind2Web's operation F1 equal to 1: the sets of whitespace-separated tokens are equal (both empty: 1).
pub fn same_token_set(pred: &str, gold: &str, fold_case: bool) -> bool {
    let set = |s: &str| {
        let s = if fold_case { s.to_lowercase() } else { s.to_string() };
        s.split_whitespace().map(str::to_string).collect::<std::collections::BTreeSet<String>>()
    };
    set(pred) == set(gold)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matching::tests::{click, el, SCREEN};
    use askgui_data::Direction;

    #[test]
    fn android_control_taps_follow_aitw() {
        let m = MatchConfig::default();
        // No boxes: the distance. dx 140/1000 = 0.14 matches; dx 0.15 does not.
        assert!(android_control(&m, &click(640, 1000), &click(500, 1000), SCREEN, None));
        assert!(!android_control(&m, &click(650, 1000), &click(500, 1000), SCREEN, None));
        // A box [400, 900, 500, 1000] (100 x 100) grows to x 330..570, y 830..1070 (0.7 x 100 each side).
        let els = [el("b", [400, 900, 500, 1000])];
        // Gold at (560, 950) and prediction at (331, 960): dx 0.229 > 0.14, but both in the grown box.
        assert!(android_control(&m, &click(331, 960), &click(560, 950), SCREEN, Some(&els)));
        // Just outside the grown box on the left (329): no match (still 0.231 apart).
        assert!(!android_control(&m, &click(329, 960), &click(560, 950), SCREEN, Some(&els)));
        // Long press is another type.
        assert!(!android_control(&m, &Action::LongPress(Target::point(500, 1000)), &click(500, 1000), SCREEN, None));
    }

    #[test]
    fn android_control_text_scroll_and_gestures() {
        let m = MatchConfig::default();
        let ty = |t: &str| Action::Type { text: t.into() };
        // Token sets {oat, milk} both: equal after case folding; {oat} is not.
        assert!(android_control(&m, &ty("Oat  milk"), &ty("milk oat"), SCREEN, None));
        assert!(!android_control(&m, &ty("oat"), &ty("oat milk"), SCREEN, None));
        let sc = |d| Action::Scroll { x: None, y: None, direction: d };
        assert!(!android_control(&m, &sc(Direction::Up), &sc(Direction::Down), SCREEN, None));
        // AITW compares gestures by their main axis only: an upward and a downward swipe match.
        let sw = |y1, y2| Action::Swipe(Segment { x1: 500, y1, x2: 500, y2 });
        assert!(android_control(&m, &sw(1500, 500), &sw(500, 1500), SCREEN, None));
        let horizontal = Action::Swipe(Segment { x1: 100, y1: 1000, x2: 900, y2: 1000 });
        assert!(!android_control(&m, &horizontal, &sw(500, 1500), SCREEN, None));
        let press = |k: &str| Action::Press { key: k.into() };
        assert!(android_control(&m, &press("KEYCODE_BACK"), &press("back"), SCREEN, None));
        assert!(!android_control(&m, &press("home"), &press("back"), SCREEN, None));
    }

    #[test]
    fn gui_odyssey_distance_lenient_text_and_directions() {
        let m = MatchConfig::default();
        // Distance only: dx 0.14 matches, 0.15 does not, even inside a shared element box (no AITW boxes).
        assert!(gui_odyssey(&m, &click(640, 1000), &click(500, 1000), SCREEN, None));
        let els = [el("b", [300, 900, 700, 1100])];
        assert!(!gui_odyssey(&m, &click(650, 1000), &click(500, 1000), SCREEN, Some(&els)));
        let ty = |t: &str| Action::Type { text: t.into() };
        // Containment: "oat milk" is in " oat milk latte" (trimmed); case is kept.
        assert!(gui_odyssey(&m, &ty("oat milk"), &ty(" oat milk latte"), SCREEN, None));
        assert!(!gui_odyssey(&m, &ty("OAT MILK"), &ty("oat milk latte"), SCREEN, None));
        // "kitten" -> "sitting": 3 edits of 7, similarity 0.571 >= 0.5; "abcd" -> "wxyz": 0.
        assert!(gui_odyssey(&m, &ty("kitten"), &ty("sitting"), SCREEN, None));
        assert!(!gui_odyssey(&m, &ty("abcd"), &ty("wxyz"), SCREEN, None));
        // "abcdef" -> "abxyzf": 3 edits of 6, exactly 0.5: matches; "abcdef" -> "axyzwf": 4 of 6 does not.
        assert!(odyssey_text_match("abcdef", "abxyzf"));
        assert!(!odyssey_text_match("abcdef", "axyzwf"));
        // Scrolls (swipes in converted episodes) by direction: up and down differ, unlike AITW's axis rule.
        let sw = |y1, y2| Action::Swipe(Segment { x1: 500, y1, x2: 500, y2 });
        assert!(!gui_odyssey(&m, &sw(1500, 500), &sw(500, 1500), SCREEN, None));
        assert!(gui_odyssey(&m, &sw(1400, 600), &sw(1500, 500), SCREEN, None));
        let press = |k: &str| Action::Press { key: k.into() };
        assert!(!gui_odyssey(&m, &press("home"), &press("back"), SCREEN, None));
    }

    #[test]
    fn mind2web_element_and_exact_operation() {
        let m = MatchConfig::default();
        let els = [el("42", [100, 100, 300, 200])];
        let gold = Action::Click(Target { x: Some(200), y: Some(150), element: Some("42".into()) });
        // Inside the box, edges included; by name.
        assert!(mind2web(&m, &click(300, 200), &gold, SCREEN, Some(&els)));
        let named = Action::Click(Target { x: None, y: None, element: Some("42".into()) });
        assert!(mind2web(&m, &named, &gold, SCREEN, Some(&els)));
        // One pixel outside: no match, though 0.05 from the centre (no distance rule when the box is known).
        assert!(!mind2web(&m, &click(301, 150), &gold, SCREEN, Some(&els)));
        let ty = |t: &str| Action::Type { text: t.into() };
        // Operation F1 must be 1: {New, York} = {York, New}; {new, York} differs (case is kept); a subset
        // ({New}: F1 2/3) is not enough.
        assert!(mind2web(&m, &ty("York New"), &ty("New York"), SCREEN, None));
        assert!(!mind2web(&m, &ty("new York"), &ty("New York"), SCREEN, None));
        assert!(!mind2web(&m, &ty("New"), &ty("New York"), SCREEN, None));
    }
}
