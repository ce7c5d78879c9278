//! A memoising agent: a step put to the agent a second time gets the first answer back without a model call.
//!
//! The evaluation modes put many identical steps to one agent: Original and Standard share every step of
//! an episode with no ambiguity, Dual's first stream is Standard, Strict walks the same gold history. An
//! agent that decodes greedily answers an identical input identically, so for it the memo changes no
//! result, only the time (the demo's evaluation runs ~half the model calls). The key is the whole
//! [`StepInput`] (task, history, screenshots, elements, screen), so nothing that could change the answer
//! is left out. Only for deterministic agents: a sampling agent would have its variance hidden.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::agent::{Agent, AgentError, Prediction, StepInput};
use crate::identity::AgentIdentity;

/// Wraps a deterministic agent; answers repeated inputs from memory.
pub struct MemoAgent<A> {
    inner: A,
    answers: Mutex<HashMap<String, Prediction>>,
    hits: AtomicUsize,
}

impl<A: Agent> MemoAgent<A> {
    pub fn new(inner: A) -> Self {
        Self { inner, answers: Mutex::new(HashMap::new()), hits: AtomicUsize::new(0) }
    }

    /// Predictions answered from memory so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::Relaxed)
    }

    /// Predictions the wrapped agent made so far.
    pub fn calls(&self) -> usize {
        self.answers.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn into_inner(self) -> A {
        self.inner
    }
}

impl<A: Agent> Agent for MemoAgent<A> {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn identity(&self) -> AgentIdentity {
        self.inner.identity()
    }

    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        let key = format!("{input:?}");
        if let Some(p) = self.answers.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(p.clone());
        }
        let p = self.inner.predict(input)?;
        self.answers.lock().unwrap_or_else(|p| p.into_inner()).insert(key, p.clone());
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use askgui_data::{Platform, Screen};

    /// Counts its calls and answers with the task, so a memo hit is visible.
    struct Counting(AtomicUsize);

    impl Agent for Counting {
        fn name(&self) -> String {
            "counting".into()
        }
        fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(Prediction { action: None, raw: input.task.clone(), parse_error: None, ask_probability: None })
        }
    }

    fn input(task: &str) -> StepInput {
        StepInput {
            episode_id: "e".into(),
            step: 0,
            task: task.into(),
            history: vec![],
            screenshots: vec!["a.png".into()],
            elements: None,
            screen: Screen { width: 10, height: 20 },
            platform: Platform::Android,
        }
    }

    #[test]
    fn repeated_inputs_are_answered_once_and_different_ones_are_not_confused() {
        let m = MemoAgent::new(Counting(AtomicUsize::new(0)));
        assert_eq!(m.predict(&input("a")).unwrap().raw, "a");
        assert_eq!(m.predict(&input("b")).unwrap().raw, "b");
        assert_eq!(m.predict(&input("a")).unwrap().raw, "a");
        assert_eq!((m.calls(), m.hits()), (2, 1));
        assert_eq!(m.into_inner().0.load(Ordering::Relaxed), 2);
    }
}
