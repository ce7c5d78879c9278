#!/usr/bin/env python3
"""Check that LoRA adapters travel both ways between PEFT and askgui with the same logits.

askgui (model/) loads PEFT adapters for inference and saves the adapters it trains in PEFT's layout; this
developer-run check exercises both directions on a real Qwen2.5-VL checkpoint directory:

1. PEFT -> askgui: wrap the checkpoint in a PEFT LoRA (r 4, alpha 8, targets q_proj k_proj v_proj o_proj
   gate_proj up_proj down_proj, seeded random non-zero A and B), `save_pretrained` it, run askgui's
   `generate` example with `--adapter DIR --dump FILE` on an image, and run PEFT on exactly the dumped
   input_ids / pixel_values / image_grid_thw. The prompt logits must agree within 1e-4 of their largest
   magnitude, and must differ from the base model's (the adapter has to matter for the check to mean
   anything).
2. askgui -> PEFT: train an adapter with askgui's `lora_step` example (`--steps 3 --save-adapter DIR`),
   load DIR with `PeftModel.from_pretrained` (no missing or unexpected adapter keys allowed), and compare
   the logits as in 1.

The examples run through `cargo run --release` (which builds them) unless --bin-dir names a folder with
prebuilt `generate` / `lora_step` binaries (e.g. target/release/examples). Prints one summary line per
direction; exits non-zero when a direction fails.

    python scripts/checks/peft_interop.py [--model model/tests/fixtures/tiny-qwen2_5_vl] [--image PNG] \
        [--cargo cargo | --bin-dir target/release/examples] [--direction both|1|2] [--keep]

The checkpoint needs a tokenizer.json (generate renders a chat prompt). Needs torch, transformers (5.x),
peft, safetensors, pillow, numpy.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts" / "fixtures"))  # make_fixtures

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RTOL = 1e-4
SEED = 5
PROMPT = "Where is the search box?"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "model/tests/fixtures/tiny-qwen2_5_vl")
    ap.add_argument("--image", type=Path, default=None, help="default: a generated PNG in the work dir")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--cargo", default="cargo", help="cargo executable for `cargo run --release`")
    ap.add_argument("--bin-dir", type=Path, default=None, help="run prebuilt example binaries from here")
    ap.add_argument("--direction", choices=["both", "1", "2"], default="both")
    ap.add_argument("--keep", action="store_true", help="keep the work dir and print its path")
    return ap.parse_args()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# askgui examples


def example_cmd(args, name: str, example_args: list[str]) -> list[str]:
    """Command line for one askgui example: a prebuilt binary, or cargo run --release."""
    if args.bin_dir is not None:
        return [str(args.bin_dir / name), *example_args]
    return [args.cargo, "run", "--release", "-q", "-p", "askgui-model", "--example", name, "--", *example_args]


def run_example(args, name: str, example_args: list[str]) -> None:
    cmd = example_cmd(args, name, example_args)
    log("$ " + " ".join(cmd))
    # stderr passes through (cargo's build progress, the example's own errors); stdout goes to our stderr.
    res = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    if res.stdout.strip():
        log(res.stdout.strip())
    if res.returncode != 0:
        raise RuntimeError(f"{name} exited with {res.returncode} (its error is printed above)")


def askgui_dump(args, image: Path, adapter: Path, out: Path) -> dict:
    """askgui's prompt inputs and logits with the adapter applied (generate --dump)."""
    from safetensors.torch import load_file

    run_example(
        args,
        "generate",
        ["--model", str(args.model), "--image", str(image), "--prompt", args.prompt, "--max-new-tokens", "1",
         "--adapter", str(adapter), "--dump", str(out)],
    )
    return load_file(str(out))


# --------------------------------------------------------------------------------------------
# PEFT side


def load_base(ckpt: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ckpt), attn_implementation="eager", dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def randomize_lora(model, seed: int) -> None:
    """Seeded non-zero A ~ N(0, 1/in) and B ~ N(0, 0.25/r): the update is about as large as the layer's input,
    enough to move the logits well past the tolerance without blowing them up on a large checkpoint."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if "lora_A" in name:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        elif "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 / math.sqrt(p.shape[1]))


def peft_adapter(ckpt: Path, out: Path) -> None:
    """Direction 1's adapter: a fresh PEFT LoRA with random A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(load_base(ckpt), cfg)
    randomize_lora(model, SEED)
    model.save_pretrained(str(out))


