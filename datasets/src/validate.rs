//! `askgui-data validate`: every problem of an episode file, each with its line number.
//!
//! Checks: JSON and schema (unknown actions, missing fields), duplicate ids, screen size, images that are
//! missing, unreadable or of another size than `screen`, points outside the screen, element references
//! that are not in the step's element list, an `ask` on a step that is not informative, an `ask` in an
//! episode without an ambiguous task, and an ambiguous task without any `ask` step; with an action
//! language, every action and question that language cannot say.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use crate::episode::{read_episodes, resolve, Episode, EpisodeError};
use crate::language::ActionLanguage;

#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub line: usize,
    pub episode: Option<String>,
    pub step: Option<usize>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}", self.line)?;
        if let Some(id) = &self.episode {
            write!(f, ", episode {id}")?;
        }
        if let Some(s) = self.step {
            write!(f, ", step {s}")?;
        }
        write!(f, ": {}", self.message)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub episodes: usize,
    pub steps: usize,
    pub problems: Vec<Problem>,
}

/// Validates a JSONL episode file; images are looked up relative to its folder.
pub fn validate_file(path: &Path, check_images: bool) -> Result<Report, EpisodeError> {
    validate_file_in(path, check_images, None)
}

/// [`validate_file`], and with a `language`, also that the language can say every step's action and
/// question ([`check_language`]).
pub fn validate_file_in(
    path: &Path,
    check_images: bool,
    language: Option<ActionLanguage>,
) -> Result<Report, EpisodeError> {
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut report = Report::default();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (line, parsed) in read_episodes(path)? {
        let ep = match parsed {
            Ok(ep) => ep,
            Err(message) => {
                report.problems.push(Problem { line, episode: None, step: None, message });
                continue;
            }
        };
        report.episodes += 1;
        report.steps += ep.steps.len();
        if let Some(first) = seen.insert(ep.id.clone(), line) {
            report.problems.push(Problem {
                line,
                episode: Some(ep.id.clone()),
                step: None,
                message: format!("duplicate id (first on line {first})"),
            });
        }
        let mut push = |step: Option<usize>, message: String| {
            report.problems.push(Problem { line, episode: Some(ep.id.clone()), step, message })
        };
        check_episode(&ep, &base, check_images, &mut push);
        if let Some(language) = language {
            check_language(&ep, language, &mut push);
        }
    }
    Ok(report)
}

/// Whether `language` can say each step's action and question, as a prompt without the element list
/// writes them (an element id beside a point is left out there); `push(step, message)` receives each
/// action it cannot say, by name.
pub fn check_language(ep: &Episode, language: ActionLanguage, push: &mut impl FnMut(Option<usize>, String)) {
    for (i, s) in ep.steps.iter().enumerate() {
        let asked = s.ask.as_ref().map(|a| a.action());
        for action in asked.iter().chain([&s.action]) {
            if let Err(e) = language.check(&action.without_element()) {
                push(Some(i), e.to_string());
            }
        }
    }
}

/// The checks of one episode; `push(step, message)` receives each problem.
pub fn check_episode(ep: &Episode, base: &Path, check_images: bool, push: &mut impl FnMut(Option<usize>, String)) {
    let (w, h) = (ep.screen.width as i32, ep.screen.height as i32);
    if w <= 0 || h <= 0 {
        push(None, format!("screen is {w}x{h}: both sides must be positive"));
    }
    if ep.steps.is_empty() {
        push(None, "no steps".into());
    }
    if ep.task.trim().is_empty() {
        push(None, "empty `task`".into());
    }
    let ambiguous = ep.is_ambiguous();
    if ambiguous && ep.first_ask_step().is_none() {
        push(None, "ambiguous task without any `ask` step: which detail did it leave out?".into());
    }
    for (i, s) in ep.steps.iter().enumerate() {
        let step = Some(i);
        if check_images {
            let p = resolve(base, &s.screenshot);
            match image::image_dimensions(&p) {
                Err(e) if !p.exists() => push(step, format!("missing image {}: {e}", p.display())),
                Err(e) => push(step, format!("unreadable image {}: {e}", p.display())),
                Ok((iw, ih)) if (iw, ih) != (ep.screen.width, ep.screen.height) => push(
                    step,
                    format!(
                        "image {} is {iw}x{ih} but the episode's screen is {}x{}: coordinates would be in the wrong frame",
                        p.display(),
                        ep.screen.width,
                        ep.screen.height
                    ),
                ),
                Ok(_) => {}
            }
        }
        for (x, y) in s.action.points() {
            if x < 0 || y < 0 || x >= w || y >= h {
                push(step, format!("`{}` point ({x}, {y}) is outside the {w}x{h} screen", s.action.name()));
            }
        }
        if let Some(id) = s.action.target().and_then(|t| t.element.as_ref()) {
            match &s.elements {
                None => push(step, format!("action names element `{id}` but the step has no element list")),
                Some(els) => match els.iter().find(|e| &e.id == id) {
                    None => push(step, format!("action names element `{id}`, which is not in the step's element list")),
                    Some(e) => {
                        if let Some((x, y)) = s.action.target().and_then(|t| t.xy()) {
                            if !e.contains(x, y) {
                                push(step, format!("point ({x}, {y}) is outside its element `{id}` {:?}", e.bbox));
                            }
                        }
                    }
                },
            }
        }
        if let Some(els) = &s.elements {
            let mut ids = HashMap::new();
            for e in els {
                if ids.insert(e.id.as_str(), ()).is_some() {
                    push(step, format!("element id `{}` appears twice", e.id));
                }
                let [x1, y1, x2, y2] = e.bbox;
                if x1 >= x2 || y1 >= y2 {
                    push(step, format!("element `{}` has an empty box {:?}", e.id, e.bbox));
                }
            }
        }
        if let Some(ask) = &s.ask {
            if s.informative != Some(true) {
                push(step, "`ask` on a step that is not marked informative".into());
            }
            if !ambiguous {
                push(step, "`ask` in an episode without an ambiguous task: nothing is missing to ask about".into());
            }
            if ask.question.trim().is_empty() || ask.answer.trim().is_empty() {
                push(step, "`ask` needs a non-empty question and answer".into());
            }
        }
        if let Err(e) = s.action.check() {
            push(step, e);
        }
    }
}
