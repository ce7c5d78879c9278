#!/usr/bin/env python3
"""Next-action latency and actions/s: askgui-serve vs Hugging Face transformers' generate, on one machine.

What: the same checkpoint (default: the tiny random Qwen2.5-VL test fixture), the same screenshot size,
the same prompt length and answer length, at concurrency 1 and 16.

- askgui-serve: the script starts the server (loopback, a free port), warms it up with 2 requests, then
  for each concurrency c sends --requests step requests from c client threads. Every request carries a
  fresh screenshot (distinct content, same size), so the server's image cache never hits; latency is
  the client's wall time per request (HTTP, JSON and base64 included), actions/s = completed / wall time.
- transformers: Qwen2_5_VLForConditionalGeneration in float32 on CPU (torch threads = --threads), the
  same PNGs through the checkpoint's processor, and a prompt of the server's length: the server's prompt
  text cannot be rebuilt here, so the chat is (image, filler text) with the filler sized until the
  prompt has exactly `usage.prompt_tokens` tokens of a server answer (the image gives the same number of
  image tokens). Exactly --max-tokens new tokens are generated greedily. Concurrency 1: sequential
  calls, latency per call (PNG decode + processor + generate). Concurrency c > 1: batches of c prompts
  in one generate call (left padding); every request of a batch has the batch's wall time as latency and
  actions/s = c / batch time: transformers' best case for throughput, not a server.

Why the comparison is only roughly like for like: askgui-serve batches concurrent requests continuously
(one packed forward per step over every live request) and decodes the action name by scoring all 15
names from copies of the KV cache (extra rows in those forwards), then the arguments under a schema
template (forced keys count towards its completion tokens, and the template may exceed max_tokens); it
also feeds the 11-token forced prefix `{"action":"` after the prompt. Its prefix cache reuses the prompt
text before the screenshot across requests (set ASKGUI_SERVE_PREFIX_CACHE_MB=0 in the environment to
measure without it: transformers has no such cache). Transformers generates free text. So this measures next-action
latency for the same prompt size and answer budget, not identical work.

Output: one JSON line on stdout; progress on stderr. Run with the venv that has torch + transformers:

    python scripts/bench/bench_serve.py [--requests 48] [--max-tokens 24] [--concurrency 1,16] \
        [--width 640 --height 480] [--attn sdpa|eager] [--threads 2] \
        [--binary target/release/askgui-serve] [--model model/tests/fixtures/tiny-qwen2_5_vl] [--port PORT]
        [--askgui-only]

The server is stopped before transformers runs, so the two never share the CPU (or the GPU).

On a GPU (`--device cuda`): the server runs `--device cuda` (bf16), transformers in bf16 on the same GPU;
`--api openai` sends OpenAI chat completions (the screenshot as a data URL) instead of agent steps. Each
level also reports p99 and, for askgui-serve, the time to first token from its own timings (queue +
preprocess + prefill), and counts the answers by status: under load every answer must be 200 or 429.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))  # make_fixtures

import load_test_serve as lt  # noqa: E402  (server, HTTP, screenshot and percentile helpers)

TASK = "Open the settings and turn on dark mode"
FILLER = (
    "You are operating a phone. Look at the screenshot and decide the single next action that moves the "
    "task forward; answer with one JSON action. "
)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def pct_summary(seconds: list[float]) -> dict:
    ms = [x * 1e3 for x in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(lt.percentile(ms, 50), 1),
        "p95_ms": round(lt.percentile(ms, 95), 1),
        "p99_ms": round(lt.percentile(ms, 99), 1),
        "mean_ms": round(sum(ms) / len(ms), 1),
    }


def screenshots(n: int, width: int, height: int, seed0: int) -> list[bytes]:
    """n distinct PNGs of one size (distinct content defeats the server's image cache)."""
    return [lt.make_screenshot(width, height, seed0 + k) for k in range(n)]


# --------------------------------------------------------------------------------------------
# askgui-serve


CHAT_PATH = "/v1/chat/completions"


def chat_body(model: str, png: bytes, max_tokens: int) -> bytes:
    """An OpenAI chat completion with the task and the screenshot as a data URL, greedy."""
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + lt.b64(png)}},
        {"type": "text", "text": TASK},
    ]
    req = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
           "temperature": 0}
    return json.dumps(req).encode()


def timed_step(url: str, body: bytes, timeout: float) -> tuple[float, int | None, dict | None]:
    """(seconds, HTTP status, the answer when 200)."""
    t0 = time.perf_counter()
    rep = lt.http(url, body, timeout)
    dt = time.perf_counter() - t0
    return dt, rep.status, json.loads(rep.body) if rep.status == 200 else None


