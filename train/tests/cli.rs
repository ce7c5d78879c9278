//! `askgui-train`'s command line as a user meets it: `--help` lists the subcommands, each subcommand has
//! its own usage line, flags and subcommands do not mix, and no help text leaks rustdoc link syntax.

use std::process::Command;

const SUBCOMMANDS: [&str; 3] = ["merge", "demo", "check-gpu"];

/// The stdout of a `--help` run, which must succeed.
fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-train")).args(args).output().expect("askgui-train runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{args:?}: exit {:?}\n{text}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    text
}

fn usage_line(text: &str) -> &str {
    text.lines().find(|l| l.starts_with("Usage:")).unwrap_or_else(|| panic!("no usage line in\n{text}"))
}

#[test]
fn help_lists_the_subcommands() {
    let text = help(&["--help"]);
    let commands: Vec<&str> = text
        .lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for sub in SUBCOMMANDS {
        assert!(commands.contains(&sub), "`{sub}` is not under Commands: {commands:?}\n{text}");
    }
    // Training without a subcommand stays the first usage.
    assert_eq!(usage_line(&text), "Usage: askgui-train [OPTIONS]", "{text}");
    assert!(text.contains("--model") && text.contains("--resume") && text.contains("--config"), "{text}");
}

#[test]
fn each_subcommand_has_its_usage_line() {
    assert_eq!(usage_line(&help(&["demo", "--help"])), "Usage: askgui-train demo [OPTIONS]");
    assert_eq!(usage_line(&help(&["check-gpu", "--help"])), "Usage: askgui-train check-gpu [OPTIONS]");
    assert_eq!(
        usage_line(&help(&["merge", "--help"])),
        "Usage: askgui-train merge --model <MODEL> --adapter <ADAPTER> --out <OUT>"
    );
}

#[test]
fn training_flags_and_a_subcommand_do_not_mix() {
    let out = Command::new(env!("CARGO_BIN_EXE_askgui-train")).args(["--model", "m", "merge"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn help_texts_have_no_rustdoc_links() {
    let mut runs = vec![vec!["--help"]];
    runs.extend(SUBCOMMANDS.map(|s| vec![s, "--help"]));
    for args in runs {
        let text = help(&args);
        for (i, line) in text.lines().enumerate() {
            assert!(!line.contains("[`"), "{args:?} line {}: rustdoc link syntax in `{line}`", i + 1);
        }
    }
}
