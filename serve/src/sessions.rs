//! Server-side ASK/SAY sessions: the server keeps the task and the dialogue so a front end only sends the
//! current screen, and the user's answer when the agent asked.
//!
//! - Ids are 128 random bits from the OS-seeded CSPRNG (`rand::rng()`), as hex: knowing one session id
//!   tells nothing about another.
//! - A session expires after `ttl` idle seconds (a step or say renews it). Expired sessions are swept on
//!   every access to the store and periodically by the server, and answer 404 like unknown ids.
//! - At most `max` live sessions; creating one more fails (429) until some expire or are deleted.
//! - Steps on one session are serialised by refusal: while a step is running, another step or a say on
//!   the same session answers 409. Two concurrent steps would both be predicted from the same history and
//!   the second answer would be stale, so the client is told rather than queued.
//! - Memory: a session can go on to a next task (`POST /v1/sessions/{id}/tasks`). The finished task's
//!   answered questions (each ask with its answer; an unanswered one is dropped) and what the user asked
//!   the agent to remember stay as the session's memory: turns that open every later step's history, so
//!   the model reads them where it was trained to read the dialogue. Remembered statements come first,
//!   each a SAY of its own, so that none reads as the answer to a question. Beyond [`MEMORY_TURNS`] turns
//!   or [`MEMORY_CHARS`] characters (the context budget) the oldest pairs go first, then the oldest
//!   statements.
//! - Screenshots: a session keeps the screenshots of its earlier steps that a prompt shows (the model's
//!   `--history-images`), as training shows them: a step's screenshot joins them when the agent acted on
//!   it, not when it asked (the answer comes back to the same screen); a next task starts without them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use askgui_data::agent_api::StepOptions;
use askgui_data::{Action, Turn};

use crate::backend::ImageInput;
use rand::Rng;
use serde::Serialize;

/// The most memory turns a session keeps.
pub const MEMORY_TURNS: usize = 24;
/// The most characters of memory text a session keeps.
pub const MEMORY_CHARS: usize = 2000;

/// One session's state.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    pub task: String,
    pub adapter: Option<String>,
    pub options: StepOptions,
    /// What earlier tasks and the user's statements left.
    pub memory: Memory,
    pub history: Vec<Turn>,
    /// The screenshots of the earlier steps a prompt shows, oldest first.
    pub screenshots: Vec<ImageInput>,
    /// Unix seconds.
    pub created: u64,
    last_used: Instant,
    busy: bool,
}

/// A session's memory: what the user asked to be remembered and the answered questions of earlier tasks,
/// each oldest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Memory {
    remembered: Vec<String>,
    /// Each question with the user's answer.
    answered: Vec<(Action, String)>,
}

impl Memory {
    /// The memory as the model reads it: the remembered statements, each a SAY on its own, then each
    /// answered question as its ASK and SAY.
    pub fn turns(&self) -> Vec<Turn> {
        let said = self.remembered.iter().map(|text| Turn::Say { text: text.clone() });
        let pairs = self
            .answered
            .iter()
            .flat_map(|(ask, text)| [Turn::Agent { action: ask.clone() }, Turn::Say { text: text.clone() }]);
        said.chain(pairs).collect()
    }

    /// Adds `remember` and the answered questions of a finished task's `history`, then keeps to the budget.
    fn add(&mut self, history: &[Turn], remember: Vec<String>) {
        self.remembered.extend(remember);
        for pair in history.windows(2) {
            if let [Turn::Agent { action: ask @ Action::Ask(_) }, Turn::Say { text }] = pair {
                self.answered.push((ask.clone(), text.clone()));
            }
        }
        self.bound();
    }

    /// Drops the oldest pairs, then the oldest statements, beyond [`MEMORY_TURNS`] or [`MEMORY_CHARS`].
    fn bound(&mut self) {
        let chars = |m: &Self| {
            let said: usize = m.remembered.iter().map(String::len).sum();
            let pairs: usize = m.answered.iter().map(|(a, t)| t.len() + ask_len(a)).sum();
            said + pairs
        };
        while self.remembered.len() + 2 * self.answered.len() > MEMORY_TURNS || chars(self) > MEMORY_CHARS {
            if self.answered.is_empty() {
                self.remembered.remove(0);
            } else {
                self.answered.remove(0);
            }
        }
    }
}

fn ask_len(a: &Action) -> usize {
    match a {
        Action::Ask(a) => a.question.len(),
        _ => 0,
    }
}

impl Session {
    /// What the model is shown before this task's turns: the memory, then the history.
    pub fn context(&self) -> Vec<Turn> {
        self.memory.turns().into_iter().chain(self.history.iter().cloned()).collect()
    }

