//! The playground page at `/`, used the way a person uses it, in a real headless chromium driven over
//! WebDriver (`playground/webdriver.rs`): a whole ASK/SAY session on the tiny random Qwen2.5-VL checkpoint
//! (an uploaded screenshot, a task, the agent's question, a free-text answer, the next action drawn),
//! and on the stub backend a synthetic screen, option buttons, an API error shown on the page, and the
//! adapter picker (its default, its pause threshold, and the adapter the requests carry). What the
//! user sees is read from the DOM and the overlay canvas's pixels, and each stage is saved as a PNG under
//! the target's tmp folder (`playground/`), printed with `--nocapture`.
//!
//! Without `chromedriver` and `chromium` (Debian: `chromium chromium-driver`) the browser tests print
//! `SKIPPED` and pass; `.ci/run` installs both. `--no-ui` and the page's HTTP answers need no browser.

mod common;
#[path = "playground/webdriver.rs"]
mod webdriver;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use askgui_serve::model_backend::{ModelBackend, ModelBackendConfig};
use askgui_serve::{Config, ServerHandle};
use serde_json::{json, Value};
use webdriver::Browser;

/// A model step on two busy CPU cores takes seconds; this bounds every wait on one.
const STEP_WAIT: Duration = Duration::from_secs(120);
const UI_WAIT: Duration = Duration::from_secs(20);

fn browser_or_skip(test: &str) -> Option<Browser> {
    match Browser::installed() {
        Ok((driver, chromium)) => Some(Browser::launch(&driver, &chromium)),
        Err(why) => {
            println!("SKIPPED: {test}: {why}; install chromium and chromium-driver to run it");
            None
        }
    }
}

/// A folder for this test's page screenshots, emptied first.
fn shots_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("playground").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("screenshot folder");
    dir
}

fn tiny_model_server() -> ServerHandle {
    let ckpt = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl");
    let mut cfg = Config::for_model(ckpt.display().to_string());
    cfg.port = 0;
    let backend_cfg = ModelBackendConfig::from(&cfg);
    let factory = Box::new(move || {
        let b: Box<dyn askgui_serve::backend::Backend> = Box::new(ModelBackend::load(&backend_cfg)?);
        Ok(b)
    });
    let handle = askgui_serve::start(cfg, factory).expect("server starts");
    let t0 = Instant::now();
    while common::get(&handle.url("/health")).status != 200 {
        assert!(t0.elapsed() < Duration::from_secs(120), "the model did not load in 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    handle
}

/// Painted overlay pixels: in all, and within 40 px of the action's point (`data-point`), if it has one.
const OVERLAY_PAINT: &str = "
    const o = document.getElementById('overlay');
    const d = o.getContext('2d').getImageData(0, 0, o.width, o.height).data;
    const [px, py] = (o.dataset.point || 'NaN,NaN').split(',').map(Number);
    let all = 0, near = 0;
    for (let i = 3; i < d.length; i += 4) {
        if (d[i] === 0) continue;
        all++;
        const k = (i - 3) / 4, x = k % o.width, y = Math.floor(k / o.width);
        if (Math.abs(x - px) <= 40 && Math.abs(y - py) <= 40) near++;
    }
    return {all, near, point: o.dataset.point || null, action: o.dataset.action || null,
            drawn: Number(o.dataset.drawn)};";

/// Pastes (on the document) or drops (on the screen) a PNG of `arguments[1]` ("W x H"), as a user would.
const PASTE_OR_DROP: &str = "
    const [w, h] = arguments[1].split(' x ').map(Number);
    const c = document.createElement('canvas');
    c.width = w; c.height = h;
    const g = c.getContext('2d');
    g.fillStyle = '#3a7'; g.fillRect(0, 0, w, h);
    const bin = atob(c.toDataURL('image/png').split(',')[1]);
    const dt = new DataTransfer();
    dt.items.add(new File([Uint8Array.from(bin, (ch) => ch.charCodeAt(0))], 'shot.png', {type: 'image/png'}));
    if (arguments[0] === 'paste') document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt}));
    else document.getElementById('frame').dispatchEvent(new DragEvent('drop', {dataTransfer: dt}));";

