#!/usr/bin/env python3
"""Generate the LoRA training parity fixtures under model/tests/fixtures/lora/grad from PEFT.

The Rust crate `model/` trains LoRA adapters (model/src/train.rs); PEFT + transformers autograd is the
spec. This script wraps the tiny Qwen2.5-VL fixture checkpoint (scripts/make_fixtures.py) in a PEFT LoRA
adapter (r=4, alpha=8, dropout 0, targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj: PEFT
matches by suffix, so the vision tower's SwiGLU MLP is wrapped too) whose A and B are seeded random (PEFT's
B = 0 would make every A gradient zero). The fixture case (`tiny-qwen2_5_vl/case.safetensors`: input_ids,
pixel_values, image_grid_thw; one sequence of T = 170 tokens holding two images) is supervised only on its
last 8 tokens (labels = input_ids there, -100 elsewhere; transformers shifts: logits at t predict token
t+1; the loss is the mean over the supervised tokens). Every file below starts from that same adapter
(re-created from the seed), and writes:

- `adapter/`: the adapter (`save_pretrained`, transformers 5 key layout);
- `grads.safetensors`: one forward/backward on the case. `loss` (scalar, f32), `labels_mask` (T, u8: 1
  where the token is supervised) and for every LoRA weight its gradient under `<hub module name>.lora_A` /
  `.lora_B` (e.g. `model.layers.0.self_attn.q_proj.lora_A`, `visual.blocks.1.mlp.up_proj.lora_B`);
- `adamw.safetensors`: 5 steps of `torch.optim.AdamW` on the case. `losses` (5, f32: losses[k] is the
  loss before the k-th `step()`, so losses[0] is grads.safetensors' `loss`), the hyperparameters `lr`,
  `beta1`, `beta2`, `eps`, `weight_decay` (0-d f64) and the LoRA weights after the 5 steps under
  `final.<hub module name>.lora_A` / `.lora_B` (f32);
- `batch.safetensors`: one forward/backward on a batch of two sequences, right-padded to a common length T
  with the checkpoint's pad id. Sequence 0 is the case (its two images, its last 8 tokens supervised);
  sequence 1 is a shorter chat prompt over a third, generated image of another size (its last 5 tokens
  supervised). The loss is transformers' default: the mean over every supervised token of the batch.
  `input_ids` (2, T, i64), `attention_mask` (2, T, i64: 0 on pads), `labels_mask` (2, T, u8),
  `pixel_values` (P, 1176, f32: every image's rows in sequence order), `image_grid_thw` (images, 3, i64:
  one row per image in the same order, so sequence 0's two rows come first), `loss` (scalar, f32) and
  every LoRA gradient under the same keys as grads.safetensors. The script checks that the batched loss
  and gradients equal the supervised-token-weighted mean of each sequence run alone (unpadded), i.e. that
  right padding leaks into no real token.

Run by developers, not CI; deterministic for a given torch / transformers / peft version and thread count
(`--threads`, default 2, which wrote the committed files; other counts change a few vision gradients in
their last bits, about 1e-7 relative):

    python scripts/make_lora_grad_fixtures.py [--out model/tests/fixtures/lora/grad] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_fixtures as mf  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CKPT = REPO_ROOT / "model/tests/fixtures/tiny-qwen2_5_vl"
IMAGE_TOKEN_ID = 262
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SUPERVISED = 8
SEED = 3

ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ADAMW_STEPS = 5

# Sequence 1 of the batch fixture: one image, a different question and an answer; its last tokens supervised.
SECOND_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>Press OK.<|im_end|>\n<|im_start|>assistant\nOK 42<|im_end|>"
)
SECOND_SUPERVISED = 5
BATCH_RTOL = 1e-5


def hub_module(name: str) -> str:
    """PEFT parameter name -> hub-layout module name (what model/src/lora.rs calls a linear)."""
    name = name.removeprefix("base_model.model.")
    for half in (".lora_A.default.weight", ".lora_B.default.weight"):
        name = name.replace(half, "")
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    elif name.startswith("model.visual."):
        name = "visual." + name.removeprefix("model.visual.")
    return name


def lora_key(name: str) -> str:
    """PEFT parameter name -> fixture key `<hub module name>.lora_A|lora_B`."""
    half = "lora_A" if "lora_A" in name else "lora_B"
    return f"{hub_module(name)}.{half}"


# --------------------------------------------------------------------------------------------
# inputs


def model_inputs(ids: torch.Tensor, pixel_values: torch.Tensor, grid: torch.Tensor, attention_mask=None) -> dict:
    """Keyword arguments for the model; mm_token_type_ids makes transformers 5 build MRoPE positions."""
    inputs = dict(
        input_ids=ids,
        pixel_values=pixel_values,
        image_grid_thw=grid,
        mm_token_type_ids=(ids == IMAGE_TOKEN_ID).to(torch.int64),
    )
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    return inputs


def supervise_last(ids: torch.Tensor, n: int) -> torch.Tensor:
    """labels = ids on the last n tokens, -100 elsewhere."""
    labels = torch.full_like(ids, -100)
    labels[:, -n:] = ids[:, -n:]
    return labels


def load_case() -> tuple[dict, torch.Tensor]:
    """The fixture case (batch of 1) and its labels."""
    case = load_file(str(CKPT / "case.safetensors"))
    ids = case["input_ids"]
    return model_inputs(ids, case["pixel_values"], case["image_grid_thw"]), supervise_last(ids, SUPERVISED)


def make_image_c() -> Image.Image:
    """140x112 'dialog': a soft gradient, a title bar, two text stripes and an OK button, mild noise."""
    w, h = 140, 112
    rng = np.random.default_rng(99)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    arr = np.stack([220 - 60 * y / (h - 1), 210 - 30 * x / (w - 1), 190 + 50 * (x + y) / (w + h - 2)], axis=-1)
    arr += rng.normal(0, 5, size=arr.shape)
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, w - 1, 15], fill=(40, 70, 140))
    d.rectangle([8, 28, 120, 33], fill=(20, 20, 20))
    d.rectangle([8, 42, 96, 47], fill=(20, 20, 20))
    d.rectangle([84, 80, 130, 102], fill=(230, 230, 230), outline=(0, 0, 0))
    d.text((98, 85), "OK", fill=(0, 0, 0))
    return img


def image_processor_from_checkpoint():
    """Qwen2VLImageProcessor with the checkpoint's min / max pixels."""
    prep = json.loads((CKPT / "preprocessor_config.json").read_text())
    return mf.image_processor(prep["min_pixels"], prep["max_pixels"])


