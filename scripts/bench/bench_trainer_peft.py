#!/usr/bin/env python3
"""The transformers + PEFT side of the trainer benchmark: LoRA training on the very batches askgui-train takes.

`train/examples/export_batches.rs` writes the token ids, loss masks and screenshots of each optimiser step of
an askgui-train run; this script runs the same steps through the same checkpoint with transformers + PEFT:
the screenshots through Qwen2VLImageProcessor with the run's pixel bounds (the grids are checked against
ours), the sequences right-padded into one batch with an attention mask, labels = the ids where the mask is
set (transformers shifts them), PEFT LoRA r / alpha / dropout 0 on the same target names (by suffix, so the
vision tower's too), torch AdamW at a constant --lr with clipping at --max-grad-norm. The model is float32.

The first step is a warm-up and is not timed. Throughput is over the timed steps: real (unpadded) tokens
and sequences, and supervised tokens, divided by their summed wall time; the padding fraction is the share of
computed (padded) rows that are padding. Peak RSS is the process's ru_maxrss (model load included,
as /usr/bin/time reports for askgui-train). At step 1 both adapters are zero (B = 0), so the first loss is
the base model's on identical inputs and must equal askgui-train's: printed as a check that the two sides
ran the same data through the same model.

    python scripts/bench/bench_trainer_peft.py --model RUN/init-model --batches batches.jsonl \
        --min-pixels 3136 --max-pixels 401408 [--rank 16] [--lr 1e-4] [--threads 2] [--attn sdpa]

Prints one JSON line on stdout; `scripts/bench/bench_trainer.sh` runs both sides and prints the ratios.
Needs torch, transformers (5.x), peft, torchvision, pillow.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the checkpoint the askgui-train run started from")
    ap.add_argument("--batches", type=Path, required=True, help="export_batches output (JSONL)")
    ap.add_argument("--min-pixels", type=int, required=True)
    ap.add_argument("--max-pixels", type=int, required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=None, help="default: 2 * rank, as askgui-train")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="sdpa")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_batches(path: Path) -> list[list[dict]]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(steps) < 2:
        sys.exit(f"{path}: needs at least 2 steps (one warm-up, one timed), has {len(steps)}")
    return [s["samples"] for s in steps]


def model_inputs(samples: list[dict], cfg, processor) -> dict:
    """One padded batch: ids, attention mask, labels, pixel values and grids of every screenshot in order."""
    from PIL import Image

    pad = cfg.text_config.pad_token_id if getattr(cfg.text_config, "pad_token_id", None) is not None else 0
    longest = max(len(s["ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    images, grids = [], []
    for i, s in enumerate(samples):
        n = len(s["ids"])
        ids[i, :n] = torch.tensor(s["ids"])
        mask[i, :n] = 1
        sup = torch.tensor(s["labels_mask"], dtype=torch.bool)
        labels[i, :n] = torch.where(sup, ids[i, :n], torch.full_like(ids[i, :n], -100))
        images += [Image.open(p).convert("RGB") for p in s["images"]]
        grids += s["grids"]
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    if images:
        res = processor(images=images, return_tensors="pt")
        got = res["image_grid_thw"].tolist()
        if got != grids:
            sys.exit(f"image grids differ: transformers {got}, askgui {grids} (are --min/--max-pixels the run's?)")
        inputs["pixel_values"] = res["pixel_values"].to(torch.float32)
        inputs["image_grid_thw"] = res["image_grid_thw"]
        inputs["mm_token_type_ids"] = (ids == cfg.image_token_id).to(torch.int64)
    return inputs


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
    from transformers import Qwen2VLImageProcessor

    cfg = AutoConfig.from_pretrained(str(args.model))
    cls = Qwen2_5_VLForConditionalGeneration if cfg.model_type == "qwen2_5_vl" else Qwen2VLForConditionalGeneration
    torch.manual_seed(args.seed)
    base = cls.from_pretrained(str(args.model), attn_implementation=args.attn, dtype=torch.float32)
    base.config.use_cache = False
    if args.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=args.rank, lora_alpha=args.alpha or 2 * args.rank, lora_dropout=0.0,
        target_modules=args.targets.split(","), bias="none", task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # weight_decay 0 as askgui-train's default (torch's AdamW defaults to 0.01).
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    processor = Qwen2VLImageProcessor(min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    batches = load_batches(args.batches)
    log(f"{len(batches)} steps; {sum(p.numel() for p in params)} trainable parameters")

    losses, times, tokens, sequences, supervised, rows = [], [], [], [], [], []
    for k, samples in enumerate(batches):
        t0 = time.perf_counter()
        inputs = model_inputs(samples, cfg, processor)
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        times.append(dt)
        tokens.append(sum(len(s["ids"]) for s in samples))
        sequences.append(len(samples))
        # Supervised tokens as transformers counts them: labels set past the first position.
        supervised.append(sum(sum(s["labels_mask"][1:]) for s in samples))
        rows.append(inputs["input_ids"].numel())
        log(f"step {k + 1}: loss {losses[-1]:.6f} in {dt:.3f} s")
    timed = slice(1, None)
    secs = sum(times[timed])
    out = dict(
        side="transformers+peft",
        attn=args.attn,
        gradient_checkpointing=args.gradient_checkpointing,
        threads=torch.get_num_threads(),
        steps=len(batches),
        timed_steps=len(times) - 1,
        tokens_per_s=sum(tokens[timed]) / secs,
        supervised_tokens_per_s=sum(supervised[timed]) / secs,
        samples_per_s=sum(sequences[timed]) / secs,
        padding_fraction=1 - sum(tokens[timed]) / sum(rows[timed]),
        step_s=times,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        first_loss=losses[0],
        losses=losses,
        torch=torch.__version__,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
