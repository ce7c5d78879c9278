#!/usr/bin/env python3
"""Check a checkpoint written by `askgui-train merge` with Hugging Face transformers and PEFT.

Loads the merged folder as a plain model of its family (config.json's model_type, through the fixtures' table
of transformers classes: Qwen2-VL, Qwen2.5-VL or Qwen3-VL; no PEFT) and fails on any entry of transformers'
load report (missing, unexpected or mismatched weights, or a warning logged while loading). Then loads the
base with the adapter through PEFT (unmerged), runs both on the same prompt with an image, and prints the
largest logit difference relative to the largest logit magnitude. It fails when that exceeds `--rtol` (default
1e-4: both run in f32; merging only changes the summation order). `scripts/checks/peft_interop.py` runs the
same load check on a fresh merge.

The prompt is a `case.safetensors` (input_ids, pixel_values, image_grid_thw), by default the tiny test
fixture's case. Not run by the tests (it needs torch, transformers 5 and peft):

    cargo run -p askgui-train -- merge --model model/tests/fixtures/tiny-qwen2_5_vl \\
        --adapter model/tests/fixtures/lora/tiny-qwen2_5_vl-peft --out /tmp/merged
    python scripts/checks/check_merged.py --merged /tmp/merged --base model/tests/fixtures/tiny-qwen2_5_vl \\
        --adapter model/tests/fixtures/lora/tiny-qwen2_5_vl-peft
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts" / "fixtures"))  # make_fixtures: the family classes
CASE = REPO_ROOT / "model/tests/fixtures/tiny-qwen2_5_vl/case.safetensors"


def model_class(ckpt: Path):
    """The transformers model class of the checkpoint's family (config.json's model_type)."""
    from make_fixtures import FAMILY_CLASSES, family_class

    model_type = json.loads((ckpt / "config.json").read_text()).get("model_type")
    if model_type not in FAMILY_CLASSES:
        raise ValueError(f"{ckpt}/config.json: model_type {model_type!r} is not a family the fixtures know "
                         f"({', '.join(FAMILY_CLASSES)})")
    return family_class(model_type, "model")


def load(ckpt: Path):
    cls = model_class(ckpt)
    return cls.from_pretrained(str(ckpt), attn_implementation="eager", dtype=torch.float32).eval()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def load_checked(ckpt: Path):
    """The merged folder as a plain model, and its load report as counts; raises when transformers reports
    a missing, unexpected or mismatched weight, or logs a warning while loading (its LOAD REPORT table)."""
    handler = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, info = model_class(ckpt).from_pretrained(
            str(ckpt), attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    report = {k: len(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    report["warnings"] = len(handler.records)
    if any(report.values()):
        logged = [r.getMessage()[:500] for r in handler.records]
        raise RuntimeError(f"{ckpt}: transformers' load report {report}: {info}; logged {logged}")
    return model.eval(), report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--merged", type=Path, required=True)
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, required=True)
    ap.add_argument("--case", type=Path, default=CASE)
    ap.add_argument("--rtol", type=float, default=1e-4)
    args = ap.parse_args()

    case = load_file(str(args.case))
    image_token_id = json.loads((args.base / "config.json").read_text())["image_token_id"]
    inputs = dict(
        input_ids=case["input_ids"],
        pixel_values=case["pixel_values"],
        image_grid_thw=case["image_grid_thw"],
        mm_token_type_ids=(case["input_ids"] == image_token_id).to(torch.int64),
    )
    with torch.no_grad():
        base = load(args.base)
        plain = base(**inputs).logits[0].float()
        peft = PeftModel.from_pretrained(base, str(args.adapter)).eval()
        want = peft(**inputs).logits[0].float()
        merged, report = load_checked(args.merged)
        got = merged(**inputs).logits[0].float()
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    effect = float((want - plain).abs().max())
    print(f"load report of the merged folder: {report}")
    print(f"merged (transformers, no PEFT) vs base + adapter (PEFT): max abs diff {diff:.3e}, "
          f"{diff / scale:.3e} of the logit scale {scale:.4f}; the adapter moves logits by {effect:.3e}")
    if effect <= 1e-3 * scale:
        print("the adapter barely changes the logits: this comparison says little", file=sys.stderr)
        return 1
    if diff > args.rtol * scale:
        print(f"FAIL: above {args.rtol} of the scale", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
