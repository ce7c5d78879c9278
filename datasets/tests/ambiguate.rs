//! The ambiguity pipeline against a mock OpenAI-compatible server (a `TcpListener` on 127.0.0.1:0 in a
//! thread, answering canned chat completions by the stage its prompt is for): the output validates,
//! runs resume, unusable answers are counted by stage and reason with their episodes written unchanged,
//! an endpoint that does not answer with chat completions is a clear error, 5xx is retried and 401 is not.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use askgui_data::action::{Action, DoneStatus, Target};
use askgui_data::ambiguate::{ambiguate, AmbiguateArgs, AmbiguateError};
use askgui_data::episode::{load_episodes, write_episodes, Episode, Platform, Screen, Step};
use askgui_data::validate::validate_file;
use serde_json::{json, Value};

/// One request the mock received.
#[derive(Clone, Debug)]
struct Seen {
    auth: Option<String>,
    body: Value,
}

impl Seen {
    /// The first user message: the stage's prompt.
    fn prompt(&self) -> &str {
        self.body["messages"][1]["content"].as_str().unwrap_or("")
    }
}

type Handler = Box<dyn Fn(&Seen, usize) -> (u16, String) + Send>;

struct Mock {
    base_url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Mock {
    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Starts the mock server; `handler(request, index)` gives the status and body of each answer.
fn mock(handler: Handler) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base_url = format!("http://{}/v1", listener.local_addr().expect("addr"));
    let seen = Arc::new(Mutex::new(vec![]));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
            let (mut len, mut auth, mut line) = (0usize, None, String::new());
            loop {
                line.clear();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((name, value)) = line.split_once(':') {
                    match name.trim().to_ascii_lowercase().as_str() {
                        "content-length" => len = value.trim().parse().unwrap_or(0),
                        "authorization" => auth = Some(value.trim().to_string()),
                        _ => {}
                    }
                }
            }
            let mut body = vec![0; len];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let req = Seen { auth, body: serde_json::from_slice(&body).unwrap_or(Value::Null) };
            let n = {
                let mut log = log.lock().unwrap();
                log.push(req.clone());
                log.len() - 1
            };
            let (status, text) = handler(&req, n);
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{text}",
                text.len()
            );
            let _ = stream.write_all(reply.as_bytes());
            let _ = stream.flush();
        }
    });
    Mock { base_url, seen }
}

fn completion(content: &str) -> (u16, String) {
    let body = json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "mock",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]});
    (200, body.to_string())
}

/// The canned answer for the stage and episode a prompt is for.
fn stage_answer(req: &Seen) -> String {
    let p = req.prompt();
    // The episode, by the prompt's task line (the stage-3 example mentions a latte too).
    let latte = p.contains("Task: \"Order a large oat latte");
    if p.contains("\"ambiguous_task\"") {
        if latte {
            // Prose and a code fence around the JSON, as chat models like to answer.
            "Here is the rewrite you asked for:\n```json\n{\"ambiguous_task\": \"Order a large latte for pickup\", \
             \"question\": \"Which milk would you like in your latte?\", \
             \"answer\": \"Oat milk, please.\"}\n```\nHope it helps!"
                .into()
        } else {
            json!({"ambiguous_task": "Send Ana a message", "question": "What should the message say?",
                   "answer": "That I'm running late."})
            .to_string()
        }
    } else if p.contains("{\"informative\"") {
        // Step 3 of the latte episode is `done`: the pipeline must not take it.
        if latte { "{\"informative\": [1, 2, 3]}" } else { "{\"informative\": [2]}" }.into()
    } else if p.contains("\"instructions\"") {
        // An instruction for every step: only the missing ones may be used.
        json!({"instructions": {"0": "Open the coffee app", "1": "Tap Oat milk", "2": "WRONG", "3": "WRONG"}})
            .to_string()
    } else {
        "unexpected prompt".into()
    }
}

fn normal(req: &Seen, _: usize) -> (u16, String) {
    completion(&stage_answer(req))
}

fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("askgui-ambiguate-{name}-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn step(shot: &str, action: Action, instruction: Option<&str>) -> Step {
    Step {
        screenshot: shot.into(),
        elements: None,
        instruction: instruction.map(String::from),
        informative: None,
        action,
        ask: None,
    }
}

