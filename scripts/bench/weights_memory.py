#!/usr/bin/env python3
"""Resident memory and one step's latency of askgui-serve on the CPU with f32, bf16 and int8 weights.

What: for each weight setting (`--dtype f32`, `--dtype bf16`, `--quantize int8` on f32), start the release
server on --model (a Qwen2.5-VL-3B-shaped random checkpoint: `python scripts/fixtures/random_checkpoint.py
--shape 3b --device cpu --out target/qwen3b-random --tokenizer ...`), read its resident memory (VmRSS)
once /health answers, send one agent step with a --width x --height screenshot (default a 1080x2400
phone screen) and --max-tokens, then read VmRSS again and the peak (VmHWM; while loading it counts the
checkpoint's mapped file pages too). `--settings int8-bf16` adds int8 linears loaded from bf16. The settings run one after
the other, never two servers at once. Also reported: each answer's `ask_probability` and action against
f32's (the logits themselves are compared on the test fixture, `cargo test -p askgui-model --test int8`).

Output: one JSON line on stdout; progress on stderr.

    python scripts/bench/weights_memory.py --model target/qwen3b-random [--width 1080 --height 2400] \
        [--max-tokens 8] [--settings f32,bf16,int8] [--binary target/release/askgui-serve]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load_test_serve as lt  # noqa: E402  (server, HTTP and screenshot helpers)

SETTINGS = {
    "f32": ["--dtype", "f32"],
    "bf16": ["--dtype", "bf16"],
    "int8": ["--dtype", "f32", "--quantize", "int8"],
    # int8 linears loaded from bf16: half the load peak; embeddings and activations in bf16.
    "int8-bf16": ["--dtype", "bf16", "--quantize", "int8"],
}


def status_kib(pid: int, field: str) -> int | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def measure(name: str, args) -> dict:
    extra = ["--device", "cpu", "--prefix-cache-mb", "0", *SETTINGS[name]]
    with lt.Server(args.binary, args.model, extra=extra) as server:
        load_s = server.wait_ready(timeout=1800)
        rss_load = status_kib(server.pid, "VmRSS")
        peak_load = status_kib(server.pid, "VmHWM")
        shot = lt.b64(lt.make_screenshot(args.width, args.height, 7))
        body = lt.step_body("Open the settings and turn on dark mode", shot, args.max_tokens)
        t0 = time.monotonic()
        r = lt.http(server.url + "/v1/agent/step", body, timeout=3600)
        step_s = time.monotonic() - t0
        if r.status != 200:
            raise RuntimeError(f"{name}: step answered {r.status} {r.error or r.body[:300]!r}\n{server.log_tail()}")
        answer = json.loads(r.body)
        row = dict(
            setting=name,
            load_s=round(load_s, 1),
            rss_after_load_mib=round(rss_load / 1024, 1),
            peak_rss_during_load_mib=round(peak_load / 1024, 1),
            step_s=round(step_s, 2),
            rss_after_step_mib=round(status_kib(server.pid, "VmRSS") / 1024, 1),
            peak_rss_mib=round(status_kib(server.pid, "VmHWM") / 1024, 1),
            prompt_tokens=answer["usage"]["prompt_tokens"],
            image_tokens=answer["usage"]["image_tokens"],
            ask_probability=answer.get("ask_probability"),
            action=answer["action"]["action"],
            timings_ms=answer["timings"],
        )
        lt.log(json.dumps(row))
        return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--width", type=int, default=1080)
    ap.add_argument("--height", type=int, default=2400)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--settings", default="f32,bf16,int8")
    ap.add_argument("--binary", type=Path, default=lt.DEFAULT_BINARY)
    args = ap.parse_args()
    rows = [measure(name, args) for name in args.settings.split(",")]
    base = next((r for r in rows if r["setting"] == "f32"), None)
    if base:
        for r in rows:
            r["rss_after_load_vs_f32"] = round(r["rss_after_load_mib"] / base["rss_after_load_mib"], 3)
            r["rss_after_step_vs_f32"] = round(r["rss_after_step_mib"] / base["rss_after_step_mib"], 3)
            r["step_s_vs_f32"] = round(r["step_s"] / base["step_s"], 3)
            if r["ask_probability"] is not None and base["ask_probability"] is not None:
                r["ask_probability_minus_f32"] = round(r["ask_probability"] - base["ask_probability"], 6)
    print(json.dumps(dict(model=str(args.model), screenshot=f"{args.width}x{args.height}", rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
