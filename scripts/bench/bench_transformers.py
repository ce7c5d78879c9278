#!/usr/bin/env python3
"""Time Hugging Face transformers on one image + text prompt: the side-by-side baseline for our CLI.

Loads a Qwen2.5-VL / Qwen2-VL checkpoint in float32 on CPU, builds the single user turn (image, then
text; default system prompt; generation prompt) with the Qwen2.5-VL chat template, warms up once, then
times preprocessing (the processor call) and prefill + exactly --max-new-tokens greedy tokens.
Prints one JSON line on stdout; everything else goes to stderr.

    python scripts/bench/bench_transformers.py --model DIR --image PATH --prompt TEXT \
        [--max-new-tokens 32] [--threads N] [--attn sdpa|eager]

The image processor is Qwen2VLImageProcessor(min_pixels=56*56, max_pixels=28*28*1280) unless the
checkpoint's preprocessor_config.json sets min_pixels / max_pixels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))

import make_fixtures as mf  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--image", type=Path, required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    args = ap.parse_args()

    import torch
    import transformers
    from PIL import Image
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    cfg = json.loads((args.model / "config.json").read_text())
    kind = cfg["model_type"]
    if kind not in ("qwen2_5_vl", "qwen2_vl"):
        sys.exit(f"unsupported model_type {kind!r} (want qwen2_5_vl or qwen2_vl)")
    model_cls = {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
    }[kind]

    min_pixels, max_pixels = mf.DEFAULT_MIN_PIXELS, mf.DEFAULT_MAX_PIXELS
    prep_path = args.model / "preprocessor_config.json"
    if prep_path.exists():
        prep = json.loads(prep_path.read_text())
        size = prep.get("size") or {}
        min_pixels = prep.get("min_pixels", size.get("shortest_edge", min_pixels))
        max_pixels = prep.get("max_pixels", size.get("longest_edge", max_pixels))

    model = model_cls.from_pretrained(str(args.model), dtype=torch.float32, attn_implementation=args.attn).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    processor = mf.make_processor(kind, tokenizer, min_pixels, max_pixels)
    log(
        f"model {args.model} ({kind}), attention: {model.config._attn_implementation}, threads {threads}, "
        f"min_pixels {min_pixels}, max_pixels {max_pixels}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}"
    )

    image = Image.open(args.image).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": args.prompt}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    gen_kwargs = dict(
        do_sample=False,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        pad_token_id=model.generation_config.pad_token_id,
    )

    def run():
        t0 = time.perf_counter()
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, **gen_kwargs)
        t2 = time.perf_counter()
        return inputs, out, t1 - t0, t2 - t1

    run()  # warm-up
    inputs, out, pre_s, gen_s = run()
    prompt_tokens = int(inputs["input_ids"].shape[1])
    new_tokens = int(out.shape[1]) - prompt_tokens
    log(f"image grid {inputs['image_grid_thw'].tolist()}, output: {tokenizer.decode(out[0, prompt_tokens:])!r}")
    print(
        json.dumps(
            {
                "preprocess_s": round(pre_s, 6),
                "generate_s": round(gen_s, 6),
                "total_s": round(pre_s + gen_s, 6),
                "prompt_tokens": prompt_tokens,
                "new_tokens": new_tokens,
                "threads": threads,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