const HISTORY: &str = "return [...document.querySelectorAll('#history li')].map((li) => li.innerText);";

/// The page's history list.
fn history(b: &Browser) -> Vec<String> {
    serde_json::from_value(b.exec(HISTORY, json!([]))).expect("history strings")
}

/// Waits until the page's overlay has been drawn `n` times and the page is idle again.
fn wait_drawn(b: &Browser, n: u64, what: &str) -> Value {
    let script = format!(
        "return document.getElementById('overlay').dataset.drawn === '{n}' && document.body.dataset.busy === '0'"
    );
    b.wait_for(&script, STEP_WAIT, what);
    b.exec(OVERLAY_PAINT, json!([]))
}

/// The screen of the upload: synthetic screen 0, as a PNG file a user would pick.
fn upload_file(dir: &std::path::Path) -> PathBuf {
    let shot = askgui_serve::ui::synthetic(0).expect("synthetic screen");
    let b64 = shot["image"].as_str().unwrap().trim_start_matches("data:image/png;base64,");
    let path = dir.join("upload.png");
    std::fs::write(&path, askgui_data::convert::base64_decode(b64).unwrap()).unwrap();
    path
}

#[test]
fn a_whole_ask_say_session_through_the_page_on_the_tiny_model() {
    let Some(b) = browser_or_skip("the tiny-model session") else { return };
    let t0 = Instant::now();
    let server = tiny_model_server();
    let dir = shots_dir("tiny-model");
    println!("the server had the model loaded in {:.1} s", t0.elapsed().as_secs_f64());

    b.goto(&server.url("/"));
    b.wait_for("return document.getElementById('health').innerText.includes('tiny-qwen2_5_vl')", UI_WAIT, "/health");
    // No adapter: the base model is the only choice, and it has no calibrated pause level.
    assert_eq!(b.exec("return document.getElementById('adapter').value", json!([])), json!(""));
    assert_eq!(
        b.text("#adapter-info"),
        "the base model: no calibrated pause threshold (the model decides when to ask)"
    );
    b.screenshot(&dir.join("1-loaded.png"));
    b.upload("#file", &upload_file(&dir));
    let info = b.wait_for("return document.getElementById('screen-info').innerText", UI_WAIT, "the upload");
    assert_eq!(info, json!("360 x 640"), "the uploaded screenshot's size, without elements");
    let task = "Buy the milk";
    b.fill("#task", task);
    b.click("#advanced summary");
    // Threshold 0: ask whenever p(ask) >= 0, so the random model asks.
    b.fill("#pause", "0");
    b.screenshot(&dir.join("2-screen-and-task.png"));

    let t_ask = Instant::now();
    b.click("#step");
    let q =
        "const a = document.getElementById('ask'); return !a.hidden && document.getElementById('question').innerText";
    let question = b.wait_for(q, STEP_WAIT, "the agent's question").as_str().unwrap().to_string();
    println!("asked in {:.1} s: {question:?}", t_ask.elapsed().as_secs_f64());
    b.screenshot(&dir.join("3-question.png"));
    let paint = b.exec(OVERLAY_PAINT, json!([]));
    assert_eq!((paint["action"].as_str(), paint["drawn"].as_u64()), (Some("ask"), Some(1)), "{paint}");
    assert!(paint["all"].as_u64().unwrap() > 1000, "the question's caption is painted on the screen: {paint}");
    assert_eq!(b.text("#caption"), format!("ask: {question}"));
    assert_eq!(history(&b), [format!("task: {task}"), format!("agent: ask: {question}")]);

    // The user answers in the free-text box; the step after it may not ask again (threshold 1).
    let answer = "Oat milk, one litre.";
    b.fill("#pause", "1");
    b.fill("#answer", answer);
    let t_next = Instant::now();
    b.click("#send");
    let paint = wait_drawn(&b, 2, "the action after the answer");
    println!("answered and stepped in {:.1} s: {paint}", t_next.elapsed().as_secs_f64());
    b.screenshot(&dir.join("4-next-action.png"));
    check_next_action(&b, &server, &paint, task, &question, answer);
    println!("the whole session took {:.1} s", t0.elapsed().as_secs_f64());
}