def askgui_level(url: str, bodies: list[bytes], c: int, timeout: float, api: str) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=c) as pool:
        results = list(pool.map(lambda b: timed_step(url, b, timeout), bodies))
    wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for _, status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    ok = [(dt, a) for dt, _, a in results if a is not None]
    if not ok:
        raise RuntimeError(f"no request answered 200 at c={c}: {statuses}")
    out = {**pct_summary([dt for dt, _ in ok]), "actions_per_s": round(len(ok) / wall, 3),
           "wall_s": round(wall, 2), "statuses": statuses}
    answers = [a for _, a in ok]
    if api == "agent":
        timings = [a["timings"] for a in answers]
        ttft = [t["queue_ms"] + t["preprocess_ms"] + t["prefill_ms"] for t in timings]
        out.update(
            server_timings_mean_ms=lt.mean_of(timings, ["queue_ms", "preprocess_ms", "prefill_ms", "decode_ms"]),
            ttft_p50_ms=round(lt.percentile(ttft, 50), 1),
            ttft_p99_ms=round(lt.percentile(ttft, 99), 1),
            completion_tokens_mean=lt.mean_of([a["usage"] for a in answers], ["completion_tokens"])[
                "completion_tokens"],
            actions=sorted({a["action"]["action"] for a in answers}),
        )
    return out


def askgui_side(args, pngs_by_c: dict[int, list[bytes]]) -> tuple[dict, dict]:
    """Returns (results per concurrency, the usage of a warm-up answer)."""
    extra = ["--device", args.device] + (["--dtype", "bf16"] if args.device == "cuda" else [])
    with lt.Server(args.binary, args.model, args.port, extra=extra) as srv:
        log(f"askgui-serve ready in {srv.wait_ready(timeout=600):.2f} s")
        url = srv.url + lt.STEP_PATH
        warm = screenshots(2, args.width, args.height, seed0=900)
        usage = None
        for p in warm:
            _, status, ans = timed_step(url, lt.step_body(TASK, lt.b64(p), args.max_tokens), args.timeout)
            if ans is None:
                raise RuntimeError(f"the warm-up step answered {status}:\n{srv.log_tail()}")
            usage = ans["usage"]
        log(f"askgui-serve usage of a warm-up answer: {usage}")
        model_id = json.loads(lt.http(srv.url + "/health", timeout=5).body)["model"]
        if args.api == "openai":
            url = srv.url + CHAT_PATH
        out = {}
        for c, pngs in pngs_by_c.items():
            bodies = [lt.step_body(TASK, lt.b64(p), args.max_tokens) if args.api == "agent"
                      else chat_body(model_id, p, args.max_tokens) for p in pngs]
            out[str(c)] = askgui_level(url, bodies, c, args.timeout, args.api)
            log(f"askgui-serve c={c}: {out[str(c)]}")
        out["rss_mib_end"] = round(srv.rss_mib() or 0.0, 1)
    return out, usage


# --------------------------------------------------------------------------------------------
# transformers


def load_hf(model_dir: Path, attn: str, device: str):
    import torch
    import transformers
    from transformers import AutoTokenizer

    import make_fixtures as mf

    kind = json.loads((model_dir / "config.json").read_text())["model_type"]
    if kind != "qwen2_5_vl":
        sys.exit(f"unsupported model_type {kind!r} (want qwen2_5_vl)")
    min_pixels, max_pixels = mf.DEFAULT_MIN_PIXELS, mf.DEFAULT_MAX_PIXELS
    prep_path = model_dir / "preprocessor_config.json"
    if prep_path.exists():
        prep = json.loads(prep_path.read_text())
        min_pixels, max_pixels = prep.get("min_pixels", min_pixels), prep.get("max_pixels", max_pixels)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation=attn
    ).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = mf.make_processor(kind, tokenizer, min_pixels, max_pixels)
    processor.tokenizer.padding_side = "left"
    return model, processor


def chat_text(processor, filler: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": filler}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_len(processor, text: str, image) -> tuple[int, int]:
    """(prompt tokens, image tokens) of one text + image through the processor."""
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0]
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return int(ids.shape[0]), int((ids == image_id).sum())


