//! `stats` and `render_html` on a small episode file built here: tiny PNG screenshots written with
//! `image` (one shared by two steps, one missing, one not an image, one of the wrong size), actions of
//! several kinds, one ambiguous episode with an ASK, one episode whose `ambiguous_task` equals its task,
//! and a line that is not JSON. Every number is checked exactly; the pages are checked for escaping,
//! the ASK/SAY dialogue, the overlay geometry and the copied images.

use std::path::{Path, PathBuf};

use anyhow::Result;
use askgui_data::render::render_html;
use askgui_data::stats::{stats, MISSING, UNREADABLE};
use askgui_data::ActionLanguage;

/// A fresh folder under cargo's per-test temporary directory (left there after a run, so that
/// `target/tmp/stats_render-render/html/index.html` can be opened to look at the pages).
fn temp_dir(name: &str) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("stats_render-{name}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn png(path: &Path, w: u32, h: u32, shade: u8) -> Result<()> {
    std::fs::create_dir_all(path.parent().unwrap())?;
    image::RgbImage::from_fn(w, h, |x, y| image::Rgb([shade, (x % 256) as u8, (y % 256) as u8])).save(path)?;
    Ok(())
}

/// Writes the fixture and returns the JSONL path.
fn fixture(dir: &Path) -> Result<PathBuf> {
    png(&dir.join("images/s0.png"), 100, 200, 40)?;
    png(&dir.join("images/s1.png"), 100, 200, 120)?;
    png(&dir.join("other/s0.png"), 80, 60, 200)?;
    png(&dir.join("other/big.png"), 160, 120, 90)?;
    std::fs::write(dir.join("images/broken.png"), b"this is not a png")?;

    let shop = serde_json::json!({
        "id": "shop/1 <x>",
        "platform": "android",
        "screen": {"width": 100, "height": 200},
        "task": "Buy \"oat\" milk <fast> & cheap",
        "ambiguous_task": "Buy milk",
        "steps": [
            {"screenshot": "images/s0.png", "instruction": "Tap <Oat milk>", "informative": true,
             "elements": [{"id": "e1", "role": "row", "text": "Oat milk", "bbox": [10, 40, 90, 80]},
                          {"id": "e2", "role": "row", "text": "Soy milk", "bbox": [10, 90, 90, 130]}],
             "action": {"action": "click", "x": 50, "y": 60},
             "ask": {"question": "Which milk: <oat> or soy?", "answer": "Oat & nothing else",
                     "options": [{"label": "Oat"}, {"label": "Soy", "detail": "unsweetened"}]}},
            {"screenshot": "images/s1.png", "action": {"action": "swipe", "x1": 50, "y1": 150, "x2": 50, "y2": 50}},
            {"screenshot": "images/s0.png", "action": {"action": "type", "text": "two litres"}},
            {"screenshot": "images/broken.png", "action": {"action": "press", "key": "back"}},
            {"screenshot": "images/missing.png", "action": {"action": "done", "status": "success"}}
        ]
    });
    let plain = serde_json::json!({
        "id": "plain",
        "platform": "web",
        "screen": {"width": 80, "height": 60},
        "task": "Open the menu",
        "ambiguous_task": "Open the menu",
        "steps": [
            {"screenshot": "other/s0.png",
             "elements": [{"id": "e9", "role": "button", "text": "Menu", "bbox": [20, 10, 60, 50]}],
             "action": {"action": "long_press", "element": "e9"}},
            {"screenshot": "other/s0.png", "informative": false, "action": {"action": "scroll", "direction": "down"}},
            {"screenshot": "other/big.png", "action": {"action": "drag", "x1": 10, "y1": 10, "x2": 70, "y2": 10}}
        ]
    });
    let path = dir.join("episodes.jsonl");
    std::fs::write(&path, format!("{shop}\n{plain}\n{{not json\n\n"))?;
    Ok(path)
}

