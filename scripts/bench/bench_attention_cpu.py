#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the CPU, on the shapes of askgui-kernels' example
`bench_attention_cpu` (the serve benchmark's tiny checkpoint: head dim 16), one JSON line per shape with
the same keys, so that the two read as ratios.

    python scripts/bench/bench_attention_cpu.py [--repeats 20] [--threads 2]

Vision: one image is one full attention over its patches; 16 images are 16 such attentions (what
transformers runs for a batch: one call per image), timed together. Text: causal self-attention over a
1,384-token prompt (4 query heads, 2 key/value heads, expanded as transformers does), and a 512-row
chunk of it against all 1,384 keys (an explicit causal mask, queries last).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

PATCHES = 1564


def median_ms(repeats: int, f) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per shape (median reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = lambda name, ms: print(json.dumps({"shape": name, "median_ms": round(ms, 3)}), flush=True)
    with torch.no_grad():
        for images in (1, 16):
            q, k, v = (torch.randn(images, 2, PATCHES, 16) for _ in range(3))
            run = lambda: [F.scaled_dot_product_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in range(images)]
            report(f"vision_full_{images}x{PATCHES}", median_ms(args.repeats, run))
        q, k, v = torch.randn(1, 4, 1384, 16), torch.randn(1, 2, 1384, 16), torch.randn(1, 2, 1384, 16)
        k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        report("text_causal_1384", median_ms(args.repeats, lambda: F.scaled_dot_product_attention(q, k4, v4, is_causal=True)))
        qc = torch.randn(1, 4, 512, 16)
        mask = torch.ones(512, 1384, dtype=torch.bool).tril(1384 - 512)
        report("text_chunk_512_of_1384", median_ms(args.repeats, lambda: F.scaled_dot_product_attention(qc, k4, v4, attn_mask=mask)))


if __name__ == "__main__":
    main()
