#!/usr/bin/env python3
"""Time LoRA training steps of a Qwen2.5-VL checkpoint with transformers + PEFT on the CPU.

The reference side of the LoRA training-step benchmark whose Rust side is `model/examples/lora_step.rs`:
the same prompt shape, image, adapter and dtype, so the two can be compared on one machine. Each sequence
is `text_tokens/2` random text ids (below the smallest of the image / video / vision start / vision end
ids), `<|vision_start|>`, the image pads of one synthetic `image_side x image_side` RGB image (red and
green ramps, blue noise), `<|vision_end|>` and the remaining random text ids; the trailing text is
supervised. The image goes through Qwen2VLImageProcessor with the checkpoint's preprocessor_config.json
min / max pixels. The adapter is PEFT LoRA r=--rank, alpha=2r, dropout 0 on q_proj k_proj v_proj o_proj
gate_proj up_proj down_proj (by suffix, so the vision tower's MLPs too), PEFT's default init (B = 0);
the model is float32. A batch holds --batch sequences of equal length, each with its own random text and
all with the same image (as lora_step does), so there is no padding.

One untimed warm-up step, then --steps timed steps; a step is forward + backward + AdamW step (--lr, default
1e-4; betas, eps and weight decay are torch's defaults, which equal candle's ParamsAdamW defaults). The step
time reported is the median as lora_step takes it (the upper middle of the sorted times; the warm-up step's
time when --steps is 0). The random ids and pixels come from numpy, not from the Rust example's StdRng:
shapes match, values do not. Prints one JSON line on stdout (logs go to stderr): median and every step
time, tokens/s = batch * seq_len / median step time, peak RSS (ru_maxrss, which includes loading the
model; VmHWM from /proc/self/status as well), RSS after loading, the first (warm-up) and last loss.

    python scripts/fixtures/random_checkpoint.py --shape train-bench --out target/train-bench-ckpt
    python scripts/bench/bench_train_peft.py --model target/train-bench-ckpt [--batch 1] [--steps 3] \
        [--threads N] [--attn eager|sdpa] [--gradient-checkpointing] [--lr 1e-4] \
        [--image-side 448] [--text-tokens 64]

Needs torch, transformers (5.x), peft, torchvision, pillow, numpy.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="Qwen2.5-VL checkpoint directory")
    ap.add_argument("--image-side", type=int, default=448)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()
    if args.batch < 1 or args.steps < 0:
        ap.error("--batch must be at least 1 and --steps at least 0")
    return args


# --------------------------------------------------------------------------------------------
# memory


def proc_status_bytes(key: str) -> int:
    """`VmHWM` / `VmRSS` from /proc/self/status, in bytes (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def ru_maxrss_bytes() -> int:
    """Peak RSS of this process since it started (Linux reports kB, macOS bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if platform.system() == "Darwin" else r * 1024


# --------------------------------------------------------------------------------------------
# inputs


def synthetic_image(side: int, rng: np.random.Generator):
    """lora_step's image: red = x*255/side, green = y*255/side (integer division), blue = noise."""
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side].astype(np.int64)
    arr = np.stack([x * 255 // side, y * 255 // side, rng.integers(0, 256, size=(side, side))], axis=-1)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def image_processor(ckpt: Path):
    from transformers import Qwen2VLImageProcessor

    prep = json.loads((ckpt / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessor(min_pixels=prep["min_pixels"], max_pixels=prep["max_pixels"])


def sequence_ids(cfg, n_img: int, text_tokens: int, rng: np.random.Generator) -> list[int]:
    """text/2 random ids, vision start, n_img image pads, vision end, text - text/2 random ids."""
    specials = [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id]
    text_max = min(specials)
    before = text_tokens // 2
    after = text_tokens - before
    ids = rng.integers(0, text_max, size=before).tolist()
    ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
    ids += rng.integers(0, text_max, size=after).tolist()
    return ids


def make_batch(cfg, ckpt: Path, args) -> tuple[dict, dict]:
    """Model kwargs (with labels) for --batch equal-length sequences, and a description of their shape."""
    rng = np.random.default_rng(args.seed)
    res = image_processor(ckpt)(images=[synthetic_image(args.image_side, rng)], return_tensors="pt")
    pv = res["pixel_values"].to(torch.float32)
    grid = res["image_grid_thw"].to(torch.int64)
    merge = cfg.vision_config.spatial_merge_size
    n_img = int(grid.prod()) // (merge * merge)
    rows = [sequence_ids(cfg, n_img, args.text_tokens, rng) for _ in range(args.batch)]
    ids = torch.tensor(rows, dtype=torch.int64)
    after = args.text_tokens - args.text_tokens // 2
    labels = torch.full_like(ids, -100)
    labels[:, -after:] = ids[:, -after:]
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=pv.repeat(args.batch, 1),
        image_grid_thw=grid.repeat(args.batch, 1),
        mm_token_type_ids=(ids == cfg.image_token_id).to(torch.int64),
        labels=labels,
        use_cache=False,
    )
    shape = dict(seq_len=ids.shape[1], image_tokens=n_img, grid_thw=grid[0].tolist())
    return inputs, shape


# --------------------------------------------------------------------------------------------
# model and steps


def load_lora_model(ckpt: Path, args):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(args.seed)  # PEFT's kaiming-uniform init of A
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(ckpt), attn_implementation=args.attn, dtype=torch.float32
    )
    base.config.use_cache = False
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing differentiates through a segment whose inputs need no gradient, so the
        # LoRA weights inside still get theirs without enable_input_require_grads (which would add a backward
        # through the embeddings' output); main() checks that every LoRA parameter got a gradient.
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS, bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    model.train()
    return model


def timed_step(model, opt, inputs: dict) -> tuple[float, float, float, float]:
    """One forward + backward + optimizer step: (loss, forward s, forward+backward s, total s)."""
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = model(**inputs).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return loss.item(), t1 - t0, t2 - t0, t3 - t0


def lora_without_grad(model, n_steps: int) -> list[str]:
    """LoRA parameters whose last gradient is missing or all zero. PEFT starts B at 0, which makes every A
    gradient of the first step exactly zero: after a single step only B is checked."""
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (n_steps > 1 or "lora_B" in n) and (p.grad is None or not bool(p.grad.any()))
    ]


def median_step(times: list[float]) -> float:
    """lora_step's median: the upper middle of the sorted times."""
    return sorted(times)[len(times) // 2]


def versions() -> dict:
    import peft
    import transformers

    return dict(
        torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
        python=platform.python_version(),
    )


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_lora_model(args.model, args)
    rss_after_load = proc_status_bytes("VmRSS")
    inputs, shape = make_batch(model.config, args.model, args)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    n_lora = sum(p.numel() for p in params)
    modules = [n for n, _ in named if "lora_A" in n]
    opt = torch.optim.AdamW(params, lr=args.lr)
    log(f"batch {args.batch} x {shape['seq_len']} tokens, grid {shape['grid_thw']}, {n_lora} LoRA parameters, "
        f"{torch.get_num_threads()} threads, attn {args.attn}, gradient checkpointing {args.gradient_checkpointing}")

    steps = []
    for i in range(1 + args.steps):
        steps.append(timed_step(model, opt, inputs))
        log(f"step {i}{' (warm-up)' if i == 0 else ''}: loss {steps[-1][0]:.6f}, {steps[-1][3]:.3f} s")
    missing = lora_without_grad(model, len(steps))
    if missing:
        raise SystemExit(f"{len(missing)} LoRA parameters got no gradient in the last step, e.g. {missing[:3]}")

    timed = steps[1:] or steps
    step_s = median_step([s[3] for s in timed])
    out = dict(
        stack="transformers+peft",
        versions=versions(),
        threads=torch.get_num_threads(),
        attn=args.attn,
        gradient_checkpointing=args.gradient_checkpointing,
        batch=args.batch,
        **shape,
        rank=args.rank,
        lr=args.lr,
        lora_params=n_lora,
        lora_modules=len(modules),
        lora_modules_vision=sum(".visual." in n for n in modules),
        step_s_median=step_s,
        step_s_all=[s[3] for s in steps[1:]],
        warmup_step_s=steps[0][3],
        forward_s_median=median_step([s[1] for s in timed]),
        forward_backward_s_median=median_step([s[2] for s in timed]),
        tokens_per_s=args.batch * shape["seq_len"] / step_s,
        peak_rss_bytes=ru_maxrss_bytes(),
        vm_hwm_bytes=proc_status_bytes("VmHWM"),
        rss_after_load_bytes=rss_after_load,
        loss_first=steps[0][0],
        loss_last=steps[-1][0],
        lora_params_without_grad=len(missing),
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