def second_sequence() -> tuple[dict, torch.Tensor]:
    """Sequence 1 of the batch (batch of 1, unpadded) and its labels: SECOND_PROMPT over make_image_c()."""
    from tokenizers import Tokenizer

    res = image_processor_from_checkpoint()(images=[make_image_c()], return_tensors="pt")
    grid = res["image_grid_thw"].to(torch.int64)
    n_pads = int(grid.prod(-1).sum()) // 4
    tok = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    ids: list[int] = []
    for i in tok.encode(SECOND_PROMPT, add_special_tokens=False).ids:
        ids.extend([i] * n_pads if i == IMAGE_TOKEN_ID else [i])
    ids_t = torch.tensor([ids], dtype=torch.int64)
    inputs = model_inputs(ids_t, res["pixel_values"].to(torch.float32), grid)
    return inputs, supervise_last(ids_t, SECOND_SUPERVISED)


def pad_id() -> int:
    cfg = json.loads((CKPT / "config.json").read_text())
    pid = cfg.get("text_config", {}).get("pad_token_id", cfg.get("pad_token_id"))
    return 0 if pid is None else int(pid)


def right_pad_batch(seqs: list[tuple[dict, torch.Tensor]]) -> tuple[dict, torch.Tensor]:
    """Batch single sequences: ids right-padded with the pad id, attention_mask 0 and labels -100 there;
    pixel_values and image_grid_thw concatenated in sequence order."""
    T = max(inp["input_ids"].shape[1] for inp, _ in seqs)
    ids = torch.full((len(seqs), T), pad_id(), dtype=torch.int64)
    mask = torch.zeros((len(seqs), T), dtype=torch.int64)
    labels = torch.full((len(seqs), T), -100, dtype=torch.int64)
    for b, (inp, lab) in enumerate(seqs):
        n = inp["input_ids"].shape[1]
        ids[b, :n] = inp["input_ids"][0]
        mask[b, :n] = 1
        labels[b, :n] = lab[0]
    pv = torch.cat([inp["pixel_values"] for inp, _ in seqs])
    grid = torch.cat([inp["image_grid_thw"] for inp, _ in seqs])
    return model_inputs(ids, pv, grid, attention_mask=mask), labels


# --------------------------------------------------------------------------------------------
# model and training


def fresh_lora_model():
    """The tiny checkpoint wrapped in the seeded LoRA adapter (the same weights on every call)."""
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(CKPT), attn_implementation="eager", dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    model.train()  # dropout is 0 and the model has no other dropout: train mode only enables autograd bookkeeping
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def lora_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters (all LoRA), sorted by name."""
    out = []
    for name, p in sorted(model.named_parameters()):
        if not p.requires_grad:
            continue
        assert "lora_" in name, name
        out.append((name, p))
    return out


def loss_and_grads(model, inputs: dict, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One forward/backward from zeroed gradients: the loss and every LoRA gradient by fixture key."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    grads = {}
    for name, p in sorted(model.named_parameters()):
        if not p.requires_grad:
            assert p.grad is None, f"{name} is frozen but has a gradient"
            continue
        assert "lora_" in name, name
        grads[lora_key(name)] = p.grad.detach().clone().contiguous()
    return out.loss.detach().reshape(()).float(), grads


def n_supervised(labels: torch.Tensor) -> int:
    """Tokens the loss averages over: supervised labels after transformers' shift (position 0 predicts nothing)."""
    return int((labels[:, 1:] != -100).sum())


