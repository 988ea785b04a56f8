//! `agent-host test` (issue 42 item 5): the scripted turns every template
//! ships pass against the real component, in each language, on a private
//! cluster the command starts and removes; a script that expects what the
//! agent does not do is reported turn by turn, with exit status 1.

use crate::projects::{agent_host, said, scratch, LANGS};

#[test]
fn the_templates_scripted_turns_pass_in_each_language_and_a_wrong_expectation_is_reported() {
    let dir = scratch("test-cmd");
    for lang in LANGS {
        let name = format!("tested-{lang}");
        let made = agent_host(&dir, &["new", &name, "--lang", lang]);
        assert!(made.status.success(), "{}", said(&made));
        let project = dir.join(&name);
        let test = agent_host(&project, &["test"]);
        let out = String::from_utf8_lossy(&test.stdout).to_string();
        assert!(test.status.success(), "{lang}: {}", said(&test));
        for line in [
            "ok    answers in text, and remembers the conversation (turn 1)",
            "ok    answers in text, and remembers the conversation (turn 2)",
            "ok    offers the model its granted tool and runs the call it asks for (turn 1)",
            "ok    a stop during a tool call ends the turn cancelled (turn 1)",
            "test: 4 passed, 0 failed",
        ] {
            assert!(out.lines().any(|l| l == line), "{lang}: no line {line:?} in:\n{}", said(&test));
        }
    }

    // The Python agent against a script it does not satisfy: each
    // difference is named, the other turns still pass, the exit status is 1.
    let project = dir.join("tested-python");
    let path = project.join("agent-test.json");
    let mut script: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let turn = &mut script["cases"][1]["turns"][0];
    turn["expect"]["text"] = "It is one.".into();
    turn["expect"]["tool_calls"][0]["arguments"] = serde_json::json!({ "zone": "UTC" });
    turn["expect"]["offered"] = serde_json::json!(["clock", "weather"]);
    // One model answer more than the agent asks for in the first case.
    script["cases"][0]["turns"][1]["model"].as_array_mut().unwrap().push(serde_json::json!({ "content": "spare" }));
    std::fs::write(&path, script.to_string()).unwrap();
    let test = agent_host(&project, &["test"]);
    assert_eq!(test.status.code(), Some(1), "{}", said(&test));
    let out = String::from_utf8_lossy(&test.stdout).to_string();
    for line in [
        "ok    answers in text, and remembers the conversation (turn 1)",
        "FAIL  answers in text, and remembers the conversation (turn 2)",
        "      the agent called the model 1 times; the script has 2 answers",
        "FAIL  offers the model its granted tool and runs the call it asks for (turn 1)",
        "      text: expected \"It is one.\", got \"It is noon.\"",
        "      tool calls: expected clock {\"zone\":\"UTC\"}; got clock {}",
        "      offered: expected [\"clock\", \"weather\"], got [\"clock\"]",
        "ok    a stop during a tool call ends the turn cancelled (turn 1)",
        "test: 2 passed, 2 failed",
    ] {
        assert!(out.lines().any(|l| l == line), "no line {line:?} in:\n{}", said(&test));
    }

    // A script that is not one is refused before anything starts.
    std::fs::write(&path, r#"{"cases": [{"name": "x", "turns": [{"input": "hi", "modle": []}]}]}"#).unwrap();
    let test = agent_host(&project, &["test"]);
    assert_eq!(test.status.code(), Some(1));
    assert!(
        said(&test).contains("agent-test.json is not a test script") && said(&test).contains("modle"),
        "{}",
        said(&test)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
