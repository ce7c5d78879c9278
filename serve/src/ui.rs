//! The playground page at `/` (off with `--no-ui`): a person uploads, pastes or picks a screenshot, types
//! a task and sees the next action drawn on it; when the agent asks, the question comes with option buttons
//! and a free-text answer, and the answer leads to the next step.
//!
//! The page is one HTML file with inline CSS and JS (`ui/playground.html`), built into the binary with
//! `include_str!`: no build step, and nothing fetched from another host (its Content-Security-Policy
//! allows this server only). It talks to the session API like any other client. The synthetic screens
//! (`GET /ui/screens/{n}`) come from the synthetic world (`askgui_data::synth`) the demo models were
//! trained on: the screen of an episode where its task, with a detail left out, needs a question.

use std::sync::atomic::{AtomicU64, Ordering};

use actix_web::http::header;
use actix_web::{web, HttpResponse};
use askgui_data::convert::base64_encode;
use askgui_data::synth::make_episode;
use serde_json::{json, Value};

use crate::error::HttpError;

/// The page, as served.
pub const PAGE: &str = include_str!("ui/playground.html");

/// How many synthetic screens the page offers (`/ui/screens/0` and on).
pub const SCREENS: usize = 6;

/// Only this server: no other host can be reached from the page, whatever it is made to show.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   img-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'";

/// Paths that need no API key: the page and its screens carry no secrets (the page asks for the key).
pub fn is_open_path(path: &str) -> bool {
    path == "/" || path.starts_with("/ui/")
}

/// `GET /`.
pub async fn page() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header((header::CONTENT_SECURITY_POLICY, CSP))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(PAGE)
}

/// `GET /ui/screens/{n}`: `{n, image (a PNG data URL), elements, screen, task}`.
pub async fn screen(n: web::Path<String>) -> Result<HttpResponse, HttpError> {
    let index = n.parse::<usize>().ok().filter(|&i| i < SCREENS).ok_or_else(|| {
        let shown: String = n.chars().take(40).collect();
        HttpError::not_found(format!("no synthetic screen `{shown}`; there are 0 to {}", SCREENS - 1))
    })?;
    let shot = web::block(move || synthetic(index))
        .await
        .map_err(|_| HttpError::internal("the synthetic screen painter failed"))?
        .map_err(|e| HttpError::internal(format!("cannot paint synthetic screen {index}: {e}")))?;
    Ok(HttpResponse::Ok().json(shot))
}

/// Synthetic screen `index`: the step that needs a question of the synthetic world's episode `index`
/// (seed 0, 360x640, every task leaving out a detail), with the task as a user would give it.
pub fn synthetic(index: usize) -> Result<Value, String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // The painter writes PNG files: into a folder of this request's own, removed afterwards.
    let dir = std::env::temp_dir().join(format!(
        "askgui-serve-ui-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let episode = make_episode(0, index, (360, 640), 1.0, &dir).map_err(|e| e.to_string());
    let read = episode.and_then(|ep| {
        let i = ep.first_ask_step().unwrap_or(0);
        let png = std::fs::read(dir.join(&ep.id).join(format!("{i}.png"))).map_err(|e| e.to_string())?;
        Ok((ep, i, png))
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (ep, i, png) = read?;
    Ok(json!({
        "n": index,
        "image": format!("data:image/png;base64,{}", base64_encode(&png)),
        "elements": ep.steps[i].elements,
        "screen": ep.screen,
        "task": ep.ambiguous_task.unwrap_or(ep.task),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_screen_paints_and_is_offered_by_the_page() {
        for n in 0..SCREENS {
            let shot = synthetic(n).expect("a synthetic screen");
            assert!(shot["image"].as_str().unwrap().starts_with("data:image/png;base64,iVBOR"), "screen {n}");
            assert!(shot["elements"].as_array().is_some_and(|e| e.len() >= 3), "screen {n}: {}", shot["elements"]);
            assert!(!shot["task"].as_str().unwrap().is_empty(), "screen {n}");
            assert!(PAGE.contains(&format!("<option value=\"{n}\">")), "the page does not offer screen {n}");
        }
    }

    #[test]
    fn the_page_names_no_other_host() {
        for needle in ["http://", "https://", "//cdn", "src=\"//"] {
            assert!(!PAGE.contains(needle), "the page refers to another host: `{needle}`");
        }
    }
}
