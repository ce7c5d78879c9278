#!/usr/bin/env python3
"""Time one LoRA training step of a random Qwen2.5-VL-3B-shaped model with transformers + PEFT on the GPU:
the PyTorch side of the GPU training-step benchmark.

Model: scripts/fixtures/random_checkpoint.py's 3b shape in bf16, attn_implementation sdpa (--attn), gradient checkpointing on
(non-reentrant; --no-gradient-checkpointing turns it off). Sample: one 1080x2400 random screenshot through
the Qwen2-VL processor (min_pixels 256*28*28, max_pixels 1280*28*28 unless --min-pixels / --max-pixels:
1272 visual tokens at the defaults) + 200 text tokens, loss on the last 50. Adapter: PEFT LoRA r 64,
alpha 128, dropout 0.05, PEFT's default init (A kaiming-uniform, B 0), on exactly the language model's
q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (36 x 7 = 252 modules; none in the vision tower),
LoRA weights in PEFT's adapter dtype (float32 over the bf16 base, `lora_dtype` in the JSON). Optimizer:
torch.optim.AdamW over the LoRA parameters, lr 1e-4, torch's default betas / eps / weight decay 0.01.

A step is zero_grad + forward (with labels) + backward + optimizer step. --warmup untimed steps, then
--steps timed ones; step_ms is the median (fwd_ms / bwd_ms / opt_ms the medians of the phases, each ended
by a synchronize). Peak memory is max_memory_allocated / max_memory_reserved from just before the first
step (the weights are in it: `weights_bytes`). tokens_per_s = total_tokens / step time.

--save-checkpoint DIR writes the random base model, the exact sample and PEFT's initial adapter
(DIR/adapter_init) before the first step, and the JSON result (with every step's loss) to
DIR/torch_lora_step.json after: the Rust trainer can run the same steps on the same weights and input
(the same losses need --lora-dropout 0 on both sides). --load-checkpoint DIR uses a saved one.

    python scripts/gpu/bench_torch_lora_step.py [--device cuda] [--save-checkpoint /tmp/qwen3b-random] \
        [--load-checkpoint DIR] [--max-pixels 1003520] [--no-gradient-checkpointing] [--steps 5]
    python scripts/gpu/bench_torch_lora_step.py --tiny --device cpu     # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))

import gui_sample as gs  # noqa: E402
import random_checkpoint as rc  # noqa: E402
from timing import (  # noqa: E402
    FAILED,
    WallClock,
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
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Full-name regex (PEFT matches a string target_modules against the whole module name): the language
# model's attention and MLP projections only, not the vision tower's (whose MLP also has gate/up/down_proj).
LORA_TARGET_REGEX = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and image for a CPU smoke test")
    ap.add_argument("--load-checkpoint", type=Path, default=None)
    ap.add_argument("--save-checkpoint", type=Path, default=None)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=128)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument("--liger", action="store_true",
                    help="Liger-Kernel's Qwen2.5-VL patches first (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--min-pixels", type=int, default=None)
    ap.add_argument("--max-pixels", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.load_checkpoint and not (args.load_checkpoint / "config.json").is_file():
        ap.error(f"--load-checkpoint {args.load_checkpoint}: no config.json there")
    if args.load_checkpoint and args.save_checkpoint:
        ap.error("--load-checkpoint and --save-checkpoint together would rewrite what was loaded")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    if args.tiny:
        args.rank, args.alpha = min(args.rank, 8), min(args.alpha, 16)
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    return args


def sample_spec(args) -> dict:
    spec = dict(gs.SAMPLE_TINY if args.tiny else gs.SAMPLE_3B)
    if args.min_pixels is not None:
        spec["min_pixels"] = args.min_pixels
    if args.max_pixels is not None:
        spec["max_pixels"] = args.max_pixels
    return spec


def wrap_lora(model, args):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=args.lora_dropout, target_modules=LORA_TARGET_REGEX,
        bias="none", task_type="CAUSAL_LM",
    )
    torch.manual_seed(args.seed)  # PEFT draws lora_A from the global generator
    model = get_peft_model(model, lora)
    names = [n for n, _ in model.named_parameters() if "lora_A" in n]
    n_layers = model.config.text_config.num_hidden_layers
    bad = [n for n in names if ".visual." in n or "language_model" not in n]
    if bad or len(names) != len(LORA_TARGETS) * n_layers:
        raise RuntimeError(f"LoRA landed on {len(names)} modules (want {len(LORA_TARGETS) * n_layers}, "
                           f"language model only); outside it: {bad[:3]}")
    return model, len(names)


def step(model, opt, inputs: dict, device) -> tuple[float, float, float, float]:
    """zero_grad + forward + backward + optimizer step: (loss, fwd ms, bwd ms, opt ms)."""
    opt.zero_grad(set_to_none=True)
    clock = WallClock(device)
    loss = model(**inputs, use_cache=False).loss
    t_fwd = clock.ms()
    loss.backward()
    t_bwd = clock.ms()
    opt.step()
    t_opt = clock.ms()
    return float(loss.detach()), t_fwd, t_bwd - t_fwd, t_opt - t_bwd


def lora_without_grad(model) -> list[str]:
    """LoRA parameters whose last gradient is missing or all zero (after >= 2 steps none should be: B starts
    at 0, which zeroes only the first step's A gradients)."""
    return [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not bool(p.grad.any()))]


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    env = environment(device)
    torch.manual_seed(args.seed)
    name = f"qwen2.5-vl-{'tiny' if args.tiny else '3b'}-lora" + ("-no-gc" if args.no_gradient_checkpointing else "")
    name += "-liger" if args.liger else ""
    rec = dict(bench="lora_step", name=name, **env)
    with guarded(rec):
        if args.liger:
            # Patches transformers' Qwen2.5-VL classes, so it must run before the model is built.
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

            apply_liger_kernel_to_qwen2_5_vl()
        if args.load_checkpoint:
            model, build_s, how = rc.load(args.load_checkpoint, device, args.attn)
            inputs, sample = gs.load_sample(args.load_checkpoint, model, device)
        else:
            model, build_s = rc.build("3b-tiny" if args.tiny else "3b", device, args.attn, args.seed)
            how = "random init on the device"
            inputs, sample = gs.make_sample(model, sample_spec(args), device, args.seed)
        log(f"model: {rc.n_params(model) / 1e9:.3f} B parameters, {how} in {build_s:.1f} s; sample: "
            f"{sample['visual_tokens']} visual + {sample['text_tokens']} text tokens, grid {sample['image_grid_thw']}")
        save_s = None
        if args.save_checkpoint:
            save_s = rc.save(model, args.save_checkpoint, sample["min_pixels"], sample["max_pixels"])
            save_s += gs.save_sample(args.save_checkpoint, inputs, sample)
            log(f"saved base model and sample to {args.save_checkpoint} in {save_s:.1f} s")

        model.config.use_cache = False
        if not args.no_gradient_checkpointing:
            # non-reentrant: the LoRA weights inside a checkpointed layer get gradients although the
            # layer's inputs (frozen embeddings) need none
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model, n_modules = wrap_lora(model, args)
        model.train()
        if args.save_checkpoint:
            model.save_pretrained(str(args.save_checkpoint / "adapter_init"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr)
        lora_dtype = str(params[0].dtype).removeprefix("torch.")

        weights_bytes = allocated_bytes(device)
        reset_peak_memory(device)
        results = []
        for i in range(args.warmup + args.steps):
            results.append(step(model, opt, inputs, device))
            loss, f, b, o = results[-1]
            log(f"step {i}{' (warm-up)' if i < args.warmup else ''}: loss {loss:.5f}  "
                f"fwd {f:.1f} + bwd {b:.1f} + opt {o:.1f} = {f + b + o:.1f} ms")
        mem = peak_memory(device)
        missing = lora_without_grad(model) if len(results) >= 2 else []

        timed = results[args.warmup:]
        step_times = [f + b + o for _, f, b, o in timed]
        step_ms = median(step_times)
        rec.update(
            **summary("step", step_times),
            fwd_ms=round(median([t[1] for t in timed]), 3),
            bwd_ms=round(median([t[2] for t in timed]), 3),
            opt_ms=round(median([t[3] for t in timed]), 3),
            tokens_per_s=round(sample["total_tokens"] / (step_ms * 1e-3), 2),
            samples_per_s=round(1 / (step_ms * 1e-3), 4),
            **mem,
            weights_bytes=weights_bytes,
            visual_tokens=sample["visual_tokens"],
            text_tokens=sample["text_tokens"],
            label_tokens=sample["label_tokens"],
            total_tokens=sample["total_tokens"],
            image_grid_thw=sample["image_grid_thw"],
            pixel_values_shape=sample["pixel_values_shape"],
            sample=sample,
            base_params=rc.n_params(model.get_base_model()) - sum(p.numel() for p in params),
            base_dtype="bfloat16",
            attn=args.attn,
            gradient_checkpointing=not args.no_gradient_checkpointing,
            lora_rank=args.rank,
            lora_alpha=args.alpha,
            lora_dropout=args.lora_dropout,
            liger=args.liger,
            lora_targets=LORA_TARGETS,
            lora_target_regex=LORA_TARGET_REGEX,
            lora_modules=n_modules,
            lora_params=sum(p.numel() for p in params),
            lora_dtype=lora_dtype,
            optimizer="torch.optim.AdamW",
            lr=args.lr,
            betas=list(opt.defaults["betas"]),
            eps=opt.defaults["eps"],
            weight_decay=opt.defaults["weight_decay"],
            warmup_steps=args.warmup,
            timed_steps=args.steps,
            losses=[round(t[0], 6) for t in results],
            loss_first=results[0][0],
            loss_last=results[-1][0],
            build_s=round(build_s, 3),
            model_source=str(args.load_checkpoint) if args.load_checkpoint else how,
            save_s=None if save_s is None else round(save_s, 3),
            lora_params_without_grad=len(missing),
        )
        log(f"{name}: step {step_ms:.1f} ms ({rec['tokens_per_s']:.0f} tokens/s), peak allocated "
            f"{mem['peak_mem_allocated_bytes']}, reserved {mem['peak_mem_reserved_bytes']}")
        emit(rec)
        if args.save_checkpoint:
            (args.save_checkpoint / "torch_lora_step.json").write_text(json.dumps(rec, indent=2) + "\n")
        if missing:
            log(f"FAILED: {len(missing)} LoRA parameters got no gradient in the last step, e.g. {missing[:3]}")
            FAILED.append(f"{name} (LoRA parameters without gradient)")
    finish()


if __name__ == "__main__":
    main()
