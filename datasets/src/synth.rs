//! `askgui-data synth`: a synthetic GUI world in which asking is genuinely necessary.
//!
//! Four small phone apps (Shop, Booking, Contacts, Settings) on a home screen, beside two that no task
//! needs (Camera, Maps). Every task is a short multi-step episode: transactional steps (open the app,
//! confirm) and informative steps (pick the product, the day, the time, the contact, the message text,
//! the level). Each screen offers several comparable options in a shuffled order with nothing marking the
//! right one, so when a detail is left out of the task the screen cannot decide it: the agent has to ask.
//! Where a step's answer is not in the task, it is on the screen: the confirm buttons sit in one of three
//! rows, a contact's page offers four actions, so an agent that ignores the screen loses most steps.
//!
//! Half of the episodes are ambiguous (one detail removed, two for some bookings), with the question and
//! the user's answer on the informative step; the other half give the full task and need no question, so
//! an agent that always asks loses as much as one that never does. Screens are drawn with real text and
//! every widget is listed with its box. Episode `i` depends only on `(seed, i)`, so a run is reproducible
//! and a larger run extends a smaller one.

use std::path::{Path, PathBuf};

use image::Rgb;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use thiserror::Error;

use crate::action::{Action, AskKind, AskOption, DoneStatus, Target};
use crate::canvas::{Badge, Canvas, ACCENT, FIELD, INK, ROW, WHITE};
use crate::episode::{write_episodes, Episode, Platform, Screen, Step, StepAsk};