/// What the page shows after the answer matches what the server holds for the session.
fn check_next_action(b: &Browser, server: &ServerHandle, paint: &Value, task: &str, question: &str, answer: &str) {
    let action = paint["action"].as_str().expect("an action drawn").to_string();
    assert_ne!(action, "ask", "threshold 1 never asks");
    assert!(b.exec("return document.getElementById('ask').hidden", json!([])) == json!(true), "the question stays up");
    let caption = b.text("#caption");
    assert!(caption.starts_with(&action), "{caption} for {action}");
    assert_eq!(
        history(b),
        [
            format!("task: {task}"),
            format!("agent: ask: {question}"),
            format!("you: {answer}"),
            format!("agent: {caption}")
        ]
    );
    assert!(paint["all"].as_u64().unwrap() > 1000, "nothing painted: {paint}");
    if let Some(p) = paint["point"].as_str() {
        // More than a caption's stray glyph; a mark in a corner is partly off the canvas.
        assert!(paint["near"].as_u64().unwrap() > 20, "no mark near the action's point {p}: {paint}");
        assert!(caption.contains(&format!("({})", p.replace(',', ", "))), "{caption} names {p}");
    }
    // The page drove the session API: the server's history is the page's.
    let id = b.exec("return window.playground.state.session", json!([]));
    let s = common::get(&server.url(&format!("/v1/sessions/{}", id.as_str().unwrap()))).json();
    let turns = s["history"].as_array().expect("history");
    assert_eq!(turns.len(), 3, "{s}");
    assert_eq!(turns[0]["action"]["question"], json!(question));
    assert_eq!(turns[1], json!({"turn": "say", "text": answer}));
    assert_eq!(turns[2]["action"]["action"], json!(action));
}

