#!/usr/bin/env python3
"""Time next-action latency with transformers `generate` on a random Qwen2.5-VL-3B-shaped model on the
GPU: the PyTorch side of the serving-latency benchmark.

Model: scripts/fixtures/random_checkpoint.py's 3b shape in bf16, attn_implementation sdpa (--attn), default dynamic KV cache, no
LoRA. Prompt: the same sample as bench_torch_lora_step.py, all of it (one 1080x2400 random screenshot
through the Qwen2-VL processor, min_pixels 256*28*28, max_pixels 1280*28*28: 1272 visual tokens, plus 200
text tokens), or the one saved with --load-checkpoint DIR. Greedy decoding of exactly --new-tokens (32)
tokens: min_new_tokens = max_new_tokens, since random weights would stop anywhere.

A streamer stamps the clock (after a synchronize) as each token comes out of generate: ttft_ms is from
the call to the first token (vision tower + prefill + first sampling), decode_ms_per_token the mean gap
between the following tokens, total_ms the whole call. --warmup untimed runs, then --runs timed ones;
each key is the median over runs. preprocess_ms (the image processor on the device for the one
screenshot, median of --runs) is reported beside it and not included in total_ms. Peak memory covers the
timed runs and includes the weights.

    python scripts/gpu/bench_torch_generate.py [--device cuda] [--load-checkpoint DIR] [--new-tokens 32] \
        [--runs 5] [--max-pixels 1003520]
    python scripts/gpu/bench_torch_generate.py --tiny --device cpu     # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))

import gui_sample as gs  # noqa: E402
import image_processors as ip  # noqa: E402
import random_checkpoint as rc  # noqa: E402
from timing import (  # noqa: E402
    allocated_bytes,
    emit,
    environment,
    finish,
    guarded,
    log,
    median,
    peak_memory,
    reset_peak_memory,
    resolve_device,
    summary,
    sync,
    time_call,
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and image for a CPU smoke test")
    ap.add_argument("--load-checkpoint", type=Path, default=None)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--min-pixels", type=int, default=None)
    ap.add_argument("--max-pixels", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.load_checkpoint and not (args.load_checkpoint / "config.json").is_file():
        ap.error(f"--load-checkpoint {args.load_checkpoint}: no config.json there")
    if args.new_tokens < 2 or args.runs < 1:
        ap.error("--new-tokens must be at least 2 and --runs at least 1")
    if args.tiny:
        args.warmup, args.runs, args.new_tokens = min(args.warmup, 1), min(args.runs, 2), min(args.new_tokens, 8)
    return args


class TokenClock:
    """A generate streamer: generate calls put() with the prompt first, then with each new token (already
    on the host, so the device has finished it); end() at the end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        sync(self.device)
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.stamps.append(now)

    def end(self) -> None:
        pass