/// Two episodes (40x80 PNG screenshots) in `dir/data/episodes.jsonl`: the latte one lacks two step
/// instructions, the message one has all of them.
fn write_input(dir: &Path) -> Result<PathBuf> {
    let data = dir.join("data");
    fs::create_dir_all(data.join("images"))?;
    for i in 0..4 {
        image::RgbImage::from_pixel(40, 80, image::Rgb([i * 60, 100, 200]))
            .save(data.join(format!("images/{i}.png")))?;
    }
    let screen = Screen { width: 40, height: 80 };
    let latte = Episode {
        id: "latte".into(),
        platform: Platform::Android,
        screen,
        task: "Order a large oat latte for pickup".into(),
        ambiguous_task: None,
        steps: vec![
            step("images/0.png", Action::Click(Target::point(10, 10)), None),
            step("images/1.png", Action::Click(Target::point(20, 30)), None),
            step("images/2.png", Action::Click(Target::point(20, 50)), Some("Tap Large")),
            step("images/3.png", Action::Done { status: DoneStatus::Success }, Some("Finish")),
        ],
    };
    let message = Episode {
        id: "message".into(),
        platform: Platform::Android,
        screen,
        task: "Send Ana a message saying that I'm running late".into(),
        ambiguous_task: None,
        steps: vec![
            step("images/0.png", Action::Click(Target::point(5, 5)), Some("Open the chat with Ana")),
            step("images/1.png", Action::Click(Target::point(5, 70)), Some("Tap the message box")),
            step("images/2.png", Action::Type { text: "I'm running late".into() }, Some("Type the message")),
            step("images/3.png", Action::Click(Target::point(35, 70)), Some("Tap send")),
        ],
    };
    let path = data.join("episodes.jsonl");
    write_episodes(&path, [&latte, &message])?;
    Ok(path)
}

fn args(input: &Path, out: &Path, base_url: &str, key_env: &str) -> AmbiguateArgs {
    AmbiguateArgs {
        input: input.into(),
        out: out.into(),
        base_url: base_url.into(),
        model: "mock-model".into(),
        api_key_env: key_env.into(),
        retries: 2,
        timeout_s: 5.0,
        seed: 0,
        limit: None,
        backoff_ms: 1,
    }
}

fn assert_valid(path: &Path) -> Result<Vec<Episode>> {
    let report = validate_file(path, true)?;
    let problems: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(load_episodes(path)?.into_iter().map(|l| l.episode).collect())
}