#[derive(Debug, Error)]
pub enum SynthError {
    #[error("screen {width}x{height} is too small for the synthetic apps: use at least 160x160")]
    TooSmall { width: u32, height: u32 },
    #[error("--ambiguous-fraction {0} must be within 0..=1")]
    Fraction(f64),
    #[error("--split `{0}` must be three non-negative weights like 8:1:1, not all zero")]
    Split(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Image { path: PathBuf, source: image::ImageError },
    #[error(transparent)]
    Episode(#[from] crate::episode::EpisodeError),
}

/// `askgui-data synth`'s flags; the look flags set the fields of [`Look`] of the same names.
#[derive(Debug, Clone, clap::Args)]
pub struct SynthArgs {
    /// Output folder: train/val/test JSONL files and images/.
    #[arg(long)]
    pub out: PathBuf,
    /// Episodes in all, before the split.
    #[arg(long, default_value_t = 200)]
    pub episodes: usize,
    /// Seeds the tasks, the screens and the split.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Screen width in pixels (at least 160).
    #[arg(long, default_value_t = 360)]
    pub width: u32,
    /// Screen height in pixels (at least 160).
    #[arg(long, default_value_t = 640)]
    pub height: u32,
    /// Weights of the train:val:test split; each weighted split gets at least one episode. A small val split
    /// also caps the trainer's agent eval (`--eval-episodes`, default 32).
    #[arg(long, default_value = "8:1:1")]
    pub split: String,
    /// Fraction of the episodes whose task leaves out a detail (the rest need no question).
    #[arg(long, default_value_t = 0.5)]
    pub ambiguous_fraction: f64,
    /// Draw each list row and home-screen icon in the colour of its slot.
    #[arg(long)]
    pub slot_colors: bool,
    /// Snap rows and icons to multiples of this many pixels (0: no snapping).
    #[arg(long, default_value_t = 0)]
    pub grid: u32,
    /// Give every option and app icon a badge whose colours identify its label.
    #[arg(long)]
    pub icons: bool,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SynthReport {
    /// `(split name, file, episodes)`.
    pub files: Vec<(String, PathBuf, usize)>,
    pub steps: usize,
    pub ambiguous: usize,
}

/// One step while it is being built: the screen drawn, the action, and the informative detail.
struct Draft {
    canvas: Canvas,
    action: Action,
    informative: bool,
    instruction: String,
    /// The question and answer to use if this step's detail is removed from the task.
    ask: Option<StepAsk>,
}

/// A task being built: its steps, and which details can be removed (index into `details`).
struct TaskDraft {
    steps: Vec<Draft>,
    /// `(full phrase, ambiguous phrase, step index)` for each removable detail, in task order.
    details: Vec<(String, String, usize)>,
    template: fn(&[String]) -> String,
}

const APPS: [&str; 4] = ["Shop", "Booking", "Contacts", "Settings"];
/// Apps on the home screen that no task opens.
const DECOY_APPS: [&str; 2] = ["Camera", "Maps"];

const CATEGORIES: [(&str, &str, &[&str]); 4] = [
    ("Milk", "milk", &["Oat milk", "Almond milk", "Soy milk", "Whole milk", "Skim milk", "Goat milk"]),
    ("Coffee", "coffee", &["Espresso beans", "Decaf beans", "Ground coffee", "Instant coffee", "Cold brew"]),
    ("Bread", "bread", &["Sourdough", "Rye bread", "Baguette", "Whole wheat", "Brioche"]),
    ("Fruit", "fruit", &["Apples", "Bananas", "Oranges", "Pears", "Mangoes", "Plums"]),
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const TIMES: [&str; 8] = ["12:00", "12:30", "13:00", "18:00", "18:30", "19:00", "19:30", "20:00"];
const PEOPLE: [&str; 6] = ["1 person", "2 people", "3 people", "4 people", "5 people", "6 people"];
const FIRST: [&str; 6] = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank"];
const LAST: [&str; 8] = ["Smith", "Jones", "Lee", "Brown", "Garcia", "Khan", "Novak", "Silva"];
/// What a contact's page offers; tasks only call or message.
const CONTACT_ACTIONS: [&str; 4] = ["Call", "Message", "Video call", "Block"];
const PAGES: [(&str, &str, &[&str]); 3] = [
    ("Display", "brightness", &["Brightness 25%", "Brightness 50%", "Brightness 75%", "Brightness 100%"]),
    ("Sound", "volume", &["Volume 0%", "Volume 30%", "Volume 60%", "Volume 90%"]),
    ("Text size", "text size", &["Small text", "Medium text", "Large text", "Huge text"]),
];
/// The settings page that no task opens.
const DECOY_PAGE: &str = "Battery";

/// Slot colours of `--slot-colors`: list row `i` and home-screen icon `i` are drawn in colour `i` (row `i`
/// in colour `i % 6`: an action button's row can be the seventh).
const ROW_COLORS: [Rgb<u8>; 6] = [
    Rgb([255, 212, 212]),
    Rgb([208, 228, 255]),
    Rgb([214, 244, 206]),
    Rgb([255, 238, 190]),
    Rgb([232, 214, 255]),
    Rgb([204, 242, 238]),
];
/// Home-screen slot colours: dark and muted, so that white labels and the bright badges stand out.
const ICON_COLORS: [Rgb<u8>; 6] = [
    Rgb([120, 64, 64]),
    Rgb([56, 80, 128]),
    Rgb([48, 108, 68]),
    Rgb([128, 104, 48]),
    Rgb([96, 64, 120]),
    Rgb([40, 104, 112]),
];

/// Badge colours of `--icons`: far apart in RGB, and none of them a slot colour.
const CODE_COLORS: [Rgb<u8>; 9] = [
    Rgb([230, 25, 75]),
    Rgb([60, 180, 75]),
    Rgb([0, 130, 200]),
    Rgb([245, 130, 48]),
    Rgb([145, 30, 180]),
    Rgb([255, 225, 25]),
    Rgb([240, 50, 230]),
    Rgb([128, 128, 0]),
    Rgb([0, 210, 210]),
];

/// Every label that gets a badge under `--icons`, except contact names, in a fixed order.
fn badge_labels() -> impl Iterator<Item = &'static str> {
    APPS.iter()
        .chain(&DECOY_APPS)
        .copied()
        .chain(CATEGORIES.iter().map(|c| c.0))
        .chain(CATEGORIES.iter().flat_map(|c| c.2.iter().copied()))
        .chain(DAYS.iter().chain(&TIMES).chain(&PEOPLE).chain(&CONTACT_ACTIONS).copied())
        .chain(PAGES.iter().map(|p| p.0))
        .chain([DECOY_PAGE])
        .chain(PAGES.iter().flat_map(|p| p.2.iter().copied()))
}

/// The badge of a label under `--icons` (None for a label that has none): label `k` of
/// [`badge_labels`] is side-by-side stripes of colours `k / 9` and `k % 9`; a contact's name is stacked
/// stripes, its first name's colour over its last name's. A badge means one label everywhere, so a model
/// can tie it to the label's words without first working out which screen it is on.
pub fn badge_code(label: &str) -> Option<Badge> {
    let n = CODE_COLORS.len();
    if let Some(k) = badge_labels().position(|l| l == label) {
        return Some(Badge { colors: [CODE_COLORS[k / n % n], CODE_COLORS[k % n]], across: false });
    }
    let at = |list: &[&str], w: &str| list.iter().position(|x| *x == w);
    let (f, l) = label.split_once(' ').and_then(|(f, l)| Some((at(&FIRST, f)?, at(&LAST, l)?)))?;
    Some(Badge { colors: [CODE_COLORS[f], CODE_COLORS[l]], across: true })
}

/// How screens are drawn: their size, and whether list rows and icons carry slot colours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Look {
    pub width: u32,
    pub height: u32,
    /// Each slot (list row, home-screen icon, and the first cell of an action button's row) in a colour of
    /// its own, the same colour for the same slot on every screen: a cue of *where* a label is that a model
    /// with no notion of absolute position (patch features under RoPE carry none) can read in one glance.
    /// The labels still decide which slot to tap.
    pub slot_colors: bool,
    /// Snap the header, list rows and icons to multiples of this many pixels (0: no snapping). With the
    /// model's merged patch size (28 for Qwen2-VL and Qwen2.5-VL) and a screen the processor keeps
    /// unresized, a label looks the same to the model in every row: its glyphs fall on the patch grid
    /// the same way. Rows then touch (one grid cell tall each); slot colours tell them apart.
    pub grid: u32,
    /// A badge on every option and app icon whose colours identify its label, as app icons do (see
    /// [`badge_code`]). A small model reads a colour in one glance; learning to read 8-pixel glyphs from
    /// scratch takes far more training than a CPU demo has. The badge says *what* an option is, never
    /// whether it is the one the user wants: an incomplete task is as undecidable as without it.
    pub icons: bool,
}

impl From<(u32, u32)> for Look {
    fn from((width, height): (u32, u32)) -> Self {
        Self { width, height, slot_colors: false, grid: 0, icons: false }
    }
}

impl Look {
    fn canvas(&self) -> Canvas {
        let mut c = Canvas::new(self.width, self.height);
        c.grid = self.grid as i32;
        c
    }

    /// Draws an option (`stacked`: an app icon), with its badge under `--icons`; returns its id.
    #[allow(clippy::too_many_arguments)]
    fn option(
        &self,
        c: &mut Canvas,
        role: &str,
        bbox: [i32; 4],
        text: &str,
        bg: Rgb<u8>,
        fg: Rgb<u8>,
        stacked: bool,
    ) -> String {
        match badge_code(text).filter(|_| self.icons) {
            Some(badge) => c.badged_widget(role, bbox, text, bg, fg, &badge, stacked),
            None => c.widget(role, bbox, text, bg, fg, stacked),
        }
    }

    /// The action button (Add to cart, Confirm, Send) in list row `row`; returns its id. With
    /// `--slot-colors` the row's first cell (one grid cell, or a square) shows the row's slot colour and
    /// the button fills the rest: the button's row is then as readable as a list row's, so that a model
    /// with no absolute positions can tell in which of the rows it sits. Without, the button fills the row.
    fn button(&self, c: &mut Canvas, row: usize, text: &str) -> String {
        let [x1, y1, x2, y2] = c.row_box(row);
        if !self.slot_colors {
            return c.widget("button", [x1, y1, x2, y2], text, ACCENT, WHITE, true);
        }
        let cell = if c.grid > 0 { c.grid } else { y2 - y1 };
        c.fill([x1, y1, x1 + cell, y2], self.slot_color(row, ROW, &ROW_COLORS));
        c.widget("button", [x1 + cell, y1, x2, y2], text, ACCENT, WHITE, true)
    }

    /// The fill of slot `i`: its own colour with `--slot-colors`, else the plain `base`.
    fn slot_color(&self, i: usize, base: Rgb<u8>, palette: &[Rgb<u8>]) -> Rgb<u8> {
        if self.slot_colors {
            palette[i % palette.len()]
        } else {
            base
        }
    }
}

fn click(c: &Canvas, id: &str) -> Action {
    let (x, y) = c.element(id).center();
    Action::Click(Target { x: Some(x), y: Some(y), element: Some(id.to_string()) })
}

/// The home screen with the six apps (two that no task needs) in a shuffled 2x3 grid; returns the step
/// that opens `app`.
fn home(look: Look, app: &str, rng: &mut impl Rng) -> Draft {
    let mut c = look.canvas();
    c.header("Home");
    let mut apps: Vec<&str> = APPS.iter().chain(&DECOY_APPS).copied().collect();
    apps.shuffle(rng);
    let (cw, ch) = (c.width(), c.height());
    let top = c.elements[0].bbox[3];
    let size = c.snap((cw / 3).min(ch / 5));
    let pitch = (ch - top) / 3;
    let pitch = if c.grid > 0 { pitch / c.grid * c.grid } else { pitch };
    let mut target = String::new();
    for (i, name) in apps.iter().enumerate() {
        let (col, row) = ((i % 2) as i32, (i / 2) as i32);
        let x1 = c.snap(cw / 4 + col * cw / 2 - size / 2);
        let y1 = c.snap(top + row * pitch + (pitch - size) / 2);
        let bg = look.slot_color(i, ACCENT, &ICON_COLORS);
        let id = look.option(&mut c, "icon", [x1, y1, x1 + size, y1 + size], name, bg, WHITE, true);
        if *name == app {
            target = id;
        }
    }
    Draft {
        action: click(&c, &target),
        canvas: c,
        informative: false,
        instruction: format!("Open the {app} app"),
        ask: None,
    }
}

/// A list screen of `options`; the step clicks `pick`.
fn list(look: Look, title: &str, options: &[String], pick: &str) -> (Canvas, Action) {
    let mut c = look.canvas();
    c.header(title);
    let mut target = String::new();
    for (i, o) in options.iter().enumerate() {
        let bbox = c.row_box(i);
        let id = look.option(&mut c, "button", bbox, o, look.slot_color(i, ROW, &ROW_COLORS), INK, false);
        if o == pick {
            target = id;
        }
    }
    let a = click(&c, &target);
    (c, a)
}

/// An informative list step: choosing `pick` among `options`, with the question to ask if the task
/// does not say which.
fn choice(look: Look, title: &str, options: &[String], pick: &str, question: &str, answer: String) -> Draft {
    let (canvas, action) = list(look, title, options, pick);
    Draft {
        canvas,
        action,
        informative: true,
        instruction: format!("Select {pick}"),
        ask: Some(StepAsk {
            question: format!("{question} {}?", or_list(options)),
            answer,
            options: options.iter().map(|o| AskOption { label: o.clone(), detail: None }).collect(),
            kind: Some(AskKind::Selection),
        }),
    }
}

fn or_list(options: &[String]) -> String {
    match options {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// A screen with a message and one button, in one of the three rows below the message (the screen, not
/// the history, says where); the step clicks the button (or is `done` when `button` is None).
fn confirm(look: Look, title: &str, lines: &[String], button: Option<&str>, rng: &mut impl Rng) -> Draft {
    let mut c = look.canvas();
    c.header(title);
    for (i, l) in lines.iter().enumerate() {
        let [x1, y1, x2, y2] = c.row_box(i);
        let id_box = [x1, y1, x2, y2];
        c.widget("text", id_box, l, crate::canvas::BACKGROUND, INK, false);
    }
    let (action, instruction) = match button {
        Some(b) => {
            // One of the three rows below the message, kept on a small screen.
            let row = (lines.len() + 1 + rng.random_range(0..3)).min(c.rows_that_fit().saturating_sub(1));
            let id = look.button(&mut c, row, b);
            (click(&c, &id), format!("Tap {b}"))
        }
        None => (Action::Done { status: DoneStatus::Success }, "The task is complete".to_string()),
    };
    Draft { canvas: c, action, informative: false, instruction, ask: None }
}

fn pick_n<'a>(pool: &'a [&'a str], n: usize, rng: &mut impl Rng) -> Vec<String> {
    let mut v: Vec<String> = pool.choose_multiple(rng, n).map(|s| s.to_string()).collect();
    v.shuffle(rng);
    v
}

fn shop(look: Look, rng: &mut impl Rng) -> TaskDraft {
    let (cat, noun, items) = *CATEGORIES.choose(rng).expect("non-empty");
    let options = pick_n(items, 4, rng);
    let pick = options.choose(rng).expect("four options").clone();
    let price = format!("${}.{:02}", rng.random_range(1..9), rng.random_range(0..100));
    let mut cats: Vec<String> = CATEGORIES.iter().map(|c| c.0.to_string()).collect();
    cats.shuffle(rng);
    let (c1, a1) = list(look, "Shop", &cats, cat);
    let steps = vec![
        home(look, "Shop", rng),
        Draft { canvas: c1, action: a1, informative: false, instruction: format!("Open the {cat} aisle"), ask: None },
        choice(look, cat, &options, &pick, &format!("Which {noun} would you like:"), format!("{pick}, please.")),
        confirm(look, &pick, &[format!("Price {price}"), "In stock".into()], Some("Add to cart"), rng),
        confirm(look, "Cart", &[format!("{pick} added"), format!("Total {price}")], None, rng),
    ];
    TaskDraft {
        steps,
        details: vec![(pick.to_lowercase(), format!("some {noun}"), 2)],
        template: |d| format!("Add {} to my cart", d[0]),
    }
}

fn booking(look: Look, rng: &mut impl Rng) -> TaskDraft {
    let days = pick_n(&DAYS, 4, rng);
    let times = pick_n(&TIMES, 4, rng);
    let people = pick_n(&PEOPLE, 4, rng);
    let (day, time, size) = (
        days.choose(rng).expect("4").clone(),
        times.choose(rng).expect("4").clone(),
        people.choose(rng).expect("4").clone(),
    );
    let steps = vec![
        home(look, "Booking", rng),
        choice(look, "Pick a day", &days, &day, "Which day would you like:", format!("On {day}.")),
        choice(look, "Pick a time", &times, &time, "What time would you like:", format!("At {time}.")),
        choice(look, "Party size", &people, &size, "For how many:", format!("For {size}.")),
        confirm(look, "Confirm", &[day.clone(), time.clone(), size.clone()], Some("Confirm"), rng),
        confirm(look, "Booked", &["Table booked".into(), format!("{day} {time}")], None, rng),
    ];
    TaskDraft {
        steps,
        details: vec![
            (format!(" on {day}"), String::new(), 1),
            (format!(" at {time}"), String::new(), 2),
            (format!(" for {size}"), String::new(), 3),
        ],
        template: |d| format!("Book a table{}{}{}", d[0], d[1], d[2]),
    }
}

fn contacts(look: Look, rng: &mut impl Rng) -> TaskDraft {
    const MESSAGES: [&str; 6] =
        ["I am running late", "See you at noon", "Call me back", "Happy birthday", "On my way", "Thanks a lot"];
    // Two people share the first name, so a first name alone does not decide.
    let first = *FIRST.choose(rng).expect("non-empty");
    let lasts = pick_n(&LAST, 4, rng);
    let others: Vec<&str> = FIRST.iter().copied().filter(|f| *f != first).collect();
    let mut names = vec![format!("{first} {}", lasts[0]), format!("{first} {}", lasts[1])];
    for (i, l) in lasts[2..].iter().enumerate() {
        names.push(format!("{} {l}", others[(i + rng.random_range(0..others.len())) % others.len()]));
    }
    names.shuffle(rng);
    let full = names.iter().find(|n| n.starts_with(&format!("{first} "))).expect("two share it").clone();
    let twins: Vec<String> = names.iter().filter(|n| n.starts_with(&format!("{first} "))).cloned().collect();
    let mut person = choice(look, "Contacts", &names, &full, "Which contact:", format!("{full}."));
    if let Some(a) = person.ask.as_mut() {
        a.question = format!("Which {first} do you mean: {}?", or_list(&twins));
        a.options = twins.iter().map(|t| AskOption { label: t.clone(), detail: None }).collect();
    }
    let call = rng.random_bool(0.5);
    let mut c = look.canvas();
    c.header(&full);
    let mut verbs = CONTACT_ACTIONS;
    verbs.shuffle(rng);
    let ids: Vec<String> = verbs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let bbox = c.row_box(i + 1);
            look.option(&mut c, "button", bbox, v, look.slot_color(i + 1, ROW, &ROW_COLORS), INK, false)
        })
        .collect();
    let verb = if call { "Call" } else { "Message" };
    let vid = &ids[verbs.iter().position(|v| *v == verb).expect("every action is drawn")];
    let open =
        Draft { action: click(&c, vid), canvas: c, informative: false, instruction: format!("Tap {verb}"), ask: None };
    let mut steps = vec![home(look, "Contacts", rng), person, open];
    if call {
        steps.push(confirm(look, "Calling", std::slice::from_ref(&full), None, rng));
        return TaskDraft {
            steps,
            details: vec![(full.clone(), first.to_string(), 1)],
            template: |d| format!("Call {}", d[0]),
        };
    }
    let text = MESSAGES.choose(rng).expect("non-empty").to_string();
    let send_row = 2 + rng.random_range(0..3);
    let mut c = look.canvas();
    c.header(&format!("To {full}"));
    c.widget("textbox", c.row_box(0), "Type a message", FIELD, INK, false);
    look.button(&mut c, send_row, "Send");
    let compose = Draft {
        canvas: c,
        action: Action::Type { text: text.clone() },
        informative: true,
        instruction: format!("Type \"{text}\""),
        ask: Some(StepAsk {
            question: "What should the message say?".into(),
            answer: format!("Write: {text}"),
            options: vec![],
            kind: Some(AskKind::Specification),
        }),
    };
    let mut c = look.canvas();
    c.header(&format!("To {full}"));
    c.widget("textbox", c.row_box(0), &text, FIELD, INK, false);
    let send = look.button(&mut c, send_row, "Send");
    let send =
        Draft { action: click(&c, &send), canvas: c, informative: false, instruction: "Tap Send".into(), ask: None };
    steps.extend([compose, send, confirm(look, "Sent", &[format!("Message to {full}")], None, rng)]);
    TaskDraft {
        steps,
        details: vec![(full.clone(), first.to_string(), 1), (format!(": \"{text}\""), String::new(), 3)],
        template: |d| format!("Send a message to {}{}", d[0], d[1]),
    }
}

fn settings(look: Look, rng: &mut impl Rng) -> TaskDraft {
    let (page, what, levels) = *PAGES.choose(rng).expect("non-empty");
    let mut pages: Vec<String> = PAGES.iter().map(|p| p.0.to_string()).chain([DECOY_PAGE.to_string()]).collect();
    pages.shuffle(rng);
    let (c1, a1) = list(look, "Settings", &pages, page);
    let mut options: Vec<String> = levels.iter().map(|s| s.to_string()).collect();
    options.shuffle(rng);
    let pick = options.choose(rng).expect("four").clone();
    let steps = vec![
        home(look, "Settings", rng),
        Draft { canvas: c1, action: a1, informative: false, instruction: format!("Open {page}"), ask: None },
        choice(look, page, &options, &pick, &format!("Which {what}:"), format!("{pick}.")),
        confirm(look, page, &[format!("{pick} set")], None, rng),
    ];
    TaskDraft {
        steps,
        // "Brightness 75%" -> "to 75%"; "Large text" -> "to large text"
        details: vec![(format!(" to {}", short_level(&pick)), String::new(), 2)],
        template: match page {
            "Display" => |d| format!("Change the screen brightness{}", d[0]),
            "Sound" => |d| format!("Change the volume{}", d[0]),
            _ => |d| format!("Change the text size{}", d[0]),
        },
    }
}

fn short_level(level: &str) -> String {
    match level.rsplit_once(' ') {
        Some((_, pct)) if pct.ends_with('%') => pct.to_string(),
        _ => level.to_lowercase(),
    }
}

/// The episode `index` of the world with `seed`, drawn as `look` (or a `(width, height)`); screenshots are written under
/// `images_dir` (`<id>/<step>.png`) and referenced as `images/<id>/<step>.png`.
pub fn make_episode(
    seed: u64,
    index: usize,
    look: impl Into<Look>,
    ambiguous_fraction: f64,
    images_dir: &Path,
) -> Result<Episode, SynthError> {
    let look = look.into();
    let mut rng = episode_rng(seed, index);
    let _split_draw: f64 = rng.random(); // first draw is the split (see `split_of`)
    let draft = match rng.random_range(0..4) {
        0 => shop(look, &mut rng),
        1 => booking(look, &mut rng),
        2 => contacts(look, &mut rng),
        _ => settings(look, &mut rng),
    };
    let full: Vec<String> = draft.details.iter().map(|d| d.0.clone()).collect();
    let task = (draft.template)(&full);
    // A fraction (half by default) ambiguous: remove one detail (two, for some multi-detail tasks).
    let mut removed = vec![];
    if rng.random_bool(ambiguous_fraction) {
        let n = if draft.details.len() > 1 && rng.random_bool(0.25) { 2 } else { 1 };
        let mut idx: Vec<usize> = (0..draft.details.len()).collect();
        idx.shuffle(&mut rng);
        removed = idx[..n].to_vec();
    }
    let ambiguous_task = (!removed.is_empty()).then(|| {
        let parts: Vec<String> = draft
            .details
            .iter()
            .enumerate()
            .map(|(i, d)| if removed.contains(&i) { d.1.clone() } else { d.0.clone() })
            .collect();
        (draft.template)(&parts)
    });
    let ask_steps: Vec<usize> = removed.iter().map(|&i| draft.details[i].2).collect();
    let id = format!("synth-{seed}-{index:06}");
    let dir = images_dir.join(&id);
    std::fs::create_dir_all(&dir).map_err(|source| SynthError::Io { path: dir.clone(), source })?;
    let mut steps = Vec::with_capacity(draft.steps.len());
    for (i, d) in draft.steps.into_iter().enumerate() {
        let file = dir.join(format!("{i}.png"));
        d.canvas.img.save(&file).map_err(|source| SynthError::Image { path: file.clone(), source })?;
        steps.push(Step {
            screenshot: format!("images/{id}/{i}.png"),
            elements: Some(d.canvas.elements),
            instruction: Some(d.instruction),
            informative: Some(d.informative),
            action: d.action,
            ask: if ask_steps.contains(&i) { d.ask } else { None },
        });
    }
    let screen = Screen { width: look.width, height: look.height };
    Ok(Episode { id, platform: Platform::Android, screen, task, ambiguous_task, steps })
}

fn episode_rng(seed: u64, index: usize) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_add(1))
}

