//! `encode_chat`, the one tokenisation of prompts (training samples and the runtime's steps): splitting the
//! text at the loss spans gives the ids of the whole text encoded at once (the model's own
//! `encode_prompt`), the mask covers exactly the target and its `<|im_end|>`, and an image count that does
//! not match the placeholders is an error.

use std::path::{Path, PathBuf};

use askgui_data::prompt::{render_chatml, ChatMessage, Part};
use askgui_model::QwenTokenizer;
use askgui_runtime::encode_chat;

fn tokenizer() -> QwenTokenizer {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl/tokenizer.json");
    QwenTokenizer::from_file(&path, None).unwrap()
}

fn text(role: &str, t: &str, loss: bool) -> ChatMessage {
    ChatMessage { role: role.into(), content: vec![Part::Text { text: t.into() }], loss }
}

fn sample(target: &str) -> Vec<ChatMessage> {
    let user = ChatMessage {
        role: "user".into(),
        content: vec![
            Part::Text { text: "Task: Buy oat milk\nCurrent screenshot:".into() },
            Part::Image { path: PathBuf::from("a.png") },
            Part::Text { text: "Next action?".into() },
        ],
        loss: false,
    };
    vec![text("system", "GUI agent.", false), user, text("assistant", target, true)]
}

#[test]
fn split_encoding_equals_the_whole_and_masks_exactly_the_target() {
    let tok = tokenizer();
    let target = r#"{"action":"click","x":12,"y":340}"#;
    let r = render_chatml(&sample(target), false);
    let enc = encode_chat(&tok, &r, &[6]).unwrap();
    assert_eq!(enc.ids, tok.encode_prompt(&r.text, &[6]).unwrap(), "split at the loss span vs whole");
    assert_eq!(enc.ids.iter().filter(|&&t| t == tok.image_pad_id).count(), 6);
    assert_eq!(enc.starts.len(), 1);
    assert_eq!(enc.ids[enc.starts[0]], tok.image_pad_id);
    let supervised: Vec<u32> = enc.ids.iter().zip(&enc.mask).filter(|(_, &m)| m).map(|(&t, _)| t).collect();
    assert_eq!(tok.decode(&supervised, false).unwrap(), format!("{target}<|im_end|>"));
    // The prompt up to the target is what the runtime encodes with a generation prompt.
    let prompt = render_chatml(&sample(target)[..2], true);
    let first = enc.mask.iter().position(|&m| m).unwrap();
    assert_eq!(encode_chat(&tok, &prompt, &[6]).unwrap().ids, enc.ids[..first]);
}

#[test]
fn image_counts_must_match_the_placeholders() {
    let tok = tokenizer();
    let r = render_chatml(&sample("x"), false);
    assert!(encode_chat(&tok, &r, &[]).is_err(), "one placeholder, no image");
    assert!(encode_chat(&tok, &r, &[4, 4]).is_err(), "one placeholder, two images");
}
