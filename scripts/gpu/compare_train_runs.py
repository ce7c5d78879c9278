"""Compares two askgui-train output folders step by step: the loss and gradient norm of every step
(metrics.jsonl) and the final adapters (the newest checkpoint's adapter_model.safetensors).

    python3 scripts/gpu/compare_train_runs.py REF_DIR RUN_DIR --rtol 1e-4 [--label NAME]

Exits 1 when a step's loss or gradient norm differs from the reference's by more than `--rtol` (relative),
or when the runs logged different steps. The adapters' relative L2 difference is printed, not checked:
AdamW's first steps divide each gradient by its own magnitude, so an element whose gradient is ~0 can move
by the full learning rate either way, and that difference says nothing about the kernels.
What it is for: the same training on the CPU and on a GPU (f32, bf16, packed) must tell the same story.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def adapter(run: Path) -> dict:
    from safetensors.numpy import load_file

    ckpts = sorted(run.glob("checkpoint-*/adapter_model.safetensors"))
    return load_file(str(ckpts[-1])) if ckpts else {}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", type=Path)
    ap.add_argument("run", type=Path)
    ap.add_argument("--rtol", type=float, required=True, help="largest relative loss / grad-norm difference")
    ap.add_argument("--label", default=None)
    a = ap.parse_args()
    label = a.label or f"{a.run.name} vs {a.ref.name}"
    ref, run = steps(a.ref), steps(a.run)
    if [s["step"] for s in ref] != [s["step"] for s in run] or not ref:
        print(f"{label}: FAIL: steps differ: {[s['step'] for s in ref]} vs {[s['step'] for s in run]}")
        return 1
    worst = 0.0
    for r, s in zip(ref, run):
        dl, dg = rel(r["loss"], s["loss"]), rel(r["grad_norm"], s["grad_norm"])
        worst = max(worst, dl, dg)
        print(f"{label}: step {s['step']}: loss {r['loss']:.7f} vs {s['loss']:.7f} (rel {dl:.2e}), "
              f"grad_norm {r['grad_norm']:.6f} vs {s['grad_norm']:.6f} (rel {dg:.2e}), "
              f"tokens/s {r.get('tokens_per_s', 0):.0f} vs {s.get('tokens_per_s', 0):.0f}")
    ra, sa = adapter(a.ref), adapter(a.run)
    if ra and ra.keys() == sa.keys():
        import numpy as np

        num = sum(float(np.sum((ra[k].astype(np.float64) - sa[k].astype(np.float64)) ** 2)) for k in ra)
        den = sum(float(np.sum(ra[k].astype(np.float64) ** 2)) for k in ra)
        print(f"{label}: final adapter rel L2 difference {np.sqrt(num / max(den, 1e-30)):.2e} over {len(ra)} tensors")
    else:
        print(f"{label}: adapters not compared (missing or different keys)")
    ok = worst <= a.rtol
    print(f"{label}: {'PASS' if ok else 'FAIL'}: worst relative difference {worst:.2e} (rtol {a.rtol:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