#[test]
fn stats_counts_exactly() -> Result<()> {
    let dir = temp_dir("stats")?;
    let s = stats(&fixture(&dir)?)?;
    assert_eq!((s.episodes, s.steps, s.bad_lines), (2, 8, 1));
    assert_eq!(s.ambiguous_episodes, 1, "an ambiguous_task equal to the task is not ambiguous");
    assert_eq!(s.ask_steps, 1);
    assert_eq!(s.ask_rate_steps, 1.0 / 8.0);
    assert_eq!(s.ask_rate_episodes, 0.5);
    assert_eq!((s.informative_steps, s.elements_steps), (1, 2));
    assert_eq!((s.steps_per_episode.min, s.steps_per_episode.mean, s.steps_per_episode.max), (3, 4.0, 5));
    let mix: Vec<(&str, usize)> = s.action_mix.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        mix,
        [
            ("click", 1),
            ("done", 1),
            ("drag", 1),
            ("long_press", 1),
            ("press", 1),
            ("scroll", 1),
            ("swipe", 1),
            ("type", 1)
        ]
    );
    let platforms: Vec<(&str, usize)> = s.platforms.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(platforms, [("android", 1), ("web", 1)]);
    let sizes: Vec<(&str, usize)> = s.image_sizes.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(sizes, [("100x200", 3), ("160x120", 1), ("80x60", 2), (MISSING, 1), (UNREADABLE, 1)]);
    assert_eq!(s.image_size_mismatches, 1);

    let text = s.to_string();
    for needle in ["episodes", "ask steps", "12.5% of steps", "50.0% of episodes", "100x200", "missing", "long_press"] {
        assert!(text.contains(needle), "no {needle:?} in\n{text}");
    }
    let json = serde_json::to_value(&s)?;
    assert_eq!(json["steps_per_episode"]["max"], 5);
    assert_eq!(json["image_sizes"]["80x60"], 2);
    Ok(())
}

#[test]
fn stats_of_a_missing_file_names_it() {
    let err = stats(Path::new("no/such/episodes.jsonl")).unwrap_err();
    assert!(err.to_string().contains("no/such/episodes.jsonl"), "{err}");
}

/// The part of `page` from step `i`'s section to the next one.
fn step(page: &str, i: usize) -> &str {
    let start = page.find(&format!("id=\"step-{i}\"")).unwrap_or_else(|| panic!("no step {i}"));
    let rest = &page[start..];
    &rest[..rest.find("</section>").unwrap()]
}