def load_peft_checked(ckpt: Path, adapter: Path):
    """PeftModel.from_pretrained, failing on missing adapter keys (PEFT's warning) or on a key set that
    differs from what PEFT itself would save for that config."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_base(ckpt), str(adapter))
    missing = [str(w.message) for w in caught if "missing" in str(w.message).lower()]
    if missing:
        raise RuntimeError(f"PEFT reports missing adapter keys: {missing[0][:1000]}")
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    expected = get_peft_model_state_dict(model)
    only_file = sorted(set(saved) - set(expected))
    only_peft = sorted(set(expected) - set(saved))
    if only_file or only_peft:
        raise RuntimeError(f"adapter keys differ from PEFT's: unexpected {only_file[:5]}, missing {only_peft[:5]}")
    for k, v in expected.items():
        if not torch.equal(v, saved[k].to(v.dtype)):
            raise RuntimeError(f"{k}: PEFT holds different values than the file")
    return model.eval()


@torch.no_grad()
def peft_logits(model, dump: dict, image_token_id: int, adapter: bool) -> torch.Tensor:
    """(T, V) logits on the dumped inputs, with the adapter or with it disabled (the base model)."""
    ids = dump["input_ids"]
    inputs = dict(
        input_ids=ids,
        pixel_values=dump["pixel_values"],
        image_grid_thw=dump["image_grid_thw"],
        mm_token_type_ids=(ids == image_token_id).to(torch.int64),
        use_cache=False,
    )
    if adapter:
        return model(**inputs).logits[0].float()
    with model.disable_adapter():
        return model(**inputs).logits[0].float()


# --------------------------------------------------------------------------------------------
# comparison


def compare(name: str, model, dump: dict, require_effect: bool) -> bool:
    """Print one summary line; True when askgui's logits match PEFT's (and, with require_effect, the adapter
    moves them by more than ten times the tolerance: a freshly trained adapter may move them less)."""
    image_token_id = model.config.image_token_id
    want = peft_logits(model, dump, image_token_id, adapter=True)
    base = peft_logits(model, dump, image_token_id, adapter=False)
    got = dump["logits"].float()
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    vs_base = float((got - base).abs().max())
    weak = vs_base <= 10 * RTOL * scale
    ok = diff <= RTOL * scale and not (require_effect and weak)
    print(
        f"{name}: {'PASS' if ok else 'FAIL'} T={got.shape[0]} max|askgui - peft| {diff:.3e} "
        f"(limit {RTOL * scale:.3e} = {RTOL:g} x max|logit| {scale:.4f}); max|askgui - base| {vs_base:.3e}"
        + (" (the adapter barely moves the logits: a weak check)" if weak else ""),
        flush=True,
    )
    return ok


def default_image(work: Path) -> Path:
    import make_fixtures as mf

    path = work / "image.png"
    mf.make_image_a().save(path)
    return path


def peft_to_askgui(args, work: Path, image: Path) -> bool:
    adapter = work / "peft_adapter"
    peft_adapter(args.model, adapter)
    dump = askgui_dump(args, image, adapter, work / "dump_peft_adapter.safetensors")
    return compare("PEFT -> askgui", load_peft_checked(args.model, adapter), dump, require_effect=True)


def askgui_to_peft(args, work: Path, image: Path) -> bool:
    adapter = work / "askgui_adapter"
    run_example(args, "lora_step", ["--model", str(args.model), "--path", "ops", "--steps", "3", "--save-adapter", str(adapter)])
    model = load_peft_checked(args.model, adapter)
    dump = askgui_dump(args, image, adapter, work / "dump_askgui_adapter.safetensors")
    return compare("askgui -> PEFT", model, dump, require_effect=False)


def run_direction(label: str, fn, args, work: Path, image: Path) -> bool:
    try:
        return fn(args, work, image)
    except Exception as e:  # noqa: BLE001 - one summary line per direction, whatever went wrong
        print(f"{label}: FAIL {type(e).__name__}: {e}", flush=True)
        return False


def main() -> None:
    args = parse_args()
    args.model = args.model.resolve()
    if args.bin_dir is not None:
        args.bin_dir = args.bin_dir.resolve()
    work = Path(tempfile.mkdtemp(prefix="peft_interop_"))
    image = args.image.resolve() if args.image else default_image(work)
    ok = True
    if args.direction in ("both", "1"):
        ok &= run_direction("PEFT -> askgui", peft_to_askgui, args, work, image)
    if args.direction in ("both", "2"):
        ok &= run_direction("askgui -> PEFT", askgui_to_peft, args, work, image)
    if args.keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
