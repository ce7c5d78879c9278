#!/usr/bin/env python3
"""Prompt tokens computed per step of an agent session: askgui-serve's sessions against a stateless client.

What: one session of --steps steps on the tiny test checkpoint (default), through `/v1/sessions`: the
screen changes after every step except an `ask`, and every `ask` gets a SAY answer. Per step the server's
`usage` gives the prompt length and how many of its tokens came from the prefix cache; computed =
prompt - cached. Then a stateless client replays the same steps through `POST /v1/agent/step`, each with
the whole history so far, on a server started with the prefix cache off (`--prefix-cache-mb 0`): it
computes every prompt token, every step.

Output: one JSON line on stdout (per-step rows and totals); progress on stderr.

    python scripts/bench/session_tokens.py [--steps 6] [--width 640 --height 480] [--max-tokens 24] \
        [--binary target/release/askgui-serve] [--model model/tests/fixtures/tiny-qwen2_5_vl]

Needs pillow (for the screenshots) and the release binary (`cargo build --release -p askgui-serve`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load_test_serve as lt  # noqa: E402  (server, HTTP and screenshot helpers)

TASK = "Buy oat milk"
ANSWERS = ["The 1 litre one.", "Oat, not almond.", "Yes, the organic one.", "Deliver it tomorrow."]


def post(url: str, body: dict) -> dict:
    r = lt.http(url, json.dumps(body).encode(), timeout=120)
    if r.status not in (200, 201):
        raise RuntimeError(f"{url}: {r.status} {r.error or r.body[:300]!r}")
    return json.loads(r.body) if r.body else {}


def get(url: str) -> dict:
    r = lt.http(url, timeout=30)
    if r.status != 200:
        raise RuntimeError(f"{url}: {r.status} {r.error or r.body[:300]!r}")
    return json.loads(r.body)


def session_run(server: lt.Server, args) -> list[dict]:
    """The session; per step its screen seed, the history before it, and the server's usage."""
    options = {"max_tokens": args.max_tokens, "temperature": 0.0}
    sid = post(server.url + "/v1/sessions", {"task": TASK, "options": options})["id"]
    rows, seed, answers = [], 0, iter(ANSWERS * 4)
    for step in range(args.steps):
        history = get(f"{server.url}/v1/sessions/{sid}")["history"]
        shot = lt.b64(lt.make_screenshot(args.width, args.height, seed))
        r = post(f"{server.url}/v1/sessions/{sid}/step", {"observation": {"screenshot": shot}})
        action = r["action"]["action"]
        u = r["usage"]
        rows.append(dict(step=step + 1, action=action, seed=seed, history=history,
                         prompt_tokens=u["prompt_tokens"], cached_tokens=u.get("cached_tokens", 0)))
        lt.log(f"session step {step + 1}: {action}, prompt {u['prompt_tokens']}, cached {u.get('cached_tokens', 0)}")
        if action == "ask":
            post(f"{server.url}/v1/sessions/{sid}/say", {"text": next(answers)})
        else:
            seed += 1  # the screen changes after an action
    return rows


def stateless_run(server: lt.Server, rows: list[dict], args) -> list[dict]:
    """The same steps as stateless requests carrying the whole history."""
    out = []
    for row in rows:
        body = {
            "task": TASK,
            "observation": {"screenshot": lt.b64(lt.make_screenshot(args.width, args.height, row["seed"]))},
            "history": row["history"],
            "options": {"max_tokens": args.max_tokens, "temperature": 0.0},
        }
        u = post(server.url + "/v1/agent/step", body)["usage"]
        out.append(dict(prompt_tokens=u["prompt_tokens"], cached_tokens=u.get("cached_tokens", 0)))
        lt.log(f"stateless step {row['step']}: prompt {u['prompt_tokens']}, cached {u.get('cached_tokens', 0)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--binary", type=Path, default=lt.DEFAULT_BINARY)
    ap.add_argument("--model", type=Path, default=lt.DEFAULT_MODEL)
    args = ap.parse_args()

    with lt.Server(args.binary, args.model) as server:
        server.wait_ready()
        rows = session_run(server, args)
    with lt.Server(args.binary, args.model, extra=["--prefix-cache-mb", "0"]) as server:
        server.wait_ready()
        stateless = stateless_run(server, rows, args)

    table = []
    for row, s in zip(rows, stateless):
        table.append(dict(step=row["step"], action=row["action"], history_turns=len(row["history"]),
                          prompt_tokens=row["prompt_tokens"],
                          session_computed=row["prompt_tokens"] - row["cached_tokens"],
                          stateless_prompt_tokens=s["prompt_tokens"],
                          stateless_computed=s["prompt_tokens"] - s["cached_tokens"]))
    totals = {k: sum(r[k] for r in table) for k in ("session_computed", "stateless_computed")}
    totals["ratio"] = round(totals["session_computed"] / max(totals["stateless_computed"], 1), 3)
    print(json.dumps(dict(model=str(args.model), screenshot=f"{args.width}x{args.height}", steps=table,
                          totals=totals)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