#[test]
fn two_episodes_become_ambiguous_and_runs_resume() -> Result<()> {
    let dir = temp_dir("main");
    let input = write_input(&dir)?;
    let out = dir.join("out/ambiguous.jsonl");
    let server = mock(Box::new(normal));
    std::env::set_var("ASKGUI_TEST_KEY_MAIN", "sekret");
    let a = args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_MAIN");
    let report = ambiguate(&a)?;
    assert_eq!((report.done, report.skipped_existing, report.no_informative_step), (2, 0, 0));
    // latte: instructions, informative, ask; message: informative, ask (its instructions are complete).
    let reqs = server.requests();
    assert_eq!(reqs.len(), 5);
    assert!(reqs.iter().all(|r| r.auth.as_deref() == Some("Bearer sekret")), "{:?}", reqs[0].auth);
    assert!(reqs.iter().all(|r| r.body["model"] == "mock-model" && r.body["temperature"] == 0));
    assert_eq!(reqs.iter().filter(|r| r.prompt().contains("\"instructions\"")).count(), 1);

    let eps = assert_valid(&out)?;
    assert_eq!(eps.len(), 2);
    for ep in &eps {
        assert!(ep.is_ambiguous(), "{}", ep.id);
        let asks: Vec<usize> = (0..ep.steps.len()).filter(|&i| ep.steps[i].ask.is_some()).collect();
        assert_eq!(asks.len(), 1, "{}", ep.id);
        assert_eq!(ep.steps[asks[0]].informative, Some(true));
        assert!(ep.steps.iter().all(|s| s.screenshot.starts_with("../data/images/")), "re-rooted to the output folder");
    }
    let latte = &eps[0];
    assert_eq!(latte.ambiguous_task.as_deref(), Some("Order a large latte for pickup"));
    let flags: Vec<Option<bool>> = latte.steps.iter().map(|s| s.informative).collect();
    assert_eq!(flags, [Some(false), Some(true), Some(true), Some(false)], "`done` is never informative");
    let instr: Vec<&str> = latte.steps.iter().map(|s| s.instruction.as_deref().unwrap_or("")).collect();
    assert_eq!(instr, ["Open the coffee app", "Tap Oat milk", "Tap Large", "Finish"], "known instructions are kept");
    let ask_step = latte.first_ask_step().unwrap();
    assert!([1, 2].contains(&ask_step));
    let ask = latte.steps[ask_step].ask.as_ref().unwrap();
    assert_eq!(
        (ask.question.as_str(), ask.answer.as_str()),
        ("Which milk would you like in your latte?", "Oat milk, please.")
    );
    let message = &eps[1];
    assert_eq!(message.first_ask_step(), Some(2));
    assert_eq!(message.steps[2].ask.as_ref().unwrap().answer, "That I'm running late.");

    // Again: everything is there, nothing is asked.
    let again = ambiguate(&a)?;
    assert_eq!((again.done, again.skipped_existing), (0, 2));
    assert_eq!(server.count(), 5, "no new requests");
    assert_eq!(fs::read_to_string(&out)?.lines().count(), 2);

    // The same seed picks the same step in a fresh output.
    let out2 = dir.join("out/again.jsonl");
    ambiguate(&args(&input, &out2, &server.base_url, "ASKGUI_TEST_KEY_MAIN"))?;
    assert_eq!(load_episodes(&out2)?[0].episode.first_ask_step(), Some(ask_step));
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn an_interrupted_run_continues_where_it_stopped() -> Result<()> {
    let dir = temp_dir("resume");
    let input = write_input(&dir)?;
    let out = dir.join("data/ambiguous.jsonl");
    let server = mock(Box::new(normal));
    let mut a = args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_UNSET_RESUME");
    a.limit = Some(1);
    let first = ambiguate(&a)?;
    assert_eq!((first.done, first.skipped_existing), (1, 0));
    assert_eq!(server.count(), 3);
    assert!(server.requests().iter().all(|r| r.auth.is_none()), "no key, no Authorization header");
    a.limit = None;
    let second = ambiguate(&a)?;
    assert_eq!((second.done, second.skipped_existing), (1, 1));
    assert_eq!(server.count(), 5, "only the second episode was asked about");
    let eps = assert_valid(&out)?;
    assert_eq!(eps.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["latte", "message"]);
    assert!(eps.iter().all(|e| e.steps[0].screenshot == "images/0.png"), "same folder: paths unchanged");

    // Killed while writing the second line: the partial line is dropped and the episode redone.
    let text = fs::read_to_string(&out)?;
    fs::write(&out, &text[..text.len() - 40])?;
    let third = ambiguate(&a)?;
    assert_eq!((third.done, third.skipped_existing), (1, 1));
    assert_eq!(assert_valid(&out)?.len(), 2);
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn garbage_answers_are_counted_and_the_episodes_written_unchanged() -> Result<()> {
    let dir = temp_dir("garbage");
    let input = write_input(&dir)?;
    let out = dir.join("out.jsonl");
    let server = mock(Box::new(|_, _| completion("I'm sorry, I cannot produce JSON today.")));
    let report = ambiguate(&args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_UNSET_GARBAGE"))?;
    // latte fails at stage 1 (two steps lack an instruction), message at stage 2 (it has them all).
    let want: BTreeMap<String, usize> =
        [("informative: no JSON object".to_string(), 1), ("instructions: no JSON object".to_string(), 1)].into();
    assert_eq!(report.rejected, want);
    assert_eq!((report.done, report.no_informative_step, report.rejected_total()), (2, 0, 2));
    let reqs = server.requests();
    assert_eq!(reqs.len(), 6, "per episode, the first attempt and 2 retries");
    // A retry shows the model its answer and why it was refused.
    let retry = reqs[1].body["messages"].as_array().unwrap();
    assert_eq!(retry.len(), 4);
    assert!(retry[3]["content"].as_str().unwrap().contains("cannot be used: no JSON object"));
    // Written as they came in (screenshots re-rooted to the output's folder): no flags, no ask.
    let before: Vec<Episode> = load_episodes(&input)?.into_iter().map(|l| l.episode).collect();
    let after = assert_valid(&out)?;
    assert_eq!(after.len(), 2);
    for (a, b) in after.iter().zip(&before) {
        assert!(!a.is_ambiguous() && a.steps.iter().all(|s| s.informative.is_none() && s.ask.is_none()));
        assert_eq!((&a.id, &a.task, a.steps.len()), (&b.id, &b.task, b.steps.len()));
        let instr = |e: &Episode| e.steps.iter().map(|s| s.instruction.clone()).collect::<Vec<_>>();
        assert_eq!(instr(a), instr(b));
        assert!(a.steps.iter().all(|s| s.screenshot.starts_with("data/images/")), "{}", a.steps[0].screenshot);
    }
    // Done is done: a second run asks nothing.
    assert_eq!(ambiguate(&args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_UNSET_GARBAGE"))?.skipped_existing, 2);
    assert_eq!(server.count(), 6);
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn a_rejected_rewrite_leaves_the_other_episodes_ambiguous() -> Result<()> {
    let dir = temp_dir("mixed");
    let input = write_input(&dir)?;
    let out = dir.join("data/out.jsonl");
    // The latte's stage-3 answer keeps the task as it is, every time.
    let server = mock(Box::new(|req, n| {
        let p = req.prompt();
        if p.contains("Task: \"Order a large oat latte") && p.contains("\"ambiguous_task\"") {
            completion(r#"{"ambiguous_task": "Order a large oat latte for pickup", "question": "Q?", "answer": "A"}"#)
        } else {
            normal(req, n)
        }
    }));
    let report = ambiguate(&args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_UNSET_MIXED"))?;
    assert_eq!(report.rejected, BTreeMap::from([("ask: task unchanged".to_string(), 1)]));
    assert_eq!((report.done, report.no_informative_step), (2, 0));
    assert_eq!(server.count(), 2 + 3 + 2, "latte: instructions, informative, 3 asks; message: informative, ask");
    let eps = assert_valid(&out)?;
    let latte = &eps[0];
    assert!(!latte.is_ambiguous() && latte.steps.iter().all(|s| s.informative.is_none()), "written unchanged");
    assert_eq!(latte.steps[0].instruction, None, "not even stage 1's instructions are kept");
    assert_eq!(eps[1].first_ask_step(), Some(2), "the message episode is ambiguous");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn an_answer_that_is_no_chat_completion_stops_the_run() -> Result<()> {
    let dir = temp_dir("not-chat");
    let input = write_input(&dir)?;
    let out = dir.join("out.jsonl");
    let server = mock(Box::new(|_, _| (200, "<html>a login page</html>".into())));
    let e = ambiguate(&args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_UNSET_NOT_CHAT")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, AmbiguateError::NotChatCompletion { attempts: 3, .. }), "{msg}");
    assert!(msg.contains("episode latte") && msg.contains("a login page") && msg.contains("--base-url"), "{msg}");
    assert_eq!(fs::read_to_string(&out)?, "", "nothing written");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn server_errors_are_retried_and_401_is_not() -> Result<()> {
    let dir = temp_dir("http");
    let input = write_input(&dir)?;
    let flaky =
        mock(Box::new(|req, n| if n == 0 { (500, "{\"error\": \"overloaded\"}".into()) } else { normal(req, n) }));
    let report = ambiguate(&args(&input, &dir.join("a.jsonl"), &flaky.base_url, "ASKGUI_TEST_KEY_UNSET_HTTP"))?;
    assert_eq!(report.done, 2);
    assert_eq!(flaky.count(), 6, "5 requests and the one that failed");
    assert_valid(&dir.join("a.jsonl"))?;

    let denied = mock(Box::new(|_, _| (401, "{\"error\": {\"message\": \"invalid api key\"}}".into())));
    let e = ambiguate(&args(&input, &dir.join("b.jsonl"), &denied.base_url, "ASKGUI_TEST_KEY_UNSET_HTTP")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, AmbiguateError::Rejected { status: 401, .. }), "{msg}");
    assert!(msg.contains("401") && msg.contains("invalid api key") && msg.contains("episode latte"), "{msg}");
    assert_eq!(denied.count(), 1, "a 401 is not retried");

    // A server that never answers in time: retried, then reported.
    let slow = mock(Box::new(|req, n| {
        std::thread::sleep(Duration::from_millis(600));
        normal(req, n)
    }));
    let mut a = args(&input, &dir.join("c.jsonl"), &slow.base_url, "ASKGUI_TEST_KEY_UNSET_HTTP");
    (a.timeout_s, a.retries) = (0.2, 1);
    let e = ambiguate(&a).unwrap_err();
    assert!(matches!(e, AmbiguateError::Unreachable { attempts: 2, .. }), "{e}");
    fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn episodes_without_an_informative_step_are_kept_and_counted() -> Result<()> {
    let dir = temp_dir("none");
    let input = write_input(&dir)?;
    let out = dir.join("data/out.jsonl");
    let server = mock(Box::new(|req, n| {
        if req.prompt().contains("{\"informative\"") {
            completion("{\"informative\": []}")
        } else {
            normal(req, n)
        }
    }));
    let report = ambiguate(&args(&input, &out, &server.base_url, "ASKGUI_TEST_KEY_UNSET_NONE"))?;
    assert_eq!((report.done, report.no_informative_step), (2, 2));
    assert_eq!(server.count(), 3, "no stage-3 request");
    for ep in assert_valid(&out)? {
        assert!(ep.ambiguous_task.is_none() && ep.first_ask_step().is_none(), "{}", ep.id);
        assert!(ep.steps.iter().all(|s| s.informative == Some(false) && s.instruction.is_some()));
    }
    fs::remove_dir_all(&dir)?;
    Ok(())
}