    /// The agent's last turn was an `ask` not yet answered.
    pub fn waiting_for_answer(&self) -> bool {
        matches!(self.history.last(), Some(Turn::Agent { action: Action::Ask(_) }))
    }
}

/// `GET /v1/sessions/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct SessionView {
    pub id: String,
    pub task: String,
    pub adapter: Option<String>,
    /// Kept from earlier tasks (and stated to be remembered); opens every step's history.
    pub memory: Vec<Turn>,
    pub history: Vec<Turn>,
    pub waiting_for_answer: bool,
    /// Unix seconds.
    pub created: u64,
    /// Seconds until the session expires if left idle.
    pub expires_in: u64,
}

/// Why a session operation failed (mapped to 404 / 409 / 429 by the handlers).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    #[error("no session `{0}` (unknown, deleted, or expired after being idle too long)")]
    NotFound(String),
    #[error("session `{0}` has a step in progress; wait for its answer")]
    Busy(String),
    #[error("session `{0}` is not waiting for an answer: its last action was not an ask")]
    NotWaiting(String),
    #[error("{0} sessions are live, the most this server keeps (--max-sessions); delete finished ones")]
    Full(usize),
}

/// The live sessions.
pub struct SessionStore {
    map: Mutex<HashMap<String, Session>>,
    ttl: Duration,
    max: usize,
}

/// Marks a session busy while a step runs; clears the mark when dropped (also when the client leaves).
pub struct StepLease<'a> {
    store: &'a SessionStore,
    id: String,
}