fn parse_split(s: &str) -> Result<[f64; 3], SynthError> {
    let bad = || SynthError::Split(s.to_string());
    let v: Vec<f64> = s.split(':').map(|x| x.trim().parse::<f64>().map_err(|_| bad())).collect::<Result<_, _>>()?;
    match v[..] {
        [a, b, c] if a >= 0.0 && b >= 0.0 && c >= 0.0 && a + b + c > 0.0 => Ok([a, b, c]),
        _ => Err(bad()),
    }
}

/// Which split episode `index` goes to: the episode's first random draw against the weights.
fn split_of(seed: u64, index: usize, w: [f64; 3]) -> usize {
    let r: f64 = episode_rng(seed, index).random::<f64>() * (w[0] + w[1] + w[2]);
    if r < w[0] {
        0
    } else if r < w[0] + w[1] {
        1
    } else {
        2
    }
}

/// Gives every weighted split that the draws left empty one episode, the last of the largest split, so that
/// small worlds still have a val and a test file to run (other splits are exactly as drawn).
fn fill_empty_splits(splits: &mut [Vec<Episode>; 3], weights: [f64; 3]) {
    for k in 0..3 {
        if weights[k] > 0.0 && splits[k].is_empty() {
            let largest = (0..3).max_by_key(|&j| splits[j].len()).expect("three splits");
            if splits[largest].len() > 1 {
                let ep = splits[largest].pop().expect("non-empty");
                splits[k].push(ep);
            }
        }
    }
}

