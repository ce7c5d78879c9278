//! The synthetic GUI world: valid, deterministic, drawn where its element lists say, and genuinely
//! ambiguous where it claims to be.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use askgui_data::synth::{make_episode, synth, SynthArgs};
use askgui_data::validate::validate_file;
use askgui_data::{load_episodes, Action, AskKind};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("askgui-synth-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn args(out: &Path, episodes: usize, seed: u64) -> SynthArgs {
    SynthArgs {
        out: out.into(),
        episodes,
        seed,
        width: 360,
        height: 640,
        split: "8:1:1".into(),
        ambiguous_fraction: 0.5,
        slot_colors: false,
        grid: 0,
        icons: false,
    }
}

#[test]
fn synthetic_world_validates_and_is_balanced() -> anyhow::Result<()> {
    let out = tmp("valid");
    let report = synth(&args(&out, 60, 7))?;
    assert_eq!(report.files.iter().map(|f| f.2).sum::<usize>(), 60);
    let (mut ambiguous, mut total, mut positions) = (0, 0, HashSet::new());
    for (name, file, n) in &report.files {
        let r = validate_file(file, true)?;
        assert!(r.problems.is_empty(), "{name}: {:#?}", r.problems);
        assert_eq!(r.episodes, *n);
        for le in load_episodes(file)? {
            let ep = &le.episode;
            total += 1;
            assert!(matches!(ep.steps.last().unwrap().action, Action::Done { .. }), "{} does not end in done", ep.id);
            if !ep.is_ambiguous() {
                assert!(ep.steps.iter().all(|s| s.ask.is_none()), "{}: ask in a full task", ep.id);
                continue;
            }
            ambiguous += 1;
            let amb = ep.ambiguous_task.as_deref().unwrap().to_lowercase();
            for s in ep.steps.iter().filter(|s| s.ask.is_some()) {
                let ask = s.ask.as_ref().unwrap();
                // The detail the user gives is in the full task and not in the ambiguous one.
                let detail = match &s.action {
                    Action::Type { text } => text.to_lowercase(),
                    a => {
                        let id =
                            a.target().and_then(|t| t.element.clone()).expect("informative clicks name their element");
                        let els = s.elements.as_ref().unwrap();
                        let e = els.iter().find(|e| e.id == id).unwrap();
                        positions.insert(els.iter().position(|x| x.id == id));
                        e.text.to_lowercase()
                    }
                };
                let key = detail.rsplit(' ').next().unwrap().to_string();
                assert!(ep.task.to_lowercase().contains(&key), "{}: full task `{}` lacks `{key}`", ep.id, ep.task);
                assert!(!amb.contains(&detail), "{}: ambiguous task `{amb}` still says `{detail}`", ep.id);
                if ask.kind == Some(AskKind::Selection) {
                    // Several options, each really on the screen: the screen does not decide.
                    assert!(ask.options.len() >= 2, "{}: {:?}", ep.id, ask.options);
                    let texts: Vec<&str> = s.elements.as_ref().unwrap().iter().map(|e| e.text.as_str()).collect();
                    for o in &ask.options {
                        assert!(texts.contains(&o.label.as_str()), "{}: option {} not on screen", ep.id, o.label);
                    }
                    // The answer names the right option and no other.
                    let named: Vec<_> = ask.options.iter().filter(|o| ask.answer.contains(&o.label)).collect();
                    assert_eq!(named.len(), 1, "{}: answer `{}` vs {:?}", ep.id, ask.answer, ask.options);
                }
            }
        }
    }
    assert_eq!(total, 60);
    // About half ambiguous (seeded: exact count is stable, the bound documents the intent).
    assert!((18..=42).contains(&ambiguous), "{ambiguous} of 60 ambiguous");
    assert!(positions.len() >= 3, "the right option must not always sit in the same row: {positions:?}");
    let _ = std::fs::remove_dir_all(&out);
    Ok(())
}

#[test]
fn the_smallest_screens_validate_too() -> anyhow::Result<()> {
    // 160x160 (the smallest allowed) and the demo's grid: a confirm button below a long message once fell
    // off the screen.
    for (w, h, grid) in [(160, 160, 0), (160, 160, 28), (168, 308, 28)] {
        let out = tmp(&format!("small-{w}x{h}-{grid}"));
        let report = synth(&SynthArgs { width: w, height: h, grid, split: "1:0:0".into(), ..args(&out, 40, 1) })?;
        for (name, file, _) in &report.files {
            let r = validate_file(file, true)?;
            assert!(r.problems.is_empty(), "{w}x{h} grid {grid} {name}: {:#?}", r.problems);
        }
    }
    Ok(())
}

