#!/usr/bin/env python3
"""GPU memory of a LoRA step, computed from the model shapes (not measured).

What: for the released Qwen3-VL 2B, 4B and 8B shapes and Qwen2.5-VL-7B's (UI-TARS-1.5-7B's), the bytes a LoRA step holds on the GPU as askgui-train
runs it by default on CUDA: bf16 base weights; the adapter's f32 masters, gradients and AdamW moments (16
bytes a trainable parameter); with gradient checkpointing (on by default) the bf16 input of every decoder
layer and vision block, and one block's recomputed graph at a time; the vision tower's DeepStack captures
carried beside the hidden rows; one row chunk of the fused LM-head loss's f32 logits and their gradient
(its chunk rule, `kernels/src/ops/linear_cross_entropy.rs`). The workspace of the
kernels and the allocator's slack are not counted: treat the totals as a floor, and measure on the GPU.

Shapes are those of the released config.json files (text hidden, layers, heads, kv heads, head_dim 128,
intermediate; vision depth, width, MLP width, DeepStack blocks, gated MLP); the 2B and 4B tie their
embeddings. Qwen2.5-VL's vision MLP is gated (three linears) and it has no DeepStack.

    python scripts/bench/lora_memory_estimate.py [--tokens 2048] [--image-tokens 1280] [--supervised 64] \
        [--rank 16] [--vision-lora]

Output: a Markdown table on stdout.
"""

from __future__ import annotations

import argparse

VOCAB = 151_936
GIB = 1024**3

# name: (hidden, layers, heads, kv_heads, intermediate, tied, vision (depth, width, mlp, deepstack sets, gated))
SHAPES = {
    "Qwen3-VL-2B": (2048, 28, 16, 8, 6144, True, (24, 1024, 4096, 3, False)),
    "Qwen3-VL-4B": (2560, 36, 32, 8, 9728, True, (24, 1024, 4096, 3, False)),
    "Qwen3-VL-8B": (4096, 36, 32, 8, 12288, False, (27, 1152, 4304, 3, False)),
    "Qwen2.5-VL-7B (UI-TARS-1.5-7B)": (3584, 28, 28, 4, 18944, False, (32, 1280, 3420, 0, True)),
}
HEAD_DIM = 128
MERGE = 4  # 2x2 patches a token


def decoder_linears(h: int, nh: int, nkv: int, inter: int) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's seven linears."""
    q, kv = nh * HEAD_DIM, nkv * HEAD_DIM
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def vision_linears(w: int, mlp: int, gated: bool) -> list[tuple[int, int]]:
    """(in, out) of one vision block's linears: qkv, proj, then fc1, fc2 (or gate, up, down)."""
    return [(w, 3 * w), (w, w), (w, mlp)] + [(w, mlp)] * gated + [(mlp, w)]


def loss_chunk_rows(n: int, h: int) -> int:
    """The fused loss's rows a chunk: the next power of two of ceil(n / ceil(V / h))."""
    rows = max(1, -(-n // -(-VOCAB // h)))
    return 1 << (rows - 1).bit_length()


def estimate(name: str, a: argparse.Namespace) -> dict:
    h, layers, nh, nkv, inter, tied, (depth, vw, vmlp, ds, gated) = SHAPES[name]
    dec = decoder_linears(h, nh, nkv, inter)
    vis = vision_linears(vw, vmlp, gated)
    merger = [(MERGE * vw, MERGE * vw), (MERGE * vw, h)]
    params = layers * sum(i * o for i, o in dec) + depth * sum(i * o for i, o in vis)
    params += (1 + ds) * sum(i * o for i, o in merger) + VOCAB * h * (1 if tied else 2)
    lora = layers * sum(a.rank * (i + o) for i, o in dec)
    if a.vision_lora:
        lora += depth * sum(a.rank * (i + o) for i, o in vis)
    t, patches = a.tokens, a.image_tokens * MERGE
    # Checkpointed stage inputs (bf16): decoder rows (the first `ds` layers carry the DeepStack sets too),
    # vision rows (blocks after a DeepStack block carry its capture).
    stage_inputs = 2 * (layers * t * h + ds * t * h * (ds + 1) // 2)
    stage_inputs += 2 * patches * vw * (depth + ds * depth // 2)
    # One decoder layer's recomputed graph: q, k, v, attention output, o, the MLP's three products, norms,
    # each kept once and its gradient once (bf16).
    layer_graph = 2 * 2 * t * (nh * HEAD_DIM + 2 * nkv * HEAD_DIM + nh * HEAD_DIM + h + 3 * inter + 2 * h)
    logits = 2 * 4 * min(a.supervised, loss_chunk_rows(a.supervised, h)) * VOCAB
    parts = {
        "weights (bf16)": 2 * params,
        "adapter + AdamW (f32)": 16 * lora,
        "checkpointed activations": stage_inputs + layer_graph,
        "loss logits (a chunk)": logits,
    }
    return {"params": params, "lora": lora, "parts": parts, "total": sum(parts.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="sequence length of the step (one sequence)")
    p.add_argument("--image-tokens", type=int, default=1280, help="the screenshot's tokens (32x32 px each; 28x28 for Qwen2.5-VL)")
    p.add_argument("--supervised", type=int, default=64, help="supervised (answer) tokens")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (askgui-train's default 16)")
    p.add_argument("--vision-lora", action="store_true", help="also adapt the vision blocks")
    a = p.parse_args()
    print(f"LoRA r {a.rank} on the decoder's seven linears{' and the vision blocks' if a.vision_lora else ''}, "
          f"{a.tokens} tokens ({a.image_tokens} of one screenshot), {a.supervised} supervised; computed, not measured.\n")
    print("| model | parameters | LoRA parameters | weights (bf16) | adapter + AdamW | activations | logits | total |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        e = estimate(name, a)
        cells = [f"{v / GIB:.2f} GiB" for v in e["parts"].values()]
        print(f"| {name} | {e['params'] / 1e9:.2f} B | {e['lora'] / 1e6:.1f} M | " + " | ".join(cells)
              + f" | {e['total'] / GIB:.1f} GiB |")


if __name__ == "__main__":
    main()