/// Moves ambiguous episodes so that every non-empty split holds one (a split without any cannot measure
/// asking: calibration and the trainer's eval need a step that needs an ask). Each split without one swaps
/// its last episode for the last ambiguous episode of the split that holds the most, when that one holds
/// more than one; split sizes do not change, and a world that already has one in every split stays exactly as
/// drawn. Returns the non-empty splits still without one (too few
/// ambiguous episodes).
fn spread_ambiguous(splits: &mut [Vec<Episode>; 3]) -> Vec<usize> {
    let count = |s: &[Episode]| s.iter().filter(|e| e.is_ambiguous()).count();
    let mut short = Vec::new();
    for k in 0..3 {
        if splits[k].is_empty() || count(&splits[k]) > 0 {
            continue;
        }
        let donor = (0..3).filter(|&j| count(&splits[j]) > 1).max_by_key(|&j| count(&splits[j]));
        let Some(d) = donor else {
            short.push(k);
            continue;
        };
        let i = splits[d].iter().rposition(Episode::is_ambiguous).expect("the donor holds ambiguous episodes");
        let plain = splits[k].pop().expect("a non-empty split");
        let ambiguous = std::mem::replace(&mut splits[d][i], plain);
        splits[k].push(ambiguous);
    }
    // Episodes in the order they were drawn (ids end with the zero-padded index).
    for s in splits.iter_mut() {
        s.sort_by(|a, b| a.id.cmp(&b.id));
    }
    short
}

