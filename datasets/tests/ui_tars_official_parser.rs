//! The official UI-TARS parser reads what the UI-TARS language writes as we do: `@ui-tars/action-parser`
//! (npm, run by node through `tests/official/`) on a few hundred random actions, every kind,
//! compared with our parser. Its strings keep their escapes (as it hands over UI-TARS-1.5's own), so
//! their Python unescaping is compared. The random texts hold apostrophes, commas, backslashes,
//! newlines, `:`, `=`, `<`, `|`: what trips its regexes (see `ui_tars.rs`).
//!
//! Needs node and `ASKGUI_UI_TARS_NODE_MODULES`, a node_modules folder holding the package
//! (`npm install @ui-tars/action-parser@1.2.3`); says SKIPPED without them.

mod actions;
mod official;

use askgui_data::ActionLanguage;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

#[test]
fn the_official_parser_reads_our_ui_tars_text_as_we_do() {
    let lang = ActionLanguage::UiTars;
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &[49; 32]));
    let mut texts = Vec::new();
    while texts.len() < 400 {
        let a = actions::action().new_tree(&mut runner).unwrap().current();
        if let Ok(text) = lang.render(&a) {
            texts.push(text);
        }
    }
    let Some(parsed) = official::parse(&texts, "the_official_parser_reads_our_ui_tars_text_as_we_do") else {
        return;
    };
    let mut kinds = std::collections::BTreeSet::new();
    for (text, theirs) in texts.iter().zip(&parsed) {
        let ours = lang.parse(text).unwrap().action;
        assert_eq!(official::action(theirs), ours, "{text}\nofficial: {theirs}");
        kinds.insert(ours.name());
    }
    // Every action kind UI-TARS can say came up (swipe is written as drag).
    assert_eq!(kinds.len(), 14, "{kinds:?}");
}
