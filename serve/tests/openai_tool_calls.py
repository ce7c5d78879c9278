#!/usr/bin/env python3
"""The official OpenAI Python client's function calling against askgui-serve serving the tool-call action
language (run by `tests/tool_calls.rs`).

    python serve/tests/openai_tool_calls.py BASE_URL MODEL_ID

Asks with `tools` naming `computer_use`, plainly and through the client's streaming helper
(`chat.completions.stream`, whose `accumulate_delta` reassembles `delta.tool_calls`), and with a tool list
that leaves the function out (a 400). Prints one JSON line with both answers' calls for the Rust test to
check; exits non-zero on any failure.
"""

import json
import sys

from openai import BadRequestError, OpenAI

TOOL = {
    "type": "function",
    "function": {
        "name": "computer_use",
        "description": "Use the computer.",
        "parameters": {"type": "object", "properties": {"action": {"type": "string"}}, "required": ["action"]},
    },
}


def calls(message):
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, api_key="test-key", max_retries=0, timeout=120)
    common = dict(model=model, messages=[{"role": "user", "content": "Open the settings"}], max_tokens=64,
                  temperature=0, seed=7, tools=[TOOL])

    r = client.chat.completions.create(**common)
    plain = r.choices[0]
    assert plain.finish_reason == "tool_calls", plain.finish_reason
    assert plain.message.tool_calls and plain.message.tool_calls[0].type == "function", plain.message

    with client.chat.completions.stream(**common) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls", streamed.finish_reason

    try:
        client.chat.completions.create(**{**common, "tools": [{**TOOL, "function": {"name": "browser"}}]})
        raise AssertionError("a tool list without computer_use was accepted")
    except BadRequestError as e:
        refused = e.body["message"] if isinstance(e.body, dict) else str(e)
        assert "computer_use" in refused and "browser" in refused, refused

    print(json.dumps({
        "plain": {"content": plain.message.content, "calls": calls(plain.message)},
        "streamed": {"content": streamed.message.content, "calls": calls(streamed.message)},
        "refused": refused,
    }))


if __name__ == "__main__":
    main()
