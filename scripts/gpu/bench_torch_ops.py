#!/usr/bin/env python3
"""PyTorch side of the training-op benchmark: RMSNorm, LayerNorm, rotate-half RoPE, masked cross-entropy
and a frozen linear at the Qwen2.5-VL-3B shapes, forward and forward+backward, bf16 and f32.

The Rust side is `cargo run --release -p askgui-kernels --features cuda --example bench_cuda --
norm_rope_ce`; both print one JSON line per (bench, dtype) with the same keys:
{"bench", "impl", "dtype", shape fields, "fwd_ms", "fwd_bwd_ms"} ("impl": "torch" here), so the two
outputs join on bench + dtype. Medians of synchronised wall clocks after warm-up. As on the Rust side,
norm weights and the linear weight are frozen (requires_grad False), the gradient is for the activation
only, and backward is seeded with ones (a scalar loss for the cross-entropy).

Usage (GPU machine, from the repository root):
    python3 scripts/gpu/bench_torch_ops.py > "$OUT/ops.jsonl"
CPU smoke test (tiny shapes):
    python scripts/gpu/bench_torch_ops.py --tiny --device cpu
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(device, warmup, iters, fn):
    """Median wall time of fn() in ms, synchronising the device around each run."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    # transformers' apply_rotary_pos_emb (Qwen2 / Qwen2-VL): x * cos + rotate_half(x) * sin
    return x * cos + rotate_half(x) * sin


def bench(args, device, fields, x, fn):
    """Times fn(x) and fn(x) + backward; prints the JSON line."""

    def fwd():
        with torch.no_grad():
            fn(x)

    def fwd_bwd():
        x.grad = None
        y = fn(x)
        y.backward(torch.ones_like(y))

    fields = {"impl": "torch", **fields}
    fields["fwd_ms"] = median_ms(device, args.warmup, args.iters, fwd)
    fields["fwd_bwd_ms"] = median_ms(device, args.warmup, args.iters, fwd_bwd)
    print(json.dumps(fields), flush=True)


def liger_fused_linear_cross_entropy():
    """Liger-Kernel's fused linear cross-entropy loss module, or None (with a note) where it cannot run."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # not installed, or no Triton / GPU
        print(f"liger-kernel unavailable, its case is left out: {e!r}", file=sys.stderr)
        return None
    return LigerFusedLinearCrossEntropyLoss()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--dtypes", default="bf16,f32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    names = {"bf16": torch.bfloat16, "f32": torch.float32}
    # Qwen2.5-VL-3B: decoder hidden 2048, 16 heads of 128, vocabulary 151936, MLP 11008; Qwen2-VL vision
    # tower LayerNorm over 1280; 4096 tokens (16384 patches for the vision tower).
    if args.tiny:
        s = dict(rms=(64, 128), ln=(128, 80), rope=(1, 2, 64, 32), ce=(64, 1000), lin=(64, 128, 256),
                 lce=(64, 128, 1000))
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    else:
        s = dict(rms=(4096, 2048), ln=(16384, 1280), rope=(1, 16, 4096, 128), ce=(4096, 151936),
                 lin=(4096, 2048, 11008), lce=(4096, 2048, 151936))
    failed = False
    for dt in args.dtypes.split(","):
        dtype = names[dt]

        def t(*shape, grad=False):
            return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

        cases = []
        rows, hidden = s["rms"]
        x, w = t(rows, hidden, grad=True), t(hidden)
        cases.append((dict(bench="rms_norm", dtype=dt, rows=rows, hidden=hidden), x,
                      lambda x, w=w, h=hidden: F.rms_norm(x, (h,), w, 1e-6)))
        rows, hidden = s["ln"]
        x, w, b = t(rows, hidden, grad=True), t(hidden), t(hidden)
        cases.append((dict(bench="layer_norm", dtype=dt, rows=rows, hidden=hidden), x,
                      lambda x, w=w, b=b, h=hidden: F.layer_norm(x, (h,), w, b, 1e-6)))
        bs, h, tt, d = s["rope"]
        x = t(bs, h, tt, d, grad=True)
        ang = torch.randn(bs, 1, tt, d, device=device)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        cases.append((dict(bench="rope", dtype=dt, b=bs, h=h, t=tt, d=d), x,
                      lambda x, c=cos, s_=sin: rope(x, c, s_)))
        rows, vocab = s["ce"]
        x = t(rows, vocab, grad=True)
        labels = (torch.arange(rows, device=device) * 2654435761) % vocab
        labels[torch.arange(rows, device=device) % 2 == 0] = -100  # half the rows unsupervised
        cases.append((dict(bench="cross_entropy", dtype=dt, rows=rows, vocab=vocab, mask_frac=0.5), x,
                      lambda x, l=labels: F.cross_entropy(x, l, ignore_index=-100)))
        rows, d_in, d_out = s["lin"]
        x, w = t(rows, d_in, grad=True), t(d_out, d_in) / d_in**0.5
        cases.append((dict(bench="frozen_linear", dtype=dt, rows=rows, **{"in": d_in, "out": d_out}), x,
                      lambda x, w=w: F.linear(x, w)))
        # The LM head and the loss over 4096 supervised rows: the full logits (upcast to f32 as transformers'
        # loss does), and Liger-Kernel's fused linear cross-entropy where it is installed (impl "liger").
        rows, hidden, vocab = s["lce"]
        x, w = t(rows, hidden, grad=True), t(vocab, hidden) / hidden**0.5
        labels = (torch.arange(rows, device=device) * 2654435761) % vocab
        fields = dict(bench="linear_cross_entropy", dtype=dt, rows=rows, hidden=hidden, vocab=vocab)
        cases.append((dict(fields, variant="unfused"), x,
                      lambda x, w=w, l=labels: F.cross_entropy(F.linear(x, w).float(), l)))
        flce = liger_fused_linear_cross_entropy()
        if flce is not None:
            cases.append((dict(fields, impl="liger", variant="fused"), x, lambda x, w=w, l=labels: flce(w, x, l)))
        for fields, x, fn in cases:
            try:
                bench(args, device, fields, x, fn)
            except Exception as e:  # report and go on: one failing case must not hide the others
                failed = True
                print(json.dumps(dict(fields, impl="torch", error=repr(e))), flush=True)
                print(f"{fields['bench']} {dt}: {e!r}", file=sys.stderr)
        del cases, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
