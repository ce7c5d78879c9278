#!/usr/bin/env python3
"""Check that LoRA adapters and merged checkpoints travel between askgui and PEFT / transformers.

Everything is loaded as a user would, with defaults: `PeftModel.from_pretrained(base, DIR)` and
`from_pretrained(DIR)`. On a Qwen2.5-VL or Qwen3-VL checkpoint (default: the tiny Qwen2.5-VL test fixture;
the family is config.json's model_type), with the family's text and vision-tower targets (FAMILY_TARGETS):

1. PEFT -> askgui: a PEFT LoRA with seeded random A and B, `save_pretrained`; askgui's `generate` example
   runs it (`--adapter DIR --dump FILE`) and PEFT runs the dumped input_ids / pixel_values / image_grid_thw.
2. askgui -> PEFT: `askgui-train` (default flags, a few steps on synthetic episodes from `askgui-data
   synth`) writes a checkpoint; PEFT loads that folder as it is. Its model card must name the layout. As a
   control, `convert-adapter --to hub` gives the transformers-4 layout, whose load report is printed.
3. merge -> transformers: `askgui-train merge` of that adapter, loaded as a plain model, must give PEFT's
   logits of base + adapter (and a load report with no missing or unexpected weights).

Each passes when PEFT reports no missing and no unexpected adapter keys (and transformers no load-report
warning), the logits agree within 1e-4 of their largest magnitude, the adapter moves them, and the
vision-tower LoRA is applied: PEFT with the vision lora_B zeroed must differ from askgui by more than ten
times the tolerance. With `--record FILE` (scripts/checks/peft_interop.json in the repo) a passing run
writes the versions, the trainer's flags and default layout, and the adapter keys PEFT expects;
train/tests/peft_interop_record.rs checks the trainer against that file. That file is the default
checkpoint's record: run other checkpoints without --record.

    python scripts/checks/peft_interop.py [--model DIR] [--bin-dir target/debug | --release] \
        [--record scripts/checks/peft_interop.json] [--keep]
    python scripts/checks/peft_interop.py --model model/tests/fixtures/tiny-qwen3_vl --bin-dir target/debug

The askgui programs run through `cargo run` (which builds them) unless --bin-dir names a folder holding
`askgui-train`, `askgui-data` and `examples/generate`. The checkpoint needs a tokenizer.json. Needs torch,
transformers (5.x), peft, safetensors, pillow, numpy. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_merged

TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The LoRA targets of each family (config.json's model_type); the model class is the fixtures' table
# (make_fixtures.FAMILY_CLASSES, through check_merged.model_class). Every family takes the same inputs,
# mm_token_type_ids included (model_inputs). Qwen3-VL's `linear_fc1/2` are the vision blocks' MLP and
# also reach the main merger and the DeepStack mergers (`deepstack_merger_list.N.linear_fc1/2`).
FAMILY_TARGETS = {
    "qwen2_5_vl": [*TEXT_TARGETS, "qkv", "attn.proj"],
    "qwen3_vl": [*TEXT_TARGETS, "qkv", "attn.proj", "linear_fc1", "linear_fc2"],
}
RTOL = 1e-4
SEED = 5
PROMPT = "Where is the search box?"


def train_flags(targets: list[str]) -> list[str]:
    """askgui-train's flags besides --model, --data and --output-dir: defaults otherwise (the key layout
    included), small enough to run in seconds on the tiny fixture."""
    return ["--max-pixels", "12544", "--max-steps", "3", "--grad-accum", "1", "--warmup-steps", "0",
            "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", ",".join(targets),
            "--eval-episodes", "0", "--progress", "false"]


def family_targets(ckpt: Path) -> list[str]:
    """The LoRA targets of the checkpoint's family; a clear error for a family the check does not know."""
    model_type = json.loads((ckpt / "config.json").read_text()).get("model_type")
    if model_type not in FAMILY_TARGETS:
        raise SystemExit(f"{ckpt}/config.json: model_type {model_type!r} is not one this check runs "
                         f"({', '.join(FAMILY_TARGETS)}); add its LoRA targets to FAMILY_TARGETS")
    return FAMILY_TARGETS[model_type]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "model/tests/fixtures/tiny-qwen2_5_vl")
    ap.add_argument("--image", type=Path, default=None, help="default: a generated PNG in the work dir")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--cargo", default="cargo", help="cargo executable for `cargo run`")
    ap.add_argument("--release", action="store_true", help="cargo run --release")
    ap.add_argument("--bin-dir", type=Path, default=None,
                    help="run prebuilt programs from here (askgui-train, askgui-data, examples/generate)")
    ap.add_argument("--record", type=Path, default=None, help="on success, write the record JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir and print its path")
    return ap.parse_args()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# askgui programs


def program_cmd(args, kind: str, name: str, argv: list[str]) -> list[str]:
    """Command line of an askgui binary (kind "bin", package name) or model example (kind "example")."""
    if args.bin_dir is not None:
        path = args.bin_dir / "examples" / name if kind == "example" else args.bin_dir / name
        return [str(path), *argv]
    profile = ["--release"] if args.release else []
    target = ["-p", "askgui-model", "--example", name] if kind == "example" else ["-p", name, "--bin", name]
    return [args.cargo, "run", *profile, "-q", *target, "--", *argv]


