//! Property tests: every action renders to JSON that parses back to itself, also when a model wraps it in
//! a code fence, a thought or trailing text.

mod actions;

use actions::action;
use askgui_data::{parse_answer, Action, Target};
use proptest::prelude::*;

proptest! {
    #[test]
    fn render_then_parse_is_identity(a in action(), thought in "[a-zA-Z .,]{0,40}", wrap in 0usize..4) {
        let json = a.render();
        let answer = match wrap {
            0 => json.clone(),
            1 => format!("```json\n{json}\n```"),
            2 => format!("Thought: {thought}\nAction: {json}"),
            _ => format!("{json}\nThis should open the page."),
        };
        let parsed = parse_answer(&answer).map_err(|e| TestCaseError::fail(format!("{answer:?}: {e}")))?;
        prop_assert_eq!(parsed.action, a);
    }

    #[test]
    fn floats_round_to_the_nearest_pixel(x in -5000f64..5000.0, y in -5000f64..5000.0) {
        let p = parse_answer(&format!(r#"{{"action":"click","x":{x},"y":{y}}}"#)).unwrap();
        prop_assert_eq!(p.action, Action::Click(Target::point(x.round() as i32, y.round() as i32)));
    }
}