#[test]
fn a_synthetic_screen_option_buttons_and_errors_on_the_stub() {
    let Some(b) = browser_or_skip("the stub session") else { return };
    let (server, log) = common::serve();
    let dir = shots_dir("stub");
    b.goto(&server.url("/"));
    b.wait_for("return document.getElementById('health').innerText.includes('stub-model')", UI_WAIT, "/health");
    // The server's only adapter is chosen.
    let chosen = "return document.getElementById('adapter').value";
    assert_eq!(b.wait_for(chosen, UI_WAIT, "the adapter picker"), json!(common::ADAPTER));

    // A step with no screen is refused on the page, before any request.
    b.click("#step");
    let err =
        b.wait_for("const e = document.getElementById('error'); return !e.hidden && e.innerText", UI_WAIT, "the error");
    assert_eq!(err, json!("upload, paste or pick a screen first"));

    // A pasted screenshot, then a dropped one.
    for (event, size) in [("paste", "200 x 120"), ("drop", "120 x 90")] {
        b.exec(PASTE_OR_DROP, json!([event, size]));
        let script = format!("return document.getElementById('screen-info').innerText === '{size}'");
        b.wait_for(&script, UI_WAIT, event);
    }

    // A synthetic screen brings its elements and its task; the stub asks when the task has a '?'.
    b.click("#synthetic option[value='2']");
    let info = "const t = document.getElementById('screen-info').innerText; return t.includes('elements') && t";
    let info = b.wait_for(info, UI_WAIT, "the synthetic screen");
    assert!(info.as_str().unwrap().starts_with("360 x 640, "), "{info}");
    let offered = b.exec("return document.getElementById('task').value", json!([]));
    assert_eq!(offered, askgui_serve::ui::synthetic(2).unwrap()["task"], "the screen's task fills the box");
    b.fill("#task", "Set the volume to which level?");
    b.click("#step");
    b.wait_for("return !document.getElementById('ask').hidden", UI_WAIT, "the stub's question");
    assert_eq!(b.text("#question"), "Which one do you mean?");
    let adapters: Vec<_> = log.step_requests().into_iter().map(|r| r.adapter).collect();
    assert_eq!(adapters, [Some(common::ADAPTER.to_string())], "the step was answered with the only adapter");
    assert!(
        b.text("#error").is_empty()
            || b.exec("return document.getElementById('error').hidden", json!([])) == json!(true)
    );

    // Neither backend lists options yet; a question that does gets a button per option.
    let opts = json!({"action": "ask", "question": "Which one do you mean?",
                      "options": [{"label": "Volume 30%"}, {"label": "Volume 60%", "detail": "the usual"}]});
    b.exec("window.playground.showAsk(arguments[0])", json!([opts]));
    assert_eq!(
        b.exec("return [...document.querySelectorAll('#options button')].map((x) => x.innerText)", json!([])),
        json!(["Volume 30%", "Volume 60%"])
    );
    b.screenshot(&dir.join("1-question-with-options.png"));
    b.click("#options button:nth-child(2)");
    let paint = wait_drawn(&b, 2, "the click after the answer");
    b.screenshot(&dir.join("2-click.png"));
    assert_eq!(b.text("#caption"), "click (180, 320)", "the stub clicks the centre");
    assert_eq!((paint["point"].as_str(), paint["near"].as_u64().unwrap() > 50), (Some("180,320"), true), "{paint}");
    assert_eq!(history(&b)[2], "you: Volume 60%");
    check_element_box(&b);

    // A new task in the same session.
    b.fill("#task", "Open the settings");
    b.click("#step");
    wait_drawn(&b, 4, "the next task's click");
    assert_eq!(history(&b)[4..], ["next task: Open the settings", "agent: click (180, 320)"]);

    // An API error is shown as the server words it: the session is gone behind the page's back.
    let id = b.exec("return window.playground.state.session", json!([]));
    assert_eq!(
        common::send("DELETE", &server.url(&format!("/v1/sessions/{}", id.as_str().unwrap())), None, None).status,
        204
    );
    b.click("#step");
    let err =
        b.wait_for("const e = document.getElementById('error'); return !e.hidden && e.innerText", UI_WAIT, "the 404");
    let err = err.as_str().unwrap();
    assert!(err.starts_with("404: no session") && err.ends_with("; the next step starts a new session"), "{err}");
    b.screenshot(&dir.join("3-error.png"));
}

/// Two adapters, one calibrated: the first is chosen, each choice shows its pause level, and the session
/// that follows a choice is answered with that adapter (or with none, for the base model).
#[test]
fn the_adapter_picker_chooses_the_adapter_of_every_request() {
    use askgui_serve::backend::PauseLevels;
    use askgui_serve::stub::{StubBackend, StubLog};
    let Some(b) = browser_or_skip("the adapter picker") else { return };
    let log = std::sync::Arc::new(StubLog::default());
    let for_backend = log.clone();
    let factory: askgui_serve::BackendFactory = Box::new(move || {
        let pauses = PauseLevels { base: None, adapters: vec![("ask".into(), 0.75)] };
        let stub = StubBackend::with_log(common::MODEL, &["navi-lora", "ask"], for_backend).with_pause_levels(pauses);
        Ok(Box::new(stub) as _)
    });
    let server = askgui_serve::start(common::config(), factory).expect("the server starts");
    common::wait_ready(&server);
    let dir = shots_dir("adapters");
    b.goto(&server.url("/"));
    let chosen = "return document.getElementById('adapter').value";
    assert_eq!(b.wait_for(chosen, UI_WAIT, "the adapter picker"), json!("navi-lora"), "the first adapter");
    let offered = b.exec("return [...document.querySelectorAll('#adapter option')].map((o) => o.value)", json!([]));
    assert_eq!(offered, json!(["navi-lora", "ask", ""]), "the server's adapters, then the base model");
    assert_eq!(
        b.text("#adapter-info"),
        "adapter navi-lora: no calibrated pause threshold (the model decides when to ask)"
    );

    // Picking `ask` shows its calibrated level; a step is then answered with `ask`.
    b.click("#adapter option[value='ask']");
    b.wait_for("return document.getElementById('adapter-info').innerText.includes('0.75')", UI_WAIT, "ask's level");
    assert_eq!(b.text("#adapter-info"), "adapter ask: pause threshold 0.75 (asks when p(ask) >= 0.75)");
    b.click("#synthetic option[value='1']");
    b.wait_for("return document.getElementById('screen-info').innerText.includes('elements')", UI_WAIT, "the screen");
    b.fill("#task", "Open the settings");
    b.click("#step");
    wait_drawn(&b, 1, "the step with `ask`");
    b.screenshot(&dir.join("1-adapter-ask.png"));
    assert!(b.text("#meta").starts_with("adapter ask, "), "{}", b.text("#meta"));
    let id = b.exec("return window.playground.state.session", json!([]));
    let session = common::get(&server.url(&format!("/v1/sessions/{}", id.as_str().unwrap()))).json();
    assert_eq!(session["adapter"], json!("ask"), "the session was created with the adapter picked");

    // The base model: a new session, without an adapter.
    b.click("#adapter option[value='']");
    b.wait_for("return window.playground.state.session === null", UI_WAIT, "the new session");
    b.click("#step");
    wait_drawn(&b, 2, "the step without an adapter");
    let adapters: Vec<_> = log.step_requests().into_iter().map(|r| r.adapter).collect();
    assert_eq!(adapters, [Some("ask".to_string()), None], "what each step was answered with");
    assert_eq!(history(&b), ["task: Open the settings", "agent: click (180, 320)"], "the history starts over");
}