def run(args, kind: str, name: str, argv: list[str]) -> None:
    cmd = program_cmd(args, kind, name, argv)
    log("$ " + " ".join(cmd))
    # stderr passes through (cargo's build progress, the program's log); stdout goes to our stderr.
    res = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    if res.stdout.strip():
        log(res.stdout.strip())
    if res.returncode != 0:
        raise RuntimeError(f"{name} exited with {res.returncode} (its error is printed above)")


def askgui_dump(args, image: Path, adapter: Path, out: Path) -> dict:
    """askgui's prompt inputs and logits with the adapter applied (generate --dump)."""
    from safetensors.torch import load_file

    run(args, "example", "generate",
        ["--model", str(args.model), "--image", str(image), "--prompt", args.prompt, "--max-new-tokens", "1",
         "--adapter", str(adapter), "--dump", str(out)])
    return load_file(str(out))


def card_layout(adapter: Path) -> str | None:
    """The key layout the model card (README.md) records, from its front matter."""
    card = adapter / "README.md"
    if not card.is_file():
        return None
    for line in card.read_text().split("\n---", 1)[0].splitlines():
        if line.startswith("askgui_key_layout:"):
            return line.split(":", 1)[1].strip()
    return None


# --------------------------------------------------------------------------------------------
# PEFT side


def load_base(ckpt: Path):
    """The checkpoint as its family's transformers model, f32 with eager attention."""
    from check_merged import load

    return load(ckpt)


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