#[test]
fn same_seed_same_world_and_runs_extend() -> anyhow::Result<()> {
    let (a, b) = (tmp("det-a"), tmp("det-b"));
    synth(&SynthArgs { split: "1:0:0".into(), ..args(&a, 12, 3) })?;
    synth(&SynthArgs { split: "1:0:0".into(), ..args(&b, 5, 3) })?;
    let ea = std::fs::read_to_string(a.join("train.jsonl"))?;
    let eb = std::fs::read_to_string(b.join("train.jsonl"))?;
    assert!(ea.starts_with(&eb), "a smaller run must be a prefix of a larger one with the same seed");
    let first = load_episodes(&b.join("train.jsonl"))?;
    for s in 0..first[0].episode.steps.len() {
        let rel = &first[0].episode.steps[s].screenshot;
        assert_eq!(std::fs::read(a.join(rel))?, std::fs::read(b.join(rel))?, "{rel} differs between runs");
    }
    let other = tmp("det-c");
    let e = make_episode(4, 0, (360, 640), 0.5, &other)?;
    assert_ne!(serde_json::to_string(&e)?, serde_json::to_string(&make_episode(3, 0, (360, 640), 0.5, &other)?)?);
    for d in [a, b, other] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}

#[test]
fn elements_are_drawn_where_the_list_says() -> anyhow::Result<()> {
    let dir = tmp("draw");
    let bg = image::Rgb([250u8, 250, 247]);
    let ink = [image::Rgb([28u8, 28, 32]), image::Rgb([255u8, 255, 255])];
    for (i, (w, h)) in [(360, 640), (1080, 2400), (800, 600)].into_iter().enumerate() {
        let ep = make_episode(11, i, (w, h), 0.5, &dir.join("images"))?;
        for s in &ep.steps {
            let img = image::open(dir.join(&s.screenshot))?.to_rgb8();
            assert_eq!(img.dimensions(), (w, h));
            for e in s.elements.as_ref().unwrap() {
                let [x1, y1, x2, y2] = e.bbox;
                assert!(x1 >= 0 && y1 >= 0 && x2 <= w as i32 && y2 <= h as i32, "{} {:?} off screen", e.id, e.bbox);
                let px = |x: i32, y: i32| *img.get_pixel(x as u32, y as u32);
                let fill = px(x1 + 1, y1 + 1);
                // Filled widgets: the corner inside the box is the fill, the pixel outside is not.
                if e.role != "text" {
                    assert_ne!(fill, bg, "{} `{}`: no fill at its box", e.id, e.text);
                    assert_eq!(px(x2 - 2, y2 - 2), fill, "{} `{}`: box not filled to its corner", e.id, e.text);
                    if x1 > 0 {
                        assert_ne!(px(x1 - 1, (y1 + y2) / 2), fill, "{} `{}`: fill spills left", e.id, e.text);
                    }
                }
                // Its text is inside its box: ink pixels there.
                let inked = (y1..y2)
                    .flat_map(|y| (x1..x2).map(move |x| (x, y)))
                    .filter(|&(x, y)| ink.contains(&px(x, y)) && px(x, y) != fill)
                    .count();
                assert!(inked >= 20 * e.text.len().min(4), "{} `{}`: no text drawn in {:?}", e.id, e.text, e.bbox);
            }
            if let Some(t) = s.action.target() {
                let id = t.element.as_ref().unwrap();
                let e = s.elements.as_ref().unwrap().iter().find(|e| &e.id == id).unwrap();
                assert!(e.contains(t.x.unwrap(), t.y.unwrap()));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn bad_arguments_are_refused() {
    let out = tmp("bad");
    let e = synth(&SynthArgs { width: 100, ..args(&out, 1, 0) }).unwrap_err();
    assert!(e.to_string().contains("100x640"), "{e}");
    let e = synth(&SynthArgs { split: "8:1".into(), ..args(&out, 1, 0) }).unwrap_err();
    assert!(e.to_string().contains("8:1"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
}

/// `--icons`: every option and app icon carries its label's badge, options shown together have
/// different badges (so the screen tells them apart), and the badge is drawn inside the option's box.
#[test]
fn badges_identify_the_options_on_every_screen() -> anyhow::Result<()> {
    let out = tmp("icons");
    let a = SynthArgs { width: 168, height: 308, slot_colors: true, grid: 28, icons: true, ..args(&out, 40, 5) };
    let report = synth(&a)?;
    let (mut screens, mut badged) = (0, 0);
    for (_, file, _) in &report.files {
        for le in load_episodes(file)? {
            for s in &le.episode.steps {
                let img = image::open(out.join(&s.screenshot))?.to_rgb8();
                let options: Vec<_> =
                    s.elements.as_ref().unwrap().iter().filter(|e| e.role == "icon" || e.role == "button").collect();
                let mut codes = HashSet::new();
                for e in options.iter().filter(|e| !["Add to cart", "Confirm", "Send"].contains(&e.text.as_str())) {
                    let code = askgui_data::synth::badge_code(&e.text);
                    let code = code.unwrap_or_else(|| panic!("{}: `{}` has no badge", s.screenshot, e.text));
                    assert!(codes.insert(code), "{}: two options share the badge of `{}`", s.screenshot, e.text);
                    let [x1, y1, x2, y2] = e.bbox;
                    let has = |c| (y1..y2).any(|y| (x1..x2).any(|x| *img.get_pixel(x as u32, y as u32) == c));
                    let drawn = code.colors.iter().all(|&c| has(c));
                    assert!(drawn, "{}: the badge of `{}` is not drawn in {:?}", s.screenshot, e.text, e.bbox);
                    badged += 1;
                }
                screens += 1;
            }
        }
    }
    assert!(screens > 100 && badged > 2 * screens, "{badged} badges on {screens} screens");
    let _ = std::fs::remove_dir_all(&out);
    Ok(())
}

/// Badges are unique: no two labels of the world share one, so a badge means the same thing on every
/// screen.
#[test]
fn badges_are_unique_across_the_world() -> anyhow::Result<()> {
    let out = tmp("icons-unique");
    let report = synth(&SynthArgs { icons: true, ..args(&out, 120, 9) })?;
    let mut seen = std::collections::HashMap::new();
    for (_, file, _) in &report.files {
        for le in load_episodes(file)? {
            for e in le.episode.steps.iter().flat_map(|s| s.elements.clone().unwrap()) {
                if let Some(code) = askgui_data::synth::badge_code(&e.text) {
                    let other = seen.entry(code).or_insert_with(|| e.text.clone());
                    assert_eq!(*other, e.text, "`{}` and `{other}` share a badge", e.text);
                }
            }
        }
    }
    assert!(seen.len() > 60, "only {} labels with badges", seen.len());
    let _ = std::fs::remove_dir_all(&out);
    Ok(())
}

/// `--slot-colors`: an action button (Add to cart, Confirm, Send) leaves its row's first cell in the
/// row's slot colour, so the row it sits in (one of three) can be read off the screen: the same row always
/// shows the same colour, and the rows buttons use show different ones.
#[test]
fn action_buttons_show_their_row_colour() -> anyhow::Result<()> {
    let out = tmp("button-rows");
    let a = SynthArgs { width: 168, height: 308, slot_colors: true, grid: 28, icons: true, ..args(&out, 60, 3) };
    let report = synth(&a)?;
    let mut row_colour = std::collections::HashMap::new();
    for (_, file, _) in &report.files {
        for le in load_episodes(file)? {
            for s in &le.episode.steps {
                let img = image::open(out.join(&s.screenshot))?.to_rgb8();
                let buttons = s.elements.as_ref().unwrap().iter().filter(|e| e.role == "button");
                for e in buttons.filter(|e| ["Add to cart", "Confirm", "Send"].contains(&e.text.as_str())) {
                    let [x1, y1, _, y2] = e.bbox;
                    assert!(x1 >= 28, "{}: `{}` starts at x {x1}: no room for a slot cell", s.screenshot, e.text);
                    let cell = *img.get_pixel((x1 - 14) as u32, ((y1 + y2) / 2) as u32);
                    assert_ne!(cell, *img.get_pixel(2, ((y1 + y2) / 2) as u32), "{}: no slot cell", s.screenshot);
                    let seen = *row_colour.entry(y1).or_insert(cell);
                    assert_eq!(seen, cell, "{}: row at y {y1} in two colours", s.screenshot);
                }
            }
        }
    }
    let colours: HashSet<_> = row_colour.values().collect();
    assert!(row_colour.len() >= 4, "buttons in only {} rows", row_colour.len());
    assert_eq!(colours.len(), row_colour.len(), "two button rows share a colour: {row_colour:?}");
    let _ = std::fs::remove_dir_all(&out);
    Ok(())
}

#[test]
fn every_split_gets_an_ambiguous_episode() -> anyhow::Result<()> {
    // The README's tiny world (4 episodes, 3:1:0), and a few more seeds: every written split holds an
    // ambiguous episode whenever the world has at least one per written split.
    for seed in 0..6 {
        let out = tmp(&format!("spread-{seed}"));
        let a = SynthArgs { width: 224, height: 400, split: "3:1:0".into(), ..args(&out, 4, seed) };
        let report = synth(&a)?;
        assert_eq!(report.files.len(), 2, "train and val");
        for (name, file, n) in &report.files {
            let eps = load_episodes(file)?;
            assert_eq!(eps.len(), *n);
            let ambiguous = eps.iter().filter(|e| e.episode.is_ambiguous()).count();
            assert!(ambiguous > 0 || report.ambiguous < 2, "seed {seed}: {name} has none of {}", report.ambiguous);
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    Ok(())
}