/// An action naming an element gets the element's box drawn (no backend names elements yet).
fn check_element_box(b: &Browser) {
    let el = b.exec("return window.playground.state.elements[3]", json!([]));
    b.exec("window.playground.drawAction({action: 'click', element: arguments[0]})", json!([el["id"]]));
    let [x1, y1, x2, _] = serde_json::from_value::<[i64; 4]>(el["bbox"].clone()).unwrap();
    let alpha = "const c = document.getElementById('overlay').getContext('2d');
                 return c.getImageData(arguments[0], arguments[1], 1, 1).data[3]";
    assert!(b.exec(alpha, json!([(x1 + x2) / 2, y1])).as_u64().unwrap() > 0, "no box edge at the top of {el}");
    assert_eq!(b.exec(alpha, json!([(x1 + x2) / 2, y1 - 12])), json!(0), "paint above the box of {el}");
}

#[test]
fn the_page_is_at_root_unless_no_ui() {
    let (server, _) = common::serve();
    let page = common::get(&server.url("/"));
    assert_eq!((page.status, page.content_type.as_str()), (200, "text/html; charset=utf-8"));
    assert!(page.body.contains("<title>askgui playground</title>"));
    let shot = common::get(&server.url("/ui/screens/1"));
    assert_eq!(shot.status, 200, "{}", shot.body);
    assert!(shot.json()["elements"].as_array().is_some_and(|e| !e.is_empty()));
    let missing = common::get(&server.url("/ui/screens/99"));
    assert_eq!(missing.status, 404);
    assert!(missing.message().contains("there are 0 to 5"), "{}", missing.body);
    assert_eq!(common::send("POST", &server.url("/"), Some(b"{}"), None).status, 405);

    let mut cfg = common::config();
    cfg.no_ui = true;
    cfg.api_key = Some("k".into());
    let (server, _) = common::serve_with(cfg);
    let root = common::send("GET", &server.url("/"), None, Some("k"));
    assert_eq!(root.status, 404, "{}", root.body);
    assert!(root.message().starts_with("no route GET /"), "{}", root.body);
    assert_eq!(common::get(&server.url("/ui/screens/1")).status, 404);
}

#[test]
fn the_page_needs_no_api_key_but_the_api_does() {
    let mut cfg = common::config();
    cfg.api_key = Some("k".into());
    let (server, _) = common::serve_with(cfg);
    assert_eq!(common::get(&server.url("/")).status, 200);
    assert_eq!(common::get(&server.url("/ui/screens/0")).status, 200);
    assert_eq!(common::get(&server.url("/v1/models")).status, 401);
}
