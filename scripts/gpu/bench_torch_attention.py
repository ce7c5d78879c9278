#!/usr/bin/env python3
"""Time torch scaled_dot_product_attention at the Qwen2.5-VL-3B shapes: the PyTorch side of the attention
kernel benchmark.

Each config runs in bf16 with each --bf16-backends backend forced through `torch.nn.attention.sdpa_kernel`
(default: flash only), and in f32 with the memory-efficient backend, or the math one where efficient cannot
run (flash has no f32). `backend` in the JSON is the backend that ran; `fallbacks` lists the ones tried
first and why they failed. On CPU (--tiny smoke test) bf16 falls back to math when flash cannot run. GQA
(Hq != Hkv) uses `enable_gqa=True` where the backend takes it, else k / v are `repeat_interleave`d to Hq
heads inside the timed call (`gqa` says which).

Tensors are (B, H, T, D), standard-normal, contiguous. fwd_ms times the forward under no_grad; fwd_bwd_ms
a forward plus `autograd.grad` of (q, k, v) for a random output gradient. Each is the median of --iters
calls after --warmup calls, CUDA-event timed. Peak memory is torch.cuda.max_memory_allocated over the
fwd+bwd calls, reset after the inputs exist (they are counted: `input_bytes`). FLOPs follow the
FlashAttention papers: forward 4*B*Hq*T*T*D (halved when causal), forward+backward 3.5x the forward.

Configs (name: B, Hq, Hkv, T, D, causal):
  decoder-3b     1, 16,  2, 4096, 128, causal   text decoder, 4k context
  decoder-3b-1k  1, 16,  2, 1024, 128, causal   text decoder, a screenshot + prompt
  decoder-3b-8k  1, 16,  2, 8192, 128, causal   text decoder, multi-screenshot samples
  vision-window 64, 16, 16,   64,  80, full     the vision tower's 64-token windows over 4096 patches,
                                                as 64 batches (sdpa has no varlen / block-diagonal mask)
  vision-full    1, 16, 16, 4096,  80, full     a full-attention vision block over 4096 patches

    python scripts/gpu/bench_torch_attention.py [--device cuda] [--iters 20] [--warmup 5] \
        [--configs decoder-3b,vision-full] [--bf16-backends flash,cudnn,efficient] [--no-f32]
    python scripts/gpu/bench_torch_attention.py --tiny --device cpu     # smoke test
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import (  # noqa: E402
    allocated_bytes,
    emit,
    environment,
    finish,
    guarded,
    log,
    peak_memory,
    reset_peak_memory,
    resolve_device,
    summary,
    time_call,
)


@dataclass(frozen=True)
class AttnConfig:
    name: str
    batch: int
    heads_q: int
    heads_kv: int
    seq: int
    head_dim: int
    causal: bool
    note: str = ""


def window_note(windows: int, window: int) -> str:
    return (
        f"block-diagonal attention over {windows * window} patches in windows of {window} tokens, run as "
        f"B={windows} batches of T={window} because flash sdpa has no varlen / block mask"
    )


CONFIGS = [
    AttnConfig("decoder-3b", 1, 16, 2, 4096, 128, True),
    AttnConfig("decoder-3b-1k", 1, 16, 2, 1024, 128, True),
    AttnConfig("decoder-3b-8k", 1, 16, 2, 8192, 128, True),
    AttnConfig("vision-window", 64, 16, 16, 64, 80, False, window_note(64, 64)),
    AttnConfig("vision-full", 1, 16, 16, 4096, 80, False),
]

# Same names and head dims, few heads and tokens: for `--tiny --device cpu`.
TINY_CONFIGS = [
    AttnConfig("decoder-3b", 1, 4, 2, 128, 128, True),
    AttnConfig("decoder-3b-1k", 1, 4, 2, 64, 128, True),
    AttnConfig("decoder-3b-8k", 1, 4, 2, 256, 128, True),
    AttnConfig("vision-window", 4, 4, 4, 16, 80, False, window_note(4, 16)),
    AttnConfig("vision-full", 1, 4, 4, 64, 80, False),
]

BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke test")
    ap.add_argument("--configs", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--bf16-backends", default="flash", help=f"comma-separated, of {sorted(BACKENDS)}")
    ap.add_argument("--no-f32", action="store_true", help="skip the f32 runs")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.tiny:
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
    for b in args.bf16_backends.split(","):
        if b not in BACKENDS:
            ap.error(f"--bf16-backends: unknown backend {b!r} (want some of {sorted(BACKENDS)})")
    return args


def sdp_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, BACKENDS[name])


def flops_forward(c: AttnConfig) -> float:
    f = 4.0 * c.batch * c.heads_q * c.seq * c.seq * c.head_dim
    return f / 2 if c.causal else f


def make_attention(c: AttnConfig, gqa: str):
    """sdpa on (B, H, T, D) tensors with the GQA handling `gqa` names: native | repeat_interleave | none."""
    groups = c.heads_q // c.heads_kv

    def attend(q, k, v):
        if gqa == "native":
            return F.scaled_dot_product_attention(q, k, v, is_causal=c.causal, enable_gqa=True)
        if gqa == "repeat_interleave":
            k = k.repeat_interleave(groups, dim=1)  # (B, Hq, T, D)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=c.causal)

    return attend


def make_inputs(c: AttnConfig, dtype, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(heads):
        # (B, H, T, D), drawn on the CPU so every device gets the same values
        return torch.randn(c.batch, heads, c.seq, c.head_dim, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(c.heads_q), rand(c.heads_kv), rand(c.heads_kv)
    grad_out = rand(c.heads_q)
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, grad_out


def pick_variant(c: AttnConfig, backends: list[str], q, k, v, grad_out):
    """The first (backend, gqa) pair that runs a forward and a backward, and why earlier ones did not."""
    from torch.nn.attention import sdpa_kernel

    gqa_modes = ["native", "repeat_interleave"] if c.heads_q != c.heads_kv else ["none"]
    tried = []
    for backend in backends:
        for gqa in gqa_modes:
            attend = make_attention(c, gqa)
            try:
                with warnings.catch_warnings(), sdpa_kernel([sdp_backend(backend)]):
                    warnings.simplefilter("ignore")  # sdpa warns once per reason a backend is refused
                    out = attend(q, k, v)
                    torch.autograd.grad(out, (q, k, v), grad_out)
                return backend, gqa, tried
            except (RuntimeError, TypeError, NotImplementedError) as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                tried.append(f"{backend}/{gqa}: {type(e).__name__}: {msg[:200]}")
    raise RuntimeError(f"no backend of {backends} ran {c.name}: {tried}")


def bench_one(c: AttnConfig, dtype: torch.dtype, backends: list[str], device, args, env: dict) -> None:
    from torch.nn.attention import sdpa_kernel

    base = dict(
        bench="attention",
        name=c.name,
        dtype=str(dtype).removeprefix("torch."),
        backend_requested=backends[0],
        **{k: v for k, v in asdict(c).items() if k not in ("name", "note")},
        layout="BHTD",
        note=c.note,
        **env,
    )
    with guarded(base):
        q, k, v, grad_out = make_inputs(c, dtype, device, args.seed)
        input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, grad_out))
        backend, gqa, tried = pick_variant(c, backends, q, k, v, grad_out)
        attend = make_attention(c, gqa)

        def fwd():
            with torch.no_grad():
                attend(q, k, v)

        def fwd_bwd():
            out = attend(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad_out)

        with sdpa_kernel([sdp_backend(backend)]):
            reset_peak_memory(device)
            fwd_times = time_call(fwd, device, args.warmup, args.iters)
            fwd_peak = peak_memory(device)["peak_mem_allocated_bytes"]
            reset_peak_memory(device)
            fb_times = time_call(fwd_bwd, device, args.warmup, args.iters)
            mem = peak_memory(device)

        ff = flops_forward(c)
        rec = dict(
            base,
            backend=backend,
            gqa=gqa,
            fallbacks=tried,
            **summary("fwd", fwd_times),
            **summary("fwd_bwd", fb_times),
            flops_fwd=ff,
            flops_fwd_bwd=3.5 * ff,
            input_bytes=input_bytes,
            fwd_peak_mem_allocated_bytes=fwd_peak,
            **mem,
            allocated_after_bytes=allocated_bytes(device),
        )
        rec["fwd_tflops"] = round(ff / (rec["fwd_ms"] * 1e-3) / 1e12, 3)
        rec["fwd_bwd_tflops"] = round(3.5 * ff / (rec["fwd_bwd_ms"] * 1e-3) / 1e12, 3)
        log(
            f"{c.name:14s} {rec['dtype']:8s} {backend:9s} gqa={gqa:17s} fwd {rec['fwd_ms']:8.3f} ms "
            f"({rec['fwd_tflops']:7.2f} TFLOP/s)  fwd+bwd {rec['fwd_bwd_ms']:8.3f} ms "
            f"({rec['fwd_bwd_tflops']:7.2f} TFLOP/s)  peak {mem['peak_mem_allocated_bytes']}"
            + (f"  [{len(tried)} fallback(s): {tried[0]}]" if tried else "")
        )
        emit(rec)


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    env = environment(device)
    configs = TINY_CONFIGS if args.tiny else CONFIGS
    if args.configs:
        wanted = args.configs.split(",")
        unknown = set(wanted) - {c.name for c in configs}
        if unknown:
            raise SystemExit(f"--configs: unknown {sorted(unknown)}; known {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in wanted]
    log(f"sdpa attention on {env['device_name']} ({device}), torch {torch.__version__}, "
        f"warmup {args.warmup}, iters {args.iters}")

    for c in configs:
        for b in args.bf16_backends.split(","):
            # flash on CPU exists in recent torch only for some shapes: math keeps the smoke test going
            chain = [b] + (["math"] if device.type == "cpu" and b != "math" else [])
            bench_one(c, torch.bfloat16, chain, device, args, env)
        if not args.no_f32:
            bench_one(c, torch.float32, ["efficient", "math"], device, args, env)
    finish()


if __name__ == "__main__":
    main()