def matching_prompt(processor, image, target: int) -> tuple[str, int, int]:
    """A chat (image + filler) whose prompt has `target` tokens, or as close as the tokenizer allows."""
    n_chars = 0
    for _ in range(8):
        filler = (FILLER * (n_chars // len(FILLER) + 1))[:n_chars]
        text = chat_text(processor, filler)
        n, n_img = prompt_len(processor, text, image)
        if n == target:
            break
        n_chars = max(0, n_chars + (target - n))
    return text, n, n_img


def hf_generate(model, processor, text: str, pngs: list[bytes], gen_kwargs: dict) -> tuple[float, float, int]:
    """One generate call on len(pngs) prompts: (total seconds, preprocess seconds, new tokens per row)."""
    import torch
    from PIL import Image

    t0 = time.perf_counter()
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    inputs = processor(text=[text] * len(pngs), images=images, return_tensors="pt", padding=True).to(model.device)
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **gen_kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, int(out.shape[1] - inputs["input_ids"].shape[1])


def hf_level(model, processor, text, pngs, c, gen_kwargs, max_tokens) -> dict:
    lat, pre, total = [], [], 0.0
    for i in range(0, len(pngs), c):
        chunk = pngs[i : i + c]
        dt, pre_s, new = hf_generate(model, processor, text, chunk, gen_kwargs)
        if new != max_tokens:
            raise RuntimeError(f"generated {new} tokens, want {max_tokens}")
        lat += [dt] * len(chunk)  # every request of a batch waits for the whole batch
        pre.append(pre_s)
        total += dt
    return {
        **pct_summary(lat),
        "actions_per_s": round(len(pngs) / total, 3),
        "wall_s": round(total, 2),
        "generate_calls": len(pre),
        "batch": c,
        "preprocess_mean_ms_per_call": round(1e3 * sum(pre) / len(pre), 1),
    }


def hf_side(args, pngs_by_c: dict[int, list[bytes]], usage: dict) -> dict:
    import torch
    import transformers
    from PIL import Image

    torch.set_num_threads(args.threads)
    model, processor = load_hf(args.model, args.attn, args.device)
    sample = Image.open(io.BytesIO(next(iter(pngs_by_c.values()))[0])).convert("RGB")
    text, n_prompt, n_img = matching_prompt(processor, sample, usage["prompt_tokens"])
    log(f"transformers prompt: {n_prompt} tokens ({n_img} image), server: {usage}")
    gen_kwargs = dict(
        do_sample=False,
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens,
        pad_token_id=model.generation_config.pad_token_id,
    )
    warm = screenshots(2, args.width, args.height, seed0=900)
    hf_generate(model, processor, text, warm[:1], gen_kwargs)
    hf_generate(model, processor, text, warm, gen_kwargs)  # a batched warm-up too
    out = {
        "prompt_tokens": n_prompt,
        "image_tokens": n_img,
        "new_tokens": args.max_tokens,
        "attn": model.config._attn_implementation,
        "device": args.device,
        "peak_mem_allocated_bytes": None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    for c, pngs in pngs_by_c.items():
        out[str(c)] = hf_level(model, processor, text, pngs, c, gen_kwargs, args.max_tokens)
        log(f"transformers c={c}: {out[str(c)]}")
    if args.device == "cuda":
        out["peak_mem_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


# --------------------------------------------------------------------------------------------


def ratios(ask: dict, hf: dict, levels: list[int]) -> dict:
    out = {}
    for c in levels:
        a, h = ask[str(c)], hf[str(c)]
        out[str(c)] = {
            "latency_p50_askgui_over_hf": round(a["p50_ms"] / h["p50_ms"], 3),
            "latency_p95_askgui_over_hf": round(a["p95_ms"] / h["p95_ms"], 3),
            "latency_p99_askgui_over_hf": round(a["p99_ms"] / h["p99_ms"], 3),
            "throughput_askgui_over_hf": round(a["actions_per_s"] / h["actions_per_s"], 3),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for transformers")
    ap.add_argument("--binary", type=Path, default=lt.DEFAULT_BINARY)
    ap.add_argument("--model", type=Path, default=lt.DEFAULT_MODEL)
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides run")
    ap.add_argument("--api", choices=["agent", "openai"], default="agent",
                    help="askgui-serve's requests: native agent steps, or OpenAI chat completions")
    ap.add_argument(
        "--askgui-only",
        action="store_true",
        help="skip transformers: for A/B runs of two askgui-serve builds (--binary), each side's figures only",
    )
    args = ap.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    # The same fresh screenshots for both sides; distinct per level so no level warms the next.
    pngs_by_c = {c: screenshots(args.requests, args.width, args.height, seed0=1000 * (i + 1)) for i, c in enumerate(levels)}

    t0 = time.monotonic()
    ask, usage = askgui_side(args, pngs_by_c)
    t1 = time.monotonic()
    if args.askgui_only:
        print(json.dumps({"askgui": ask, "server_usage": usage, "seconds": round(t1 - t0, 1)}), flush=True)
        return 0
    hf = hf_side(args, pngs_by_c, usage)
    t2 = time.monotonic()
    result = {
        "model": os.path.relpath(args.model.resolve(), lt.REPO_ROOT),
        "screenshot": f"{args.width}x{args.height} PNG, a fresh one per request",
        "requests_per_level": args.requests,
        "max_tokens": args.max_tokens,
        "device": args.device,
        "api": args.api,
        "cpu_cores": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "server_usage": usage,
        "askgui": ask,
        "transformers": hf,
        "ratios": ratios(ask, hf, levels),
        "seconds": {"askgui": round(t1 - t0, 1), "transformers": round(t2 - t1, 1)},
        "prefix_cache_mb": os.environ.get("ASKGUI_SERVE_PREFIX_CACHE_MB", "256 (default)"),
        "note": (
            "askgui-serve batches concurrent requests continuously (packed forwards), reuses cached prompt "
            "prefixes unless ASKGUI_SERVE_PREFIX_CACHE_MB=0 (prefix_cache_mb below), and decodes the "
            "action name by scoring all 15 names (extra forwards), then schema-constrained arguments (its "
            "completion_tokens include the 11-token forced prefix and template keys); transformers generates "
            "exactly max_tokens free-text tokens. transformers at c>1 is one batched generate call per c "
            "prompts (latency = batch wall time, actions/s = c / batch time): its best case for throughput. "
            "Ratios < 1 for latency and > 1 for throughput favour askgui-serve."
        ),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