/// Writes the world: `out/{train,val,test}.jsonl` (splits with weight 0 are not written) and `out/images/`.
pub fn synth(args: &SynthArgs) -> Result<SynthReport, SynthError> {
    if args.width < 160 || args.height < 160 {
        return Err(SynthError::TooSmall { width: args.width, height: args.height });
    }
    if !(0.0..=1.0).contains(&args.ambiguous_fraction) {
        return Err(SynthError::Fraction(args.ambiguous_fraction));
    }
    let weights = parse_split(&args.split)?;
    let look = Look {
        width: args.width,
        height: args.height,
        slot_colors: args.slot_colors,
        grid: args.grid,
        icons: args.icons,
    };
    let images = args.out.join("images");
    std::fs::create_dir_all(&images).map_err(|source| SynthError::Io { path: images.clone(), source })?;
    let bar = indicatif::ProgressBar::new(args.episodes as u64).with_style(
        indicatif::ProgressStyle::with_template("synth {bar:30} {pos}/{len} episodes [{elapsed} < {eta}]")
            .expect("valid template"),
    );
    let mut splits: [Vec<Episode>; 3] = Default::default();
    let mut report = SynthReport::default();
    for i in 0..args.episodes {
        let ep = make_episode(args.seed, i, look, args.ambiguous_fraction, &images)?;
        report.steps += ep.steps.len();
        report.ambiguous += ep.is_ambiguous() as usize;
        splits[split_of(args.seed, i, weights)].push(ep);
        bar.inc(1);
    }
    bar.finish_and_clear();
    fill_empty_splits(&mut splits, weights);
    for k in spread_ambiguous(&mut splits) {
        let name = ["train", "val", "test"][k];
        tracing::warn!(
            "the {name} split has no ambiguous episode (too few in the world): it cannot measure asking; \
             give more --episodes or a larger --ambiguous-fraction"
        );
    }
    for (k, name) in ["train", "val", "test"].iter().enumerate() {
        if weights[k] == 0.0 {
            continue;
        }
        let file = args.out.join(format!("{name}.jsonl"));
        write_episodes(&file, &splits[k])?;
        report.files.push((name.to_string(), file, splits[k].len()));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Episode `i` (id `synth-0-00000i`), ambiguous or not, with no steps.
    fn ep(i: usize, ambiguous: bool) -> Episode {
        Episode {
            id: format!("synth-0-{i:06}"),
            platform: Platform::Android,
            screen: Screen { width: 200, height: 200 },
            task: "full".into(),
            ambiguous_task: ambiguous.then(|| "vague".into()),
            steps: vec![],
        }
    }

    fn ids(s: &[Episode]) -> Vec<usize> {
        s.iter().map(|e| e.id[8..].parse().unwrap()).collect()
    }

    #[test]
    fn ambiguous_episodes_reach_every_non_empty_split() {
        // A 3:1:0 world of four: 0 and 2 ambiguous, both in train. Val has none: it swaps its only
        // episode (3) for train's last ambiguous one (2). Sizes stay 3 and 1; train keeps 0; test stays empty.
        let mut splits = [vec![ep(0, true), ep(1, false), ep(2, true)], vec![ep(3, false)], vec![]];
        assert!(spread_ambiguous(&mut splits).is_empty());
        assert_eq!((ids(&splits[0]), ids(&splits[1]), splits[2].len()), (vec![0, 1, 3], vec![2], 0));
        // One ambiguous episode for two splits: train keeps it, val is reported.
        let mut splits = [vec![ep(0, true), ep(1, false)], vec![ep(2, false)], vec![]];
        assert_eq!(spread_ambiguous(&mut splits), [1]);
        assert_eq!((ids(&splits[0]), ids(&splits[1])), (vec![0, 1], vec![2]));
        // Already one everywhere: nothing moves.
        let mut splits = [vec![ep(0, true), ep(1, false)], vec![ep(2, true)], vec![ep(3, false), ep(4, true)]];
        let before = splits.clone();
        assert!(spread_ambiguous(&mut splits).is_empty());
        assert_eq!(splits, before);
    }
}