def peft_adapter(ckpt: Path, targets: list[str], out: Path) -> None:
    """Direction 1's adapter: a fresh PEFT LoRA with random A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(load_base(ckpt), cfg)
    randomize_lora(model, SEED)
    model.save_pretrained(str(out))


def peft_load(ckpt: Path, adapter: Path):
    """`PeftModel.from_pretrained(base, adapter)` with defaults, and its load report: the missing and
    unexpected adapter keys (from PEFT's own `load_adapter` result) and PEFT's warnings."""
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_base(ckpt), str(adapter))
        result = model.load_adapter(str(adapter), adapter_name="report")
    model.set_adapter("default")
    model.delete_adapter("report")
    # Deprecation notices of the libraries are not about the adapter.
    peft_warnings = [str(w.message) for w in caught if not issubclass(w.category, (FutureWarning, DeprecationWarning))]
    report = {"missing": len(result.missing_keys), "unexpected": len(result.unexpected_keys),
              "warnings": len(peft_warnings)}
    return model.eval(), report, peft_warnings


def load_peft_checked(ckpt: Path, adapter: Path):
    """peft_load, failing on any missing or unexpected adapter key, on a PEFT warning, or on a file whose
    tensors are not what PEFT holds."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model, report, peft_warnings = peft_load(ckpt, adapter)
    if report["missing"] or report["unexpected"] or peft_warnings:
        raise RuntimeError(f"PEFT's load report: {report}; {peft_warnings[:1]}")
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    expected = get_peft_model_state_dict(model)
    if sorted(saved) != sorted(expected):
        raise RuntimeError(f"adapter keys differ from PEFT's: {sorted(set(saved) ^ set(expected))[:5]}")
    for k, v in expected.items():
        if not torch.equal(v, saved[k].to(v.dtype)):
            raise RuntimeError(f"{k}: PEFT holds different values than the file")
    return model, report, sorted(expected)


def model_inputs(dump: dict, image_token_id: int) -> dict:
    ids = dump["input_ids"]
    return dict(input_ids=ids, pixel_values=dump["pixel_values"], image_grid_thw=dump["image_grid_thw"],
                mm_token_type_ids=(ids == image_token_id).to(torch.int64), use_cache=False)


@torch.no_grad()
def logits_of(model, dump: dict) -> torch.Tensor:
    return model(**model_inputs(dump, model.config.image_token_id)).logits[0].float()


@contextlib.contextmanager
def vision_lora_off(model):
    """Zeroes the vision tower's lora_B (restored afterwards): PEFT's logits without the vision LoRA."""
    saved = [(p, p.detach().clone()) for n, p in model.named_parameters() if "lora_B" in n and ".visual." in n]
    if not saved:
        raise RuntimeError("the adapter holds no vision-tower LoRA")
    with torch.no_grad():
        for p, _ in saved:
            p.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in saved:
                p.copy_(v)


# --------------------------------------------------------------------------------------------
# comparison


def compare(name: str, got: torch.Tensor, peft_model, dump: dict, report: dict) -> dict:
    """One summary line and the numbers: `got` against PEFT with the adapter, without it, and without its
    vision-tower part. Raises when a check fails."""
    want = logits_of(peft_model, dump)
    with peft_model.disable_adapter():
        base = logits_of(peft_model, dump)
    with vision_lora_off(peft_model):
        no_vision = logits_of(peft_model, dump)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(want.abs().max())
    res = dict(report, tokens=int(got.shape[0]), max_abs_diff=float((got - want).abs().max()),
               limit=RTOL * scale, adapter_effect=float((got - base).abs().max()),
               vision_lora_effect=float((got - no_vision).abs().max()))
    checks = {"logits": res["max_abs_diff"] <= res["limit"], "adapter moves logits": res["adapter_effect"] > 10 * res["limit"],
              "vision LoRA applied": res["vision_lora_effect"] > 10 * res["limit"]}
    failed = [k for k, ok in checks.items() if not ok]
    print(f"{name}: {'PASS' if not failed else 'FAIL ' + ', '.join(failed)} T={res['tokens']} "
          f"load report {report}; max|askgui - peft| {res['max_abs_diff']:.3e} (limit {res['limit']:.3e} = "
          f"{RTOL:g} x max|logit| {scale:.4f}); adapter effect {res['adapter_effect']:.3e}; vision LoRA effect "
          f"{res['vision_lora_effect']:.3e}", flush=True)
    if failed:
        raise RuntimeError(f"{name}: {', '.join(failed)}")
    return res


def default_image(work: Path) -> Path:
    import make_fixtures as mf

    path = work / "image.png"
    mf.make_image_a().save(path)
    return path


def peft_to_askgui(args, work: Path, image: Path, record: dict) -> None:
    adapter = work / "peft_adapter"
    peft_adapter(args.model, record["targets"], adapter)
    dump = askgui_dump(args, image, adapter, work / "dump_peft_adapter.safetensors")
    model, report, _ = load_peft_checked(args.model, adapter)
    record["results"]["peft_to_askgui"] = compare("PEFT -> askgui", dump["logits"].float(), model, dump, report)


def askgui_to_peft(args, work: Path, image: Path, record: dict) -> None:
    data = work / "data"
    run(args, "bin", "askgui-data", ["synth", "--out", str(data), "--episodes", "4", "--width", "224",
                                     "--height", "400", "--split", "1:0:0", "--seed", str(SEED)])
    out = work / "run"
    run(args, "bin", "askgui-train", ["--model", str(args.model), "--data", str(data / "train.jsonl"),
                                      "--output-dir", str(out), *record["trainer_flags"]])
    adapter = sorted(out.glob("checkpoint-*"))[-1]
    layout = card_layout(adapter)
    if layout is None:
        raise RuntimeError(f"{adapter}/README.md does not record the key layout (askgui_key_layout)")
    model, report, keys = load_peft_checked(args.model, adapter)
    dump = askgui_dump(args, image, adapter, work / "dump_askgui_adapter.safetensors")
    record["trainer_default_layout"] = layout
    record["peft_keys"] = keys
    record["results"]["askgui_to_peft"] = compare("askgui -> PEFT", dump["logits"].float(), model, dump, report)

    # Control: the transformers-4 hub layout, which PEFT on transformers 5 does not load.
    hub = work / "hub_adapter"
    run(args, "bin", "askgui-train", ["convert-adapter", "--in", str(adapter), "--out", str(hub), "--to", "hub"])
    _, hub_report, _ = peft_load(args.model, hub)
    print(f"hub layout in PEFT (control): load report {hub_report} of {len(keys)} keys", flush=True)
    record["hub_layout_control"] = hub_report

    # 3. The same adapter merged, as a plain transformers model.
    from check_merged import load_checked

    merged = work / "merged"
    run(args, "bin", "askgui-train", ["merge", "--model", str(args.model), "--adapter", str(adapter), "--out", str(merged)])
    plain, merged_report = load_checked(merged)
    record["results"]["merged"] = compare("merge -> transformers", logits_of(plain, dump), model, dump, merged_report)


def main() -> None:
    import peft
    import transformers

    args = parse_args()
    args.model = args.model.resolve()
    if args.bin_dir is not None:
        args.bin_dir = args.bin_dir.resolve()
    targets = family_targets(args.model)
    work = Path(tempfile.mkdtemp(prefix="peft_interop_"))
    image = args.image.resolve() if args.image else default_image(work)
    rel = args.model.relative_to(REPO_ROOT) if args.model.is_relative_to(REPO_ROOT) else args.model
    record = {"checked": datetime.date.today().isoformat(), "transformers": transformers.__version__,
              "peft": peft.__version__, "torch": torch.__version__, "model": str(rel), "targets": targets,
              "trainer_flags": train_flags(targets), "rtol": RTOL, "results": {}}
    ok = True
    for label, fn in [("PEFT -> askgui", peft_to_askgui), ("askgui -> PEFT", askgui_to_peft)]:
        try:
            fn(args, work, image, record)
        except Exception as e:  # noqa: BLE001 - one summary line per direction, whatever went wrong
            print(f"{label}: FAIL {type(e).__name__}: {e}", flush=True)
            ok = False
    if ok and args.record is not None:
        args.record.write_text(json.dumps(record, indent=1) + "\n")
        log(f"wrote {args.record}")
    if args.keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    logging.basicConfig()
    main()
