//! Continuous batching: the meeting point of job threads and the thread that owns the model.
//!
//! Every job runs its decoding logic (prompt, constrained template, sampling, stop rules) as plain
//! sequential code on a thread of its own ([`askgui_runtime::Runtime`]), and asks for model work through a [`Client`]: "run these new
//! tokens on this KV cache and give me the logits of the last rows" ([`Item`]). The model's owner waits
//! until every job that is using the model has handed in its request (or finished), then runs all of them
//! as ONE packed forward ([`askgui_model::Qwen2Vl::decode_packed`]) and answers each. A job that arrives
//! meanwhile joins at the next forward, a job that ends leaves; nobody waits for a batch to drain.
//!
//! The counting that makes this safe: `live` jobs have been started and not finished; `engaged` ones
//! have asked for model work at least once and not finished. The owner runs a round when every engaged
//! job has a request in, so a job busy with its own CPU work between two forwards (sampling) is waited
//! for, while a job still decoding its screenshot is waited for only a moment (the round's wait), so that
//! jobs arriving together share their first forward. A [`Client`] leaves both counts when dropped,
//! panics included, so the owner can never wait for a job that is gone.

use std::cell::Cell;
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use askgui_runtime::{Forward, Item, ItemOut, RuntimeError};

pub type Reply = askgui_runtime::Result<Vec<ItemOut>>;

/// One job's request: its items run in the same forward (e.g. every action name scored at once), each
/// with the adapter it names.
pub struct Ticket {
    pub items: Vec<Item>,
    pub reply: mpsc::Sender<Reply>,
}

#[derive(Default)]
struct State {
    live: usize,
    engaged: usize,
    tickets: Vec<Ticket>,
}

/// What the model's owner should do next.
pub enum Round {
    /// Run these together.
    Run(Vec<Ticket>),
    /// Nothing to run yet (a job is still working); look for new jobs and ask again.
    Idle,
    /// No job is live.
    Done,
}

#[derive(Default)]
pub struct Batcher {
    state: Mutex<State>,
    changed: Condvar,
}

impl Batcher {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a job about to start. Call it BEFORE starting the job's thread (so the owner never sees
    /// zero live jobs while one is starting), then give the job a [`Client`], or call [`Self::not_started`].
    pub fn job_started(&self) {
        self.lock().live += 1;
    }

    /// Undoes [`Self::job_started`] for a job that never got its thread.
    pub fn not_started(&self) {
        self.lock().live -= 1;
        self.changed.notify_all();
    }

    pub fn live(&self) -> usize {
        self.lock().live
    }

    /// Waits (at most `wait`) until every live job has a request in, then runs what is in if every
    /// engaged job has one; see [`Round`]. Waiting that long for jobs still preparing their first request
    /// lets jobs that arrive together share their first forward, and so their vision forward. `held`
    /// requests are in the owner's hands already (prefills between their chunks): they count as in, and
    /// with some held a round runs even when no new request came.
    pub fn next_round(&self, wait: Duration, held: usize) -> Round {
        let mut st = self.lock();
        let all_in = |st: &State| st.tickets.len() + held >= st.live;
        let ready = |st: &State| st.tickets.len() + held > 0 && st.tickets.len() + held >= st.engaged;
        if !all_in(&st) {
            st = self
                .changed
                .wait_timeout_while(st, wait, |st| !all_in(st))
                .map(|r| r.0)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        if ready(&st) {
            Round::Run(std::mem::take(&mut st.tickets))
        } else if st.live == 0 {
            Round::Done
        } else {
            Round::Idle
        }
    }
}

/// A job's handle on the model: one per started job (see [`Batcher::job_started`]).
pub struct Client<'b> {
    batcher: &'b Batcher,
    pub adapter: Option<String>,
    engaged: Cell<bool>,
}

impl<'b> Client<'b> {
    pub fn new(batcher: &'b Batcher, adapter: Option<String>) -> Self {
        Self { batcher, adapter, engaged: Cell::new(false) }
    }
}

impl Forward for Client<'_> {
    /// Runs `items` in the next forward and waits for their answers, in order.
    fn run(&self, items: Vec<Item>) -> Reply {
        let (reply, answer) = mpsc::channel();
        {
            let mut st = self.batcher.lock();
            if !self.engaged.replace(true) {
                st.engaged += 1;
            }
            st.tickets.push(Ticket { items, reply });
        }
        self.batcher.changed.notify_all();
        answer.recv().unwrap_or_else(|_| Err(RuntimeError::Internal("the model thread dropped this request".into())))
    }

    fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }
}

impl Drop for Client<'_> {
    fn drop(&mut self) {
        {
            let mut st = self.batcher.lock();
            st.live -= 1;
            if self.engaged.get() {
                st.engaged -= 1;
            }
        }
        self.batcher.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use askgui_model::KvCache;

    use super::*;

    fn item() -> Item {
        Item {
            ids: vec![1],
            positions: vec![[0; 3]],
            images: vec![],
            cache: KvCache::default(),
            logits_rows: 1,
            forks: vec![],
            adapter: None,
        }
    }

    /// Two jobs: the owner runs one round with both requests, and finishes when both clients are gone.
    #[test]
    fn a_round_waits_for_every_engaged_job_and_ends_with_the_last() {
        let b = Batcher::default();
        std::thread::scope(|s| {
            for _ in 0..2 {
                b.job_started();
                s.spawn(|| {
                    let c = Client::new(&b, None);
                    let out = c.run(vec![item(), item()]).unwrap();
                    assert_eq!(out.len(), 2);
                });
            }
            let mut rounds = vec![];
            loop {
                match b.next_round(Duration::from_millis(5), 0) {
                    Round::Run(tickets) => {
                        rounds.push(tickets.len());
                        for t in tickets {
                            let outs = t.items.into_iter().map(|i| ItemOut { cache: i.cache, logits: vec![] });
                            t.reply.send(Ok(outs.collect())).unwrap();
                        }
                    }
                    Round::Idle => {}
                    Round::Done => break,
                }
            }
            // Both may land in one round, or the second after the first was answered.
            assert_eq!(rounds.iter().sum::<usize>(), 2, "rounds {rounds:?}");
        });
        assert_eq!(b.live(), 0);
    }

    /// A job that panics leaves the counts: the owner is not left waiting for it.
    #[test]
    fn a_panicking_job_leaves() {
        let b = Batcher::default();
        b.job_started();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _c = Client::new(&b, None);
            panic!("boom");
        }));
        assert!(r.is_err());
        assert!(matches!(b.next_round(Duration::from_millis(1), 0), Round::Done));
    }

    /// A dropped ticket (the owner failed) answers an error instead of hanging the job.
    #[test]
    fn a_dropped_ticket_is_an_error() {
        let b = Batcher::default();
        std::thread::scope(|s| {
            b.job_started();
            let h = s.spawn(|| Client::new(&b, None).run(vec![item()]));
            loop {
                match b.next_round(Duration::from_millis(5), 0) {
                    Round::Run(tickets) => drop(tickets),
                    Round::Idle => {}
                    Round::Done => break,
                }
            }
            assert!(matches!(h.join().unwrap(), Err(RuntimeError::Internal(_))));
        });
    }
}
