#!/usr/bin/env python3
"""The training benchmark's table (scripts/gpu/device_run.sh OUT train): askgui-train with its default
settings against transformers + PEFT and PEFT + Liger, as ratios, on the same GPU in one call.

askgui: the median tokens/s of the run's metrics.jsonl steps after the first (warm-up: the first step also
compiles and allocates). PyTorch: the `lora_step` JSON line of bench_torch_lora_step.py (median of its
timed steps). Memory: the GPU's largest used memory sampled by nvidia-smi during each process (`--mem`
files, MiB, CUDA context included on every side), and PyTorch's own max_memory_reserved for reference.
The workloads differ in one way, stated in the output: askgui-train packs its synthetic episodes' samples
(varying lengths), the PyTorch side repeats one sample of a 1080x2400 screenshot and 200 text tokens.

    python3 scripts/gpu/train_summary.py RUN_DIR TORCH_LOG [TORCH_LIGER_LOG] --mem A.mem T.mem [L.mem]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def askgui_tokens_per_s(run: Path) -> tuple[float, int]:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [s["tokens_per_s"] for s in steps if "tokens_per_s" in s]
    if len(rates) < 2:
        raise SystemExit(f"{run}/metrics.jsonl has {len(rates)} steps with tokens_per_s; 2 or more are needed")
    return statistics.median(rates[1:]), len(rates) - 1


def torch_record(log: Path) -> dict | None:
    if not log.exists():
        return None
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{") and '"lora_step"' in line:
            return json.loads(line)
    return None


def mib(path: str | None) -> float | None:
    try:
        return float(Path(path).read_text().split()[0])
    except (TypeError, OSError, ValueError, IndexError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("torch_logs", type=Path, nargs="+")
    ap.add_argument("--mem", nargs="*", default=[], help="peak MiB files: askgui's, then each torch log's")
    args = ap.parse_args()
    ours, n = askgui_tokens_per_s(args.run)
    mems = args.mem + [None] * (1 + len(args.torch_logs) - len(args.mem))
    ours_mib = mib(mems[0])
    print(f"askgui-train defaults: {ours:.0f} tokens/s (median of {n} steps), GPU peak {ours_mib} MiB")
    for log, mem in zip(args.torch_logs, mems[1:]):
        rec = torch_record(log)
        if rec is None or "tokens_per_s" not in rec:
            print(f"{log.name}: no result (see the log)")
            continue
        theirs, their_mib = rec["tokens_per_s"], mib(mem)
        ratio_mem = f"{ours_mib / their_mib:.2f}x" if ours_mib and their_mib else "n/a"
        print(f"{rec.get('name', log.name)}: {theirs:.0f} tokens/s, GPU peak {their_mib} MiB "
              f"(torch reserved {rec.get('peak_mem_reserved_bytes')} B); askgui: {ours / theirs:.2f}x the "
              f"tokens/s at {ratio_mem} the memory")
    print("note: askgui-train packs synthetic 1080x2400 episodes; PyTorch repeats one 1080x2400 + 200-token sample")


if __name__ == "__main__":
    sys.exit(main())