def generate_once(model, inputs: dict, args, device) -> dict:
    clock = TokenClock(device)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        pad_token_id=model.generation_config.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
        use_cache=True,
        streamer=clock,
    )
    sync(device)
    total = time.perf_counter() - t0
    new = int(out.shape[1]) - int(inputs["input_ids"].shape[1])
    if new != args.new_tokens or len(clock.stamps) != new:
        raise RuntimeError(f"generated {new} tokens ({len(clock.stamps)} streamed), want {args.new_tokens}")
    s = clock.stamps
    return dict(ttft=(s[0] - t0) * 1e3, decode=(s[-1] - s[0]) * 1e3 / (len(s) - 1), total=total * 1e3)


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    env = environment(device)
    torch.manual_seed(args.seed)
    name = "qwen2.5-vl-3b-generate" if not args.tiny else "qwen2.5-vl-tiny-generate"
    rec = dict(bench="generate", name=name, **env)
    with guarded(rec):
        if args.load_checkpoint:
            model, build_s, how = rc.load(args.load_checkpoint, device, args.attn)  # with its generation ids
            sample_tensors, sample = gs.load_sample(args.load_checkpoint, model, device)
        else:
            spec = dict(gs.SAMPLE_TINY if args.tiny else gs.SAMPLE_3B)
            spec.update({k: v for k, v in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels)) if v})
            model, build_s = rc.build("3b-tiny" if args.tiny else "3b", device, args.attn, args.seed)
            how = "random init on the device"
            sample_tensors, sample = gs.make_sample(model, spec, device, args.seed)
        model.eval()
        inputs = {k: sample_tensors[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                 "pixel_values", "image_grid_thw")}
        log(f"model: {rc.n_params(model) / 1e9:.3f} B parameters, {how} in {build_s:.1f} s; prompt: "
            f"{sample['visual_tokens']} visual + {sample['text_tokens']} text tokens, grid {sample['image_grid_thw']}")

        # the processor's share of a real request: one screenshot, processed on the device
        pre_ms, pre_how = None, None
        fast, fast_name = ip.fast_class()
        if fast is not None:
            proc = ip.make(fast, sample.get("min_pixels", ip.GUI_MIN_PIXELS), sample.get("max_pixels", ip.GUI_MAX_PIXELS))
            w, h = sample.get("image_width", 1080), sample.get("image_height", 2400)
            shot = [ip.random_screens(1, w, h, args.seed)[0].to(device)]
            pre_ms = median(time_call(lambda: ip.run_fast(proc, shot, device), device, 1, args.runs, wall=True))
            pre_how = f"{fast_name} on {device}, {w}x{h} uint8 tensor already on the device"
        else:
            log(f"no torchvision image processor ({fast_name}): preprocess_ms not measured")

        weights_bytes = allocated_bytes(device)
        with torch.inference_mode():
            for i in range(args.warmup):
                r = generate_once(model, inputs, args, device)
                log(f"warm-up {i}: ttft {r['ttft']:.1f} ms, decode {r['decode']:.2f} ms/token, total {r['total']:.1f} ms")
            reset_peak_memory(device)
            runs = []
            for i in range(args.runs):
                runs.append(generate_once(model, inputs, args, device))
                r = runs[-1]
                log(f"run {i}: ttft {r['ttft']:.1f} ms, decode {r['decode']:.2f} ms/token, total {r['total']:.1f} ms")
        mem = peak_memory(device)

        decode = median([r["decode"] for r in runs])
        rec.update(
            **summary("ttft", [r["ttft"] for r in runs]),
            decode_ms_per_token=round(decode, 4),
            decode_ms_per_token_all=[round(r["decode"], 4) for r in runs],
            decode_tokens_per_s=round(1e3 / decode, 2),
            **summary("total", [r["total"] for r in runs]),
            new_tokens=args.new_tokens,
            preprocess_ms=None if pre_ms is None else round(pre_ms, 4),
            preprocess=pre_how,
            **mem,
            weights_bytes=weights_bytes,
            visual_tokens=sample["visual_tokens"],
            text_tokens=sample["text_tokens"],
            prompt_tokens=sample["total_tokens"],
            image_grid_thw=sample["image_grid_thw"],
            pixel_values_shape=sample["pixel_values_shape"],
            sample=sample,
            dtype="bfloat16",
            attn=args.attn,
            decoding="greedy",
            kv_cache="transformers default (DynamicCache)",
            warmup_runs=args.warmup,
            timed_runs=args.runs,
            build_s=round(build_s, 3),
            model_source=str(args.load_checkpoint) if args.load_checkpoint else how,
        )
        log(f"{name}: ttft {rec['ttft_ms']:.1f} ms, decode {decode:.2f} ms/token, {args.new_tokens} tokens in "
            f"{rec['total_ms']:.1f} ms; peak allocated {mem['peak_mem_allocated_bytes']}")
        emit(rec)
    finish()


if __name__ == "__main__":
    main()
