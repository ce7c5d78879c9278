"""The one GUI-agent sample of the LoRA-step and generate benchmarks: a random screenshot through the Qwen2-VL
image processor and a token sequence around its image pads, made on the GPU in seconds and saved beside the
checkpoint so that the Rust side runs the same step on the same input.

Key choices:
- The sample: one random uint8 screenshot through the Qwen2-VL image processor (see image_processors.py),
  then `text_tokens` token ids: 20 random ids, <|vision_start|>, the image pads, <|vision_end|>, random ids;
  the last `label_tokens` ids are supervised. mm_token_type_ids marks the image pads (1), which transformers
  5 needs to build the 3D rope positions.
- Saved as inputs.safetensors (pixel_values f32, image_grid_thw / input_ids / labels / attention_mask /
  mm_token_type_ids i64) and sample.json (how the sample was made), beside the random checkpoint that
  scripts/fixtures/random_checkpoint.py writes (shapes 3b and 3b-tiny).

Not run directly; imported by bench_torch_lora_step.py and bench_torch_generate.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import image_processors as ip  # noqa: E402

# The sample both benchmarks use, and its --tiny version.
SAMPLE_3B = dict(image_width=1080, image_height=2400, min_pixels=ip.GUI_MIN_PIXELS, max_pixels=ip.GUI_MAX_PIXELS,
                 text_tokens=200, label_tokens=50)
SAMPLE_TINY = dict(image_width=216, image_height=480, min_pixels=56 * 56, max_pixels=64 * 28 * 28,
                   text_tokens=40, label_tokens=10)
PREFIX_TOKENS = 20  # random ids before <|vision_start|>: a system prompt's worth, scaled down

INPUT_KEYS = ["input_ids", "attention_mask", "mm_token_type_ids", "labels", "pixel_values", "image_grid_thw"]


def make_sample(model, spec: dict, device: torch.device, seed: int) -> tuple[dict, dict]:
    """(tensors on `device` named as INPUT_KEYS, a description). `spec` keys as SAMPLE_3B."""
    cfg = model.config
    screens = ip.random_screens(1, spec["image_width"], spec["image_height"], seed)  # (1, H, W, 3) uint8
    t0 = time.perf_counter()
    out, processor = ip.process_screens(screens, spec["min_pixels"], spec["max_pixels"], device)
    process_s = time.perf_counter() - t0
    grid = out["image_grid_thw"].to(torch.int64)
    merge = cfg.vision_config.spatial_merge_size
    n_img = int(grid.prod()) // (merge * merge)

    n_text = spec["text_tokens"]
    if n_text < PREFIX_TOKENS + 2 + spec["label_tokens"]:
        raise ValueError(f"text_tokens {n_text} < {PREFIX_TOKENS} prefix + 2 vision markers + {spec['label_tokens']} labels")
    text_max = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                   cfg.text_config.bos_token_id)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    rand = lambda n: torch.randint(0, text_max, (n,), generator=g)  # noqa: E731
    ids = torch.cat([
        rand(PREFIX_TOKENS),
        torch.tensor([cfg.vision_start_token_id]),
        torch.full((n_img,), cfg.image_token_id),
        torch.tensor([cfg.vision_end_token_id]),
        rand(n_text - PREFIX_TOKENS - 2),
    ]).to(torch.int64)[None]  # (1, T)
    labels = torch.full_like(ids, -100)
    labels[:, -spec["label_tokens"]:] = ids[:, -spec["label_tokens"]:]
    tensors = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == cfg.image_token_id).to(torch.int64),
        labels=labels,
        pixel_values=out["pixel_values"].to(torch.float32),
        image_grid_thw=grid,
    )
    tensors = {k: v.to(device) for k, v in tensors.items()}
    desc = dict(spec, seed=seed, processor=processor, process_s=round(process_s, 4))
    return tensors, describe(tensors, desc, merge)


def describe(tensors: dict, desc: dict, merge: int) -> dict:
    grid = tensors["image_grid_thw"]
    visual = int(grid.prod()) // (merge * merge)
    seq = int(tensors["input_ids"].shape[1])
    return dict(
        desc,
        image_grid_thw=[int(x) for x in grid[0].tolist()],
        pixel_values_shape=list(tensors["pixel_values"].shape),
        visual_tokens=visual,
        text_tokens=seq - visual,
        label_tokens=int((tensors["labels"] != -100).sum()),
        total_tokens=seq,
    )


def save_sample(ckpt: Path, tensors: dict, desc: dict) -> float:
    """inputs.safetensors and sample.json under `ckpt`; returns seconds."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    ckpt.mkdir(parents=True, exist_ok=True)
    save_file({k: tensors[k].detach().contiguous().cpu() for k in INPUT_KEYS}, str(ckpt / "inputs.safetensors"))
    (ckpt / "sample.json").write_text(json.dumps(desc, indent=2) + "\n")
    return time.perf_counter() - t0


def load_sample(ckpt: Path, model, device: torch.device) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    tensors = {k: v.to(device) for k, v in load_file(str(ckpt / "inputs.safetensors")).items()}
    missing = [k for k in INPUT_KEYS if k not in tensors]
    if missing:
        raise SystemExit(f"{ckpt}/inputs.safetensors lacks {missing}")
    desc = json.loads((ckpt / "sample.json").read_text()) if (ckpt / "sample.json").exists() else {}
    desc["loaded_from"] = str(ckpt)
    return tensors, describe(tensors, desc, model.config.vision_config.spatial_merge_size)
