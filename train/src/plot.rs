//! A picture of the curves: `curves.svg` beside `metrics.jsonl`, the training loss per step (a line) and
//! the eval loss (dots), redrawn at every checkpoint and at the end. Plain SVG written by hand, so that a
//! browser shows it and no plotting dependency is needed.

use std::fmt::Write;

/// `(step, loss)` points of one curve.
pub type Curve = Vec<(f64, f64)>;

/// `(train, val)` curves read from metrics.jsonl lines (other lines are ignored).
pub fn read_points(jsonl: &str) -> (Curve, Curve) {
    let (mut train, mut val) = (vec![], vec![]);
    for v in jsonl.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
        let Some(step) = v["step"].as_f64() else { continue };
        if let Some(l) = v["loss"].as_f64().filter(|l| l.is_finite()) {
            train.push((step, l));
        }
        if let Some(l) = v["val_loss"].as_f64().filter(|l| l.is_finite()) {
            val.push((step, l));
        }
    }
    (train, val)
}

/// The SVG of the two curves on shared axes (step across, loss up, both from the data's range).
pub fn curves_svg(train: &[(f64, f64)], val: &[(f64, f64)]) -> String {
    let (w, h, m) = (640.0, 360.0, 48.0);
    let all = train.iter().chain(val);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let (x1, y1) = (if x1 > x0 { x1 } else { x0 + 1.0 }, if y1 > y0 { y1 } else { y0 + 1.0 });
    let px = |x: f64| m + (x - x0) / (x1 - x0) * (w - 2.0 * m);
    let py = |y: f64| h - m - (y - y0) / (y1 - y0) * (h - 2.0 * m);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(s, r#"<path d="M{m} {m} V{} H{}" fill="none" stroke="black"/>"#, h - m, w - m);
    for (v, x, y, anchor) in [
        (y1, m - 4.0, m + 4.0, "end"),
        (y0, m - 4.0, h - m, "end"),
        (x0, m, h - m + 16.0, "middle"),
        (x1, w - m, h - m + 16.0, "middle"),
    ] {
        let _ = writeln!(s, r#"<text x="{x}" y="{y}" text-anchor="{anchor}">{}</text>"#, short(v));
    }
    let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#, w / 2.0, h - 8.0);
    let _ = writeln!(s, r#"<text x="{m}" y="{}">loss (line: train, dots: eval)</text>"#, m - 12.0);
    if !train.is_empty() {
        let pts: Vec<String> = train.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        let _ = writeln!(s, r##"<polyline points="{}" fill="none" stroke="#1f77b4"/>"##, pts.join(" "));
    }
    for &(x, y) in val {
        let _ = writeln!(s, r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="#d62728"/>"##, px(x), py(y));
    }
    s.push_str("</svg>\n");
    s
}

/// A number short enough for an axis label.
fn short(v: f64) -> String {
    if v.abs() >= 1000.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_and_svg() {
        let jsonl = "{\"step\":1,\"loss\":3.0,\"lr\":0.1}\n{\"step\":2,\"loss\":2.0}\n{\"step\":2,\"val_loss\":2.5}\nnot json\n";
        let (train, val) = read_points(jsonl);
        assert_eq!(train, [(1.0, 3.0), (2.0, 2.0)]);
        assert_eq!(val, [(2.0, 2.5)]);
        let svg = curves_svg(&train, &val);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        // The first point is at the left and the top (step 1, the highest loss); the dot at the right.
        assert!(svg.contains(r#"points="48.0,48.0 592.0,312.0""#), "{svg}");
        assert!(svg.contains(r#"<circle cx="592.0" cy="180.0""#), "{svg}");
        // No data: still a valid picture.
        assert!(curves_svg(&[], &[]).ends_with("</svg>\n"));
    }
}