#[test]
fn render_writes_a_self_contained_folder() -> Result<()> {
    let dir = temp_dir("render")?;
    let input = fixture(&dir)?;
    let out = dir.join("html");
    let report = render_html(&input, &out, ActionLanguage::AskguiJson)?;
    assert_eq!(report.pages, 2);
    assert_eq!(report.index, out.join("index.html"));
    assert_eq!((report.images, report.missing_images, report.bad_lines), (4, 2, 1));

    // Copied once each, under names that keep their folders apart.
    for name in ["images_s0.png", "images_s1.png", "other_s0.png", "other_big.png"] {
        let copied = out.join("img").join(name);
        assert!(copied.is_file(), "{} not copied", copied.display());
    }
    assert_eq!(std::fs::read_dir(out.join("img"))?.count(), 4);
    assert_eq!(image::image_dimensions(out.join("img/other_big.png"))?, (160, 120));

    let index = std::fs::read_to_string(&report.index)?;
    assert!(index.contains("href=\"shop_1__x_.html\""), "{index}");
    assert!(index.contains("href=\"plain.html\""));
    assert!(index.contains("shop/1 &lt;x&gt;"));
    assert!(index.contains("yes, step 0"));
    assert!(index.contains("line 3: bad JSON"), "the bad line is listed");

    let shop = std::fs::read_to_string(out.join("shop_1__x_.html"))?;
    assert!(shop.contains("Buy &quot;oat&quot; milk &lt;fast&gt; &amp; cheap"));
    assert!(!shop.contains("<fast>"), "task text must be escaped");
    assert!(shop.contains("Buy milk"));

    let s0 = step(&shop, 0);
    assert!(s0.contains("<img src=\"img/images_s0.png\""));
    assert!(s0.contains("viewBox=\"0 0 100 200\""));
    assert!(s0.contains("<circle class=\"ring\" cx=\"50\" cy=\"60\""), "{s0}");
    assert!(s0.contains("<rect class=\"element target\" x=\"10\" y=\"40\" width=\"80\" height=\"40\""), "{s0}");
    assert!(s0.contains("<rect class=\"element\" x=\"10\" y=\"90\""), "{s0}");
    assert!(s0.contains("Tap &lt;Oat milk&gt;"));
    let ask = s0.find("ASK</span>Which milk: &lt;oat&gt; or soy?").expect("ASK question");
    let say = s0.find("SAY</span>Oat &amp; nothing else").expect("SAY answer");
    let action = s0.find("<pre class=\"action\">").expect("action JSON");
    assert!(ask < say && say < action, "ASK, then SAY, then the action");
    assert!(s0.contains("<li>Soy <span class=\"muted\">— unsweetened</span></li>"));
    assert!(s0.contains("{&quot;action&quot;:&quot;click&quot;,&quot;x&quot;:50,&quot;y&quot;:60}"));

    let s1 = step(&shop, 1);
    assert!(s1.contains("<line class=\"arrow\" x1=\"50\" y1=\"150\""), "{s1}");
    assert!(s1.contains("<polygon class=\"arrowhead\" points=\"50,50 "), "arrow head at the end point: {s1}");
    assert!(!step(&shop, 2).contains("ASK</span>"), "only the ask step has a dialogue");
    assert!(step(&shop, 2).contains("img/images_s0.png"), "a shared screenshot is referenced, not copied again");
    assert!(step(&shop, 3).contains("screenshot unreadable: images/broken.png"));
    assert!(step(&shop, 4).contains("<div class=\"missing\">screenshot missing: images/missing.png</div>"));

    let plain = std::fs::read_to_string(out.join("plain.html"))?;
    // A long press that names only an element lands on the element's centre, which is highlighted.
    let p0 = step(&plain, 0);
    assert!(p0.contains("<circle class=\"ring\" cx=\"40\" cy=\"30\""), "{p0}");
    assert!(p0.contains("class=\"element target\""));
    // Scroll down without a point: from the screen centre, downwards by a fifth of the height.
    let p1 = step(&plain, 1);
    assert!(p1.contains("<line class=\"arrow\" x1=\"40\" y1=\"30\""), "{p1}");
    assert!(p1.contains("points=\"40,42 "), "{p1}");
    assert!(step(&plain, 2).contains("image is 160x120 but the screen is 80x60"));
    assert!(plain.contains("href=\"shop_1__x_.html\">← previous"));
    Ok(())
}

#[test]
fn render_shows_the_actions_in_an_action_language() -> Result<()> {
    let dir = temp_dir("render-ui-tars")?;
    let input = fixture(&dir)?;
    let out = dir.join("html");
    render_html(&input, &out, ActionLanguage::UiTars)?;
    let shop = std::fs::read_to_string(out.join("shop_1__x_.html"))?;
    // The click of step 0 in UI-TARS's words, HTML-escaped, in the data's pixels.
    assert!(step(&shop, 0).contains("Action: click(start_box=&#39;(50,60)&#39;)"), "{}", step(&shop, 0));
    // A long press on an element alone: UI-TARS points at pixels only, so the page says why beside the JSON.
    let plain = std::fs::read_to_string(out.join("plain.html"))?;
    let p0 = step(&plain, 0);
    assert!(p0.contains("<p class=\"warn\">the ui-tars action language cannot express `long_press`"), "{p0}");
    assert!(p0.contains("{&quot;action&quot;:&quot;long_press&quot;"), "{p0}");
    Ok(())
}

#[test]
fn render_names_an_unreadable_input() {
    let dir = temp_dir("render-missing").unwrap();
    let err = render_html(&dir.join("absent.jsonl"), &dir.join("html"), ActionLanguage::AskguiJson).unwrap_err();
    assert!(err.to_string().contains("absent.jsonl"), "{err}");
}