impl Drop for StepLease<'_> {
    fn drop(&mut self) {
        let mut map = self.store.lock();
        if let Some(s) = map.get_mut(&self.id) {
            s.busy = false;
            s.last_used = Instant::now();
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl SessionStore {
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self { map: Mutex::default(), ttl, max }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sweep_locked(&self, map: &mut HashMap<String, Session>) {
        let ttl = self.ttl;
        map.retain(|_, s| s.busy || s.last_used.elapsed() <= ttl);
    }

    /// Drops expired sessions; returns how many are left.
    pub fn sweep(&self) -> usize {
        let mut map = self.lock();
        self.sweep_locked(&mut map);
        map.len()
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expires_in(&self, s: &Session) -> u64 {
        self.ttl.saturating_sub(s.last_used.elapsed()).as_secs()
    }

    /// A new session remembering `remember` (the user's statements); its id.
    pub fn create(
        &self,
        task: String,
        adapter: Option<String>,
        options: StepOptions,
        remember: Vec<String>,
    ) -> Result<String, SessionError> {
        let mut map = self.lock();
        self.sweep_locked(&mut map);
        if map.len() >= self.max {
            return Err(SessionError::Full(map.len()));
        }
        let id = format!("{:032x}", rand::rng().random::<u128>());
        let session = Session {
            id: id.clone(),
            task,
            adapter,
            options,
            memory: {
                let mut m = Memory::default();
                m.add(&[], remember);
                m
            },
            history: Vec::new(),
            screenshots: Vec::new(),
            created: unix_now(),
            last_used: Instant::now(),
            busy: false,
        };
        map.insert(id.clone(), session);
        Ok(id)
    }

    /// What a client sees of a session.
    pub fn view(&self, id: &str) -> Result<SessionView, SessionError> {
        let mut map = self.lock();
        self.sweep_locked(&mut map);
        let s = map.get(id).ok_or_else(|| SessionError::NotFound(id.to_string()))?;
        Ok(SessionView {
            id: s.id.clone(),
            task: s.task.clone(),
            adapter: s.adapter.clone(),
            memory: s.memory.turns(),
            history: s.history.clone(),
            waiting_for_answer: s.waiting_for_answer(),
            created: s.created,
            expires_in: self.expires_in(s),
        })
    }

    pub fn delete(&self, id: &str) -> Result<(), SessionError> {
        let mut map = self.lock();
        self.sweep_locked(&mut map);
        map.remove(id).map(|_| ()).ok_or_else(|| SessionError::NotFound(id.to_string()))
    }

    /// Starts a step: marks the session busy and returns a copy of it to build the request from.
    pub fn begin_step(&self, id: &str) -> Result<(Session, StepLease<'_>), SessionError> {
        let mut map = self.lock();
        self.sweep_locked(&mut map);
        let s = map.get_mut(id).ok_or_else(|| SessionError::NotFound(id.to_string()))?;
        if s.busy {
            return Err(SessionError::Busy(id.to_string()));
        }
        s.busy = true;
        s.last_used = Instant::now();
        Ok((s.clone(), StepLease { store: self, id: id.to_string() }))
    }

    /// Ends a step with the agent's action appended (a session deleted meanwhile is left deleted). The
    /// step's `screenshot` joins the `keep` most recent earlier ones unless the action is an `ask`.
    pub fn finish_step(&self, lease: StepLease<'_>, action: Action, screenshot: Option<ImageInput>, keep: usize) {
        if let Some(s) = self.lock().get_mut(&lease.id) {
            if let (Some(shot), false) = (screenshot, matches!(action, Action::Ask(_))) {
                s.screenshots.push(shot);
            }
            let extra = s.screenshots.len().saturating_sub(keep);
            s.screenshots.drain(..extra);
            s.history.push(Turn::Agent { action });
        }
        drop(lease);
    }

    /// Appends the user's answer to the agent's pending `ask`.
    pub fn say(&self, id: &str, text: String) -> Result<SessionView, SessionError> {
        {
            let mut map = self.lock();
            self.sweep_locked(&mut map);
            let s = map.get_mut(id).ok_or_else(|| SessionError::NotFound(id.to_string()))?;
            if s.busy {
                return Err(SessionError::Busy(id.to_string()));
            }
            if !s.waiting_for_answer() {
                return Err(SessionError::NotWaiting(id.to_string()));
            }
            s.history.push(Turn::Say { text });
            s.last_used = Instant::now();
        }
        self.view(id)
    }

    /// Goes on to `task`: the finished task's answered questions and `remember` join the memory (an ask
    /// left unanswered does not), and the history starts empty.
    pub fn next_task(&self, id: &str, task: String, remember: Vec<String>) -> Result<SessionView, SessionError> {
        {
            let mut map = self.lock();
            self.sweep_locked(&mut map);
            let s = map.get_mut(id).ok_or_else(|| SessionError::NotFound(id.to_string()))?;
            if s.busy {
                return Err(SessionError::Busy(id.to_string()));
            }
            let history = std::mem::take(&mut s.history);
            s.screenshots.clear();
            s.memory.add(&history, remember);
            s.task = task;
            s.last_used = Instant::now();
        }
        self.view(id)
    }

    /// Live sessions (after a sweep).
    pub fn len(&self) -> usize {
        self.sweep()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use askgui_data::{Ask, Target};

    fn ask() -> Action {
        Action::Ask(Ask { question: "Which?".into(), options: vec![], kind: None })
    }

    #[test]
    fn ask_say_step_and_busy() {
        let store = SessionStore::new(Duration::from_secs(60), 2);
        let id = store.create("t".into(), None, StepOptions::default(), vec![]).unwrap();
        assert_eq!(id.len(), 32);
        assert_ne!(id, store.create("t".into(), None, StepOptions::default(), vec![]).unwrap());
        assert_eq!(store.create("t".into(), None, StepOptions::default(), vec![]), Err(SessionError::Full(2)));
        assert_eq!(store.say(&id, "x".into()).unwrap_err(), SessionError::NotWaiting(id.clone()));

        let (_, lease) = store.begin_step(&id).unwrap();
        assert!(matches!(store.begin_step(&id), Err(SessionError::Busy(_))));
        store.finish_step(lease, ask(), None, 0);
        assert!(store.view(&id).unwrap().waiting_for_answer);
        let v = store.say(&id, "Lime".into()).unwrap();
        assert!(!v.waiting_for_answer && v.history.len() == 2);

        // A lease dropped without an action (the client left) frees the session unchanged.
        drop(store.begin_step(&id).unwrap());
        let (s, lease) = store.begin_step(&id).unwrap();
        assert_eq!(s.history.len(), 2);
        store.finish_step(lease, Action::Click(Target::point(1, 2)), None, 0);
        assert_eq!(store.view(&id).unwrap().history.len(), 3);
        store.delete(&id).unwrap();
        assert!(matches!(store.view(&id), Err(SessionError::NotFound(_))));
        assert!(matches!(store.delete(&id), Err(SessionError::NotFound(_))));
    }

    fn shot(hash: u64) -> ImageInput {
        ImageInput { image: std::sync::Arc::new(image::RgbImage::new(2, 2)), hash }
    }

    /// A session keeps what a training sample shows: the screenshots of the steps the agent acted on (an
    /// ask's step comes back after the answer, on the same screen), the last `keep` of them, none after
    /// the task changes.
    #[test]
    fn earlier_screenshots_are_those_training_shows() {
        let store = SessionStore::new(Duration::from_secs(60), 4);
        let id = store.create("Buy milk".into(), None, StepOptions::default(), vec![]).unwrap();
        let kept = |store: &SessionStore| -> Vec<u64> {
            let (s, lease) = store.begin_step(&id).unwrap();
            store.finish_step(lease, ask(), None, 2);
            s.screenshots.iter().map(|i| i.hash).collect()
        };
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, Action::Click(Target::point(1, 2)), Some(shot(1)), 2);
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, ask(), Some(shot(2)), 2);
        store.say(&id, "Oat".into()).unwrap();
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, Action::Click(Target::point(1, 2)), Some(shot(2)), 2);
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, Action::Click(Target::point(1, 2)), Some(shot(3)), 2);
        assert_eq!(kept(&store), [2, 3], "the last two acted-on screens, the asked one once");
        store.say(&id, "x".into()).unwrap();
        store.next_task(&id, "Call mum".into(), vec![]).unwrap();
        assert_eq!(kept(&store), Vec::<u64>::new(), "a next task starts without screenshots");
    }

    fn say(t: &str) -> Turn {
        Turn::Say { text: t.into() }
    }

    #[test]
    fn the_next_task_keeps_the_answered_questions_and_what_to_remember() {
        let store = SessionStore::new(Duration::from_secs(60), 2);
        let id = store.create("t1".into(), None, StepOptions::default(), vec!["I am vegan".into()]).unwrap();
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, ask(), None, 0);
        store.say(&id, "Oat milk".into()).unwrap();
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, Action::Click(Target::point(1, 2)), None, 0);
        let v = store.next_task(&id, "t2".into(), vec!["Deliver after 6".into()]).unwrap();
        // The statements first, each on its own; then the question with its answer.
        assert_eq!(
            v.memory,
            [say("I am vegan"), say("Deliver after 6"), Turn::Agent { action: ask() }, say("Oat milk")]
        );
        assert!(v.history.is_empty() && v.task == "t2");
        let (s, _lease) = store.begin_step(&id).unwrap();
        assert_eq!(s.context(), v.memory, "the next step's history opens with the memory");
    }

    #[test]
    fn an_unanswered_ask_does_not_enter_memory_and_a_statement_never_follows_an_ask() {
        let store = SessionStore::new(Duration::from_secs(60), 2);
        let id = store.create("t1".into(), None, StepOptions::default(), vec![]).unwrap();
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, ask(), None, 0);
        // The user goes on without answering, and states a fact.
        let v = store.next_task(&id, "t2".into(), vec!["I live in Lyon".into()]).unwrap();
        assert_eq!(v.memory, [say("I live in Lyon")], "the unanswered `Which?` is gone");
        // Answered in task 2, then a statement with task 3: the statement still comes before every ask.
        let (_, lease) = store.begin_step(&id).unwrap();
        store.finish_step(lease, ask(), None, 0);
        store.say(&id, "The red one".into()).unwrap();
        let v = store.next_task(&id, "t3".into(), vec!["Pay by card".into()]).unwrap();
        let want = [say("I live in Lyon"), say("Pay by card"), Turn::Agent { action: ask() }, say("The red one")];
        assert_eq!(v.memory, want);
        for (i, t) in v.memory.iter().enumerate() {
            if let Turn::Agent { action } = t {
                assert_eq!(v.memory[i + 1], say("The red one"), "an ask is followed by its own answer only");
                assert!(action.is_ask());
            }
        }
    }

    #[test]
    fn beyond_the_budget_the_oldest_pairs_go_first_then_the_oldest_statements() {
        let mut m = Memory::default();
        m.add(&[], vec!["fact".into()]);
        // MEMORY_TURNS / 2 + 1 answered questions: one pair over the budget with the statement.
        let history: Vec<Turn> =
            (0..MEMORY_TURNS / 2).flat_map(|i| [Turn::Agent { action: ask() }, say(&format!("answer {i}"))]).collect();
        m.add(&history, vec![]);
        let turns = m.turns();
        // 1 statement + 12 pairs = 25 turns > 24: the oldest pair (answer 0) went, the statement stayed.
        assert_eq!(turns.len(), 1 + 2 * (MEMORY_TURNS / 2 - 1));
        assert_eq!((&turns[0], &turns[2]), (&say("fact"), &say("answer 1")));
        // Statements alone: the oldest go.
        let mut m = Memory::default();
        m.add(&[], (0..MEMORY_TURNS + 5).map(|i| format!("fact {i}")).collect());
        assert_eq!((m.turns().len(), &m.turns()[0]), (MEMORY_TURNS, &say("fact 5")));
        let mut m = Memory::default();
        m.add(&[], vec!["x".repeat(MEMORY_CHARS + 1), "y".into()]);
        assert_eq!(m.turns(), [say("y")]);
    }

    #[test]
    fn idle_sessions_expire() {
        let store = SessionStore::new(Duration::from_millis(30), 10);
        let id = store.create("t".into(), None, StepOptions::default(), vec![]).unwrap();
        assert_eq!(store.len(), 1);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(store.len(), 0);
        assert!(matches!(store.begin_step(&id), Err(SessionError::NotFound(_))));
    }
}