# --------------------------------------------------------------------------------------------
# fixture files


def save_adapter(model, out: Path) -> None:
    model.save_pretrained(str(out / "adapter"))
    cfg_path = out / "adapter" / "adapter_config.json"
    saved = json.loads(cfg_path.read_text())
    saved["base_model_name_or_path"] = "model/tests/fixtures/tiny-qwen2_5_vl"
    saved["target_modules"] = sorted(saved["target_modules"])
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    readme = out / "adapter" / "README.md"
    if readme.exists():
        readme.unlink()


def write_grads(out: Path) -> float:
    """adapter/ and grads.safetensors; returns the loss."""
    inputs, labels = load_case()
    model = fresh_lora_model()
    loss, grads = loss_and_grads(model, inputs, labels)
    tensors = {"loss": loss, "labels_mask": (labels[0] != -100).to(torch.uint8), **grads}
    n_vis = sum(k.startswith("visual.") for k in grads)
    save_adapter(model, out)
    save_file(tensors, str(out / "grads.safetensors"))
    print(f"grads: loss {loss.item():.6f}; {len(grads)} LoRA gradients ({n_vis} vision)")
    return loss.item()


def write_adamw(out: Path, grad_loss: float) -> None:
    """adamw.safetensors: ADAMW_STEPS AdamW steps on the case from the seeded adapter."""
    inputs, labels = load_case()
    model = fresh_lora_model()
    params = lora_params(model)
    opt = torch.optim.AdamW(
        [p for _, p in params],
        lr=ADAMW["lr"],
        betas=(ADAMW["beta1"], ADAMW["beta2"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )
    losses = []
    for _ in range(ADAMW_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert torch.tensor(losses[0], dtype=torch.float32).item() == grad_loss, (losses[0], grad_loss)
    tensors = {"losses": torch.tensor(losses, dtype=torch.float32)}
    tensors.update({k: torch.tensor(v, dtype=torch.float64) for k, v in ADAMW.items()})
    for name, p in params:
        tensors[f"final.{lora_key(name)}"] = p.detach().clone().contiguous()
    save_file(tensors, str(out / "adamw.safetensors"))
    print(f"adamw: losses {[round(x, 6) for x in losses]}; {len(params)} final LoRA weights")


def check_batch_against_singles(model, seqs, batch_loss: float, batch_grads: dict) -> None:
    """The batched loss / gradients must be the supervised-token-weighted mean of each sequence alone."""
    counts = [n_supervised(lab) for _, lab in seqs]
    total = sum(counts)
    want_loss = 0.0
    want_grads = {k: torch.zeros_like(v) for k, v in batch_grads.items()}
    for (inp, lab), n in zip(seqs, counts):
        loss, grads = loss_and_grads(model, inp, lab)
        print(f"  alone: T={inp['input_ids'].shape[1]} supervised={n} loss {loss.item():.7f}")
        want_loss += loss.item() * n / total
        for k, g in grads.items():
            want_grads[k] += g * (n / total)
    rel = abs(batch_loss - want_loss) / abs(want_loss)
    print(f"  batched loss {batch_loss:.7f} vs weighted mean of singles {want_loss:.7f}: relative diff {rel:.3e}")
    assert rel <= BATCH_RTOL, "right padding changes the loss"
    worst = max(float((batch_grads[k] - g).abs().max() / g.abs().max()) for k, g in want_grads.items())
    print(f"  gradients: largest |batched - weighted singles| / max magnitude {worst:.3e}")
    assert worst <= 1e-4, "right padding changes the gradients"


def write_batch(out: Path) -> None:
    """batch.safetensors: one forward/backward on the right-padded two-sequence batch."""
    seqs = [load_case(), second_sequence()]
    lens = [inp["input_ids"].shape[1] for inp, _ in seqs]
    grids = [inp["image_grid_thw"].tolist() for inp, _ in seqs]
    assert lens[1] <= lens[0] - 3, lens
    assert grids[1][0] not in grids[0], grids
    inputs, labels = right_pad_batch(seqs)
    model = fresh_lora_model()
    loss, grads = loss_and_grads(model, inputs, labels)
    print(f"batch: T={inputs['input_ids'].shape[1]} lengths {lens} grids {grids} P={inputs['pixel_values'].shape[0]}")
    print(f"  batched loss {loss.item():.7f} over {n_supervised(labels)} supervised tokens")
    check_batch_against_singles(model, seqs, loss.item(), grads)
    tensors = {
        "input_ids": inputs["input_ids"],
        "attention_mask": inputs["attention_mask"],
        "labels_mask": (labels != -100).to(torch.uint8),
        "pixel_values": inputs["pixel_values"].contiguous(),
        "image_grid_thw": inputs["image_grid_thw"],
        "loss": loss,
        **grads,
    }
    save_file(tensors, str(out / "batch.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "model/tests/fixtures/lora/grad")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (the summation order)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    grad_loss = write_grads(args.out)
    write_adamw(args.out, grad_loss)
    write_batch(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
