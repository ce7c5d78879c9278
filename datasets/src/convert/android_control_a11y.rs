//! AndroidControl's accessibility trees: serialized `AndroidAccessibilityForest` protos (android_env's
//! `proto/a11y`), turned into our element list.
//!
//! Fields read (numbers from the .proto files): forest `windows` (1); window `tree` (11); tree `nodes` (1); node
//! `bounds_in_screen` (2, a `ProtoRect` of left 1, top 2, right 3, bottom 4), `class_name` (3),
//! `content_description` (4), `hint_text` (5), `text` (7), `is_clickable` (14), `is_editable` (15),
//! `is_long_clickable` (19), `is_scrollable` (21), `is_visible_to_user` (23). An element is kept when it is visible
//! (if the forest marks any node visible at all), its box clipped to the screen is not empty, and it has a label or
//! can be acted on (clickable, long-clickable, editable, scrollable): the layout containers in between are noise.
//! Our element has no content-description or clickable field, so `text` is the text and the content description
//! (joined by ` | ` when both are there and differ; the hint when neither is), and `role` is the class's short
//! name (`android.widget.Button` -> `Button`), prefixed `clickable ` when the node is.

use super::android_control_tfrecord::{bytes_of, fields, Wire};
use crate::episode::{Element, Screen};

/// One accessibility node, with the fields we use.
#[derive(Debug, Default)]
struct Node {
    bounds: [i32; 4],
    class_name: String,
    content_description: String,
    hint_text: String,
    text: String,
    clickable: bool,
    long_clickable: bool,
    editable: bool,
    scrollable: bool,
    visible: bool,
}

/// The elements of one serialized forest, window by window, in node order.
pub(super) fn forest_elements(forest: &[u8], screen: Screen) -> Result<Vec<Element>, String> {
    let mut nodes = vec![];
    for f in fields(forest) {
        let (1, w) = f? else { continue };
        for f in fields(bytes_of(w)?) {
            let (11, w) = f? else { continue };
            for f in fields(bytes_of(w)?) {
                let (1, w) = f? else { continue };
                nodes.push(node(bytes_of(w)?).map_err(|e| format!("node {}: {e}", nodes.len()))?);
            }
        }
    }
    let any_visible = nodes.iter().any(|n| n.visible);
    let mut kept: Vec<Element> =
        nodes.into_iter().filter(|n| n.visible || !any_visible).filter_map(|n| element(n, screen)).collect();
    for (i, e) in kept.iter_mut().enumerate() {
        e.id = format!("e{i}");
    }
    Ok(kept)
}

fn node(buf: &[u8]) -> Result<Node, String> {
    let mut n = Node::default();
    let string =
        |w: Wire<'_>| -> Result<String, String> { Ok(String::from_utf8_lossy(bytes_of(w)?).trim().to_string()) };
    for f in fields(buf) {
        let (number, w) = f?;
        let flag = matches!(w, Wire::Varint(v) if v != 0);
        match number {
            2 => n.bounds = rect(bytes_of(w)?)?,
            3 => n.class_name = string(w)?,
            4 => n.content_description = string(w)?,
            5 => n.hint_text = string(w)?,
            7 => n.text = string(w)?,
            14 => n.clickable = flag,
            15 => n.editable = flag,
            19 => n.long_clickable = flag,
            21 => n.scrollable = flag,
            23 => n.visible = flag,
            _ => {}
        }
    }
    Ok(n)
}

/// A `ProtoRect` as `[left, top, right, bottom]` (int32 varints; negative ones are sign-extended to 64 bits).
fn rect(buf: &[u8]) -> Result<[i32; 4], String> {
    let mut r = [0i32; 4];
    for f in fields(buf) {
        if let (k @ 1..=4, Wire::Varint(v)) = f? {
            r[k as usize - 1] = v as i64 as i32;
        }
    }
    Ok(r)
}

fn element(n: Node, screen: Screen) -> Option<Element> {
    let [l, t, r, b] = n.bounds;
    let (w, h) = (screen.width as i32, screen.height as i32);
    let bbox = [l.clamp(0, w), t.clamp(0, h), r.clamp(0, w), b.clamp(0, h)];
    let text = label(&n);
    let actionable = n.clickable || n.long_clickable || n.editable || n.scrollable;
    if bbox[0] >= bbox[2] || bbox[1] >= bbox[3] || (text.is_empty() && !actionable) {
        return None;
    }
    let short = n.class_name.rsplit('.').next().unwrap_or_default();
    let role = match (n.clickable, short.is_empty()) {
        (true, true) => "clickable".to_string(),
        (true, false) => format!("clickable {short}"),
        (false, _) => short.to_string(),
    };
    Some(Element { id: String::new(), role, text, bbox })
}

fn label(n: &Node) -> String {
    match (n.text.as_str(), n.content_description.as_str()) {
        ("", "") => n.hint_text.clone(),
        (t, "") => t.to_string(),
        ("", d) => d.to_string(),
        (t, d) if t == d => t.to_string(),
        (t, d) => format!("{t} | {d}"),
    }
}
