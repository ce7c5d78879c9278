//! A small byte-level BPE tokenizer learned from a corpus at run time (the demo learns one on its own
//! synthetic prompts), written as a `tokenizer.json` that serve and eval load like any other.
//!
//! Key choice: it *extends* the byte-level tokenizer of [`crate::init`]: ids 0..256 stay the bytes and
//! 256..264 the Qwen special tokens, and the learned merges take the ids from 264 on. A model config
//! written for the byte-level tokenizer (`image_token_id` 262, `eos_token_id` 258, ...) therefore works
//! unchanged with only `vocab_size` raised. The merges are learned by the `tokenizers` crate's BPE
//! trainer with the same ByteLevel pre-tokenizer, over the text between special tokens (a special token
//! is never split at encoding, so merges inside one would be wasted).
//!
//! Why: the byte-level tokenizer spends one token per character; on the demo's prompts a learned
//! vocabulary of a few hundred merges cuts the text tokens ~3x, so training sees ~2x more samples in the
//! same time and every generated action is ~3x fewer decode steps.

use serde_json::Value;
use tokenizers::models::bpe::BpeTrainer;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

use crate::error::{Result, TrainError};
use crate::init::TOKENIZER_JSON;

/// Ids of the byte-level tokenizer (256 bytes + 8 special tokens) that a learned tokenizer keeps.
pub const BYTE_LEVEL_IDS: usize = 264;

/// The special tokens of the chat format; text is cut at them before counting pairs.
const SPECIALS: [&str; 8] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
];

fn err(what: &str, e: impl std::fmt::Display) -> TrainError {
    TrainError::Data(format!("learning a tokenizer: {what}: {e}"))
}

/// The pieces of `text` between special tokens (empty ones dropped).
fn pieces(text: &str) -> Vec<String> {
    let mut out = vec![text.to_string()];
    for s in SPECIALS {
        out = out.iter().flat_map(|p| p.split(s).map(str::to_string).collect::<Vec<_>>()).collect();
    }
    out.retain(|p| !p.is_empty());
    out
}

/// Learns up to `vocab_size - 264` merges from `texts` (ChatML, special tokens included) and returns the
/// `tokenizer.json` text. Fewer merges come out when the corpus has fewer pairs worth merging.
pub fn learn(texts: &[String], vocab_size: usize) -> Result<String> {
    if vocab_size <= BYTE_LEVEL_IDS {
        return Err(TrainError::Config(format!("a learned vocabulary needs more than {BYTE_LEVEL_IDS} ids")));
    }
    let mut tokenizer = Tokenizer::from_bytes(TOKENIZER_JSON.as_bytes()).map_err(|e| err("byte tokenizer", e))?;
    let alphabet = ByteLevel::alphabet().into_iter().collect();
    // The trainer's vocabulary is the 256 byte symbols plus the merges; the specials stay added tokens.
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(vocab_size - (BYTE_LEVEL_IDS - 256))
        .initial_alphabet(alphabet)
        .min_frequency(2)
        .show_progress(false)
        .build()
        .into();
    let corpus: Vec<String> = texts.iter().flat_map(|t| pieces(t)).collect();
    tokenizer.train(&mut trainer, corpus.into_iter()).map_err(|e| err("training", e))?;
    let learned: Value = serde_json::from_str(&tokenizer.to_string(false).map_err(|e| err("serialising", e))?)
        .map_err(|e| err("json", e))?;
    let merges = merge_pairs(&learned["model"]["merges"])?;

    let mut out: Value = serde_json::from_str(TOKENIZER_JSON).map_err(|e| err("byte tokenizer json", e))?;
    let vocab = out["model"]["vocab"].as_object_mut().ok_or_else(|| err("byte tokenizer", "no vocab"))?;
    // tokenizers gives an added token the id `model vocab size + n` unless the model's vocabulary holds
    // it, so the specials go into the vocabulary at their byte-level ids: no id is left as a hole.
    for (i, s) in SPECIALS.iter().enumerate() {
        vocab.insert(s.to_string(), Value::from(256 + i));
    }
    let mut next = BYTE_LEVEL_IDS;
    let mut kept = Vec::new();
    for (a, b) in merges {
        if next >= vocab_size {
            break;
        }
        if !vocab.contains_key(&a) || !vocab.contains_key(&b) {
            continue; // the trainer only merges known symbols; a pair of unknown ones would not load
        }
        let joined = format!("{a}{b}");
        if !vocab.contains_key(&joined) {
            vocab.insert(joined, Value::from(next));
            next += 1;
        }
        kept.push(Value::from(vec![a, b]));
    }
    out["model"]["merges"] = Value::Array(kept);
    serde_json::to_string(&out).map_err(|e| err("writing", e))
}

/// Merges as `(left, right)` in rank order, from either serialisation (`["a", "b"]` or `"a b"`).
fn merge_pairs(v: &Value) -> Result<Vec<(String, String)>> {
    let list = v.as_array().ok_or_else(|| err("learned model", "no merges"))?;
    list.iter()
        .map(|m| match m {
            Value::Array(p) if p.len() == 2 => {
                Ok((p[0].as_str().unwrap_or_default().to_string(), p[1].as_str().unwrap_or_default().to_string()))
            }
            Value::String(s) => {
                s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| err("learned merge", s))
            }
            other => Err(err("learned merge", other)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The learned tokenizer keeps the byte-level ids, encodes a frequent phrase in fewer tokens, and
    /// decodes back to the same text.
    #[test]
    fn learned_tokenizer_extends_the_byte_level_one() -> anyhow::Result<()> {
        let text = "<|im_start|>user\nTask: Add oat milk to my cart\n<|image_pad|><|im_end|>\n<|im_start|>assistant\n\
                    {\"action\":\"click\",\"x\":84,\"y\":150}<|im_end|>\n";
        let json = learn(&vec![text.to_string(); 50], 320)?;
        let learned = Tokenizer::from_bytes(json.as_bytes()).map_err(anyhow::Error::msg)?;
        let bytes = Tokenizer::from_bytes(TOKENIZER_JSON.as_bytes()).map_err(anyhow::Error::msg)?;
        for s in SPECIALS {
            assert_eq!(learned.token_to_id(s), bytes.token_to_id(s), "{s}");
        }
        assert!(learned.get_vocab_size(true) <= 320);
        let a = learned.encode(text, false).map_err(anyhow::Error::msg)?;
        let b = bytes.encode(text, false).map_err(anyhow::Error::msg)?;
        assert!(a.len() * 2 < b.len(), "{} vs {} tokens", a.len(), b.len());
        assert_eq!(learned.decode(a.get_ids(), false).map_err(anyhow::Error::msg)?, text);
        Ok(())
    }

    #[test]
    fn text_is_cut_at_special_tokens() {
        assert_eq!(pieces("<|im_start|>user\nhi<|im_end|>\n"), ["user\nhi", "\n"]);
    }
}
