//! askgui-eval: scores GUI agents that can ask, the way the Navi-plus and Morae papers do.
//!
//! [`agent`] is the boundary to the agent under test and [`backends`] its implementations (in-process
//! model, OpenAI-compatible endpoint, askgui-serve's agent API); [`matching`] decides whether a predicted
//! step is right; [`modes`] runs standard, Dual-Stream and strict evaluation over an episode; [`metrics`]
//! aggregates, with [`ask_behaviour`] (asks per task, over-asking); [`runner`] runs a whole file with concurrency and resumable results, keyed on the run's
//! [`identity`]; [`report`] writes JSON, Markdown and plots; [`text`] holds the ASK-content metrics
//! (all-MiniLM-L6-v2 cosine in candle, METEOR); [`sensitivity`] scores a finished run again under each
//! choice the papers leave open; [`calibration`] measures how well `ask_probability` is calibrated and
//! [`calibrate`] chooses the pause threshold on a validation split.

pub mod agent;
pub mod ask_behaviour;
pub mod backends;
pub mod calibrate;
pub mod calibration;
pub mod identity;
pub mod matching;
pub mod metrics;
pub mod modes;
pub mod ratio;
pub mod report;
pub mod runner;
pub mod sensitivity;
pub mod text;
