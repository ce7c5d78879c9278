"""Sends the same agent steps to two askgui-serve instances (say one on the CPU and one on a GPU) and
compares the answers.

    python3 scripts/gpu/serve_smoke.py http://127.0.0.1:PORT_A http://127.0.0.1:PORT_B [--steps 10]

Each step is a task from the load test and a synthetic screenshot (scripts/bench/load_test_serve.py),
greedy, 24 tokens. Passes when every answer is HTTP 200, each step's action is the same on both, and the
ask probabilities agree within `--atol` (default 1e-3: an f32 softmax after 36 layers of reordered sums is
far closer; a flip of a greedy token near a tie would show as a different action and fail loudly). Prints
one line per step and a verdict; exits 1 on a failure. Also reports each side's median latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import load_test_serve as lt  # noqa: E402


def wait_ready(base: str, deadline_s: float) -> None:
    end = time.time() + deadline_s
    while time.time() < end:
        r = lt.http(base + "/health", timeout=2)
        if r.status == 200 and json.loads(r.body).get("status") == "ok":
            return
        time.sleep(0.5)
    raise SystemExit(f"{base} not ready after {deadline_s:.0f} s")


def step(base: str, body: bytes) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = lt.http(base + lt.STEP_PATH, body, timeout=120)
    ms = (time.perf_counter() - t0) * 1e3
    if r.status != 200:
        raise RuntimeError(f"{base}: HTTP {r.status} {r.error or r.body[:300]!r}")
    return json.loads(r.body), ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--atol", type=float, default=1e-3, help="largest ask_probability difference")
    ap.add_argument("--ready-s", type=float, default=180, help="how long to wait for /health to say ok")
    args = ap.parse_args()
    for base in (args.a, args.b):
        wait_ready(base, args.ready_s)
    bad, times = 0, {args.a: [], args.b: []}
    for i in range(args.steps):
        task = lt.TASKS[i % len(lt.TASKS)]
        body = lt.step_body(task, lt.b64(lt.make_screenshot(320 + 40 * (i % 3), 480, i)), 24)
        (ra, ta), (rb, tb) = step(args.a, body), step(args.b, body)
        times[args.a].append(ta)
        times[args.b].append(tb)
        dp = abs(ra["ask_probability"] - rb["ask_probability"])
        same = ra["action"] == rb["action"]
        ok = same and dp <= args.atol
        bad += not ok
        print(f"step {i}: {'ok ' if ok else 'BAD'} p_ask {ra['ask_probability']:.6f} vs {rb['ask_probability']:.6f} "
              f"(diff {dp:.1e}); action {json.dumps(ra['action'])}{'' if same else ' vs ' + json.dumps(rb['action'])}")
    # The first request of each pays one-off costs (kernel loading on a GPU): medians skip it.
    med = {k: statistics.median(v[1:] or v) for k, v in times.items()}
    print(f"median step latency: {args.a} {med[args.a]:.1f} ms, {args.b} {med[args.b]:.1f} ms")
    print(f"{'PASS' if bad == 0 else 'FAIL'}: {args.steps - bad}/{args.steps} steps agree")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
