#!/usr/bin/env python3
"""The official OpenAI Python client against a running askgui-serve (run by `tests/openai_client.rs`).

    python serve/tests/openai_client.py BASE_URL MODEL_ID PNG_PATH

Lists the models, then sends one user message with a PNG (as a data URL) and text, non-streaming and
streaming, with the parameters a client commonly adds (`user`, `seed`, `stream_options`); checks the
answer's shape, that the streamed pieces make the same text with a finish reason and usage, and that a
parameter the server does not know is a 400 naming it. Prints one JSON line; exits non-zero on any
failure.
"""

import base64
import json
import sys

from openai import BadRequestError, OpenAI


def main() -> None:
    base_url, model, png = sys.argv[1], sys.argv[2], sys.argv[3]
    client = OpenAI(base_url=base_url, api_key="test-key", max_retries=0, timeout=120)
    ids = [m.id for m in client.models.list().data]
    assert model in ids, f"{model} not in {ids}"
    with open(png, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is on the screen?"},
            ],
        }
    ]
    common = dict(model=model, messages=messages, max_tokens=8, temperature=0, seed=7, user="askgui-test")
    r = client.chat.completions.create(**common)
    choice = r.choices[0]
    assert r.object == "chat.completion", r.object
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    assert r.usage is not None and r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0

    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta and c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(pieces)
    assert finish in ("stop", "length"), finish
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
    # Greedy: the streamed text is the non-streamed one.
    assert streamed == choice.message.content, (streamed, choice.message.content)

    # A parameter OpenAI does not have either: refused, and named.
    try:
        client.chat.completions.create(**common, extra_body={"repetition_penalty": 1.05})
        raise AssertionError("an unknown parameter was accepted")
    except BadRequestError as e:
        refused = e.body["message"] if isinstance(e.body, dict) else str(e)
        assert "unknown field `repetition_penalty`" in refused, refused
    print(json.dumps({"models": ids, "text": choice.message.content, "pieces": len(pieces), "finish": finish,
                      "refused": refused[:60]}))


if __name__ == "__main__":
    main()
