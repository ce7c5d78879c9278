#!/usr/bin/env python3
"""Time Qwen2-VL image preprocessing (resize, rescale, normalise, patchify into pixel_values) with
transformers' torchvision image processor on the GPU: the PyTorch side of the tiling benchmark.

Inputs are --batch random uint8 screenshots of one size, given as (H, W, 3) tensors (the layout an image
decoder gives; the processor's permute to (3, H, W) is part of the timed work). Sizes (width x height):
1080x2400 (a phone screen), 1920x1080, 1024x768; each with min_pixels 256*28*28 and max_pixels 1280*28*28
(the GUI-agent setting) and 12845056 (the processor's ceiling). Modes (--modes):

  gpu       tensors already on the device, processed there (device=cuda)
  host      tensors in host (pageable) memory, processed on the device: the copy is in the time
  cpu-fast  the same torchvision processor on the CPU, for reference
  cpu-pil   the PIL / numpy processor on the CPU, ONE image (--batch is ignored), for reference

A batch's time is wall clock between two synchronizes, median of --iters after --warmup (CPU modes:
--cpu-iters, one warm-up). For each size the gpu / host / cpu-fast pixel_values of the first image are
compared with cpu-pil's (when both ran): the two resize implementations differ, so the mean / max absolute
difference is reported, not asserted. transformers 5.x names: see image_processors.py.

    python scripts/gpu/bench_torch_tiling.py [--device cuda] [--batch 8] [--iters 10] \
        [--modes gpu,host,cpu-fast,cpu-pil] [--max-pixels 1003520,12845056] [--min-pixels 200704]
    python scripts/gpu/bench_torch_tiling.py --tiny --device cpu     # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import image_processors as ip  # noqa: E402
from timing import emit, environment, finish, guarded, log, peak_memory, reset_peak_memory, resolve_device, summary, time_call  # noqa: E402,E501

SIZES = [(1080, 2400), (1920, 1080), (1024, 768)]  # (width, height)
TINY_SIZES = [(216, 480), (384, 216), (205, 154)]
MODES = ["gpu", "host", "cpu-fast", "cpu-pil"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small images and pixel budgets for a CPU smoke test")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--min-pixels", type=int, default=ip.GUI_MIN_PIXELS)
    ap.add_argument("--max-pixels", default=f"{ip.GUI_MAX_PIXELS},{ip.DEFAULT_MAX_PIXELS}",
                    help="comma-separated max_pixels values")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cpu-iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (want some of {MODES})")
    args.max_pixels = [int(x) for x in args.max_pixels.split(",")]
    args.sizes = SIZES
    if args.tiny:
        args.sizes = TINY_SIZES
        args.batch = min(args.batch, 2)
        args.min_pixels = 56 * 56
        args.max_pixels = [64 * 28 * 28, 256 * 28 * 28]
        args.warmup, args.iters, args.cpu_iters = 1, 2, 1
    return args


def diff_vs(ref: torch.Tensor | None, pv: torch.Tensor, patches: int) -> dict:
    """Mean / max |pv - ref| over the first image's patches (normalised pixel units)."""
    if ref is None:
        return {}
    a = pv[:patches].float().cpu()
    if a.shape != ref.shape:
        return dict(pixel_values_vs_pil_shape_mismatch=[list(a.shape), list(ref.shape)])
    d = (a - ref.float()).abs()
    return dict(pixel_values_vs_pil_mean_abs_diff=round(float(d.mean()), 6),
                pixel_values_vs_pil_max_abs_diff=round(float(d.max()), 6))


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    env = environment(device)
    fast_cls, fast_name = ip.fast_class()
    pil_cls, pil_name = ip.pil_class()
    log(f"image processors: torchvision {fast_name if fast_cls else 'MISSING (' + fast_name + ')'}, "
        f"PIL {pil_name if pil_cls else 'MISSING (' + pil_name + ')'}; device {env['device_name']} ({device})")

    for width, height in args.sizes:
        screens = ip.random_screens(args.batch, width, height, args.seed)  # (N, H, W, 3) uint8, host
        on_device = screens.to(device)
        for max_pixels in args.max_pixels:
            pil_ref = None  # first image's pixel_values from the PIL processor
            for mode in sorted(args.modes, key=lambda m: m != "cpu-pil"):  # cpu-pil first: it is the reference
                n = 1 if mode == "cpu-pil" else args.batch
                run_device = device if mode in ("gpu", "host") else torch.device("cpu")
                rec = dict(
                    bench="tiling", name=f"{mode}-{width}x{height}-max{max_pixels}", mode=mode,
                    image_width=width, image_height=height, batch=n, min_pixels=args.min_pixels,
                    max_pixels=max_pixels, input="uint8 (H, W, 3) " + ("PIL.Image" if mode == "cpu-pil" else "tensor"),
                    input_device=str(device if mode == "gpu" else "cpu"), process_device=str(run_device), **env,
                )
                with guarded(rec):
                    if mode == "cpu-pil":
                        if pil_cls is None:
                            raise RuntimeError(f"no PIL Qwen2-VL image processor: {pil_name}")
                        proc, rec["processor_class"] = ip.make(pil_cls, args.min_pixels, max_pixels), pil_name
                        arrays = [screens[0].numpy()]
                        call = lambda: ip.run_pil(proc, arrays)  # noqa: E731
                    else:
                        if fast_cls is None:
                            raise RuntimeError(f"no torchvision Qwen2-VL image processor: {fast_name}")
                        proc, rec["processor_class"] = ip.make(fast_cls, args.min_pixels, max_pixels), fast_name
                        images = list(on_device if mode == "gpu" else screens)  # N tensors (H, W, 3)
                        call = lambda: ip.run_fast(proc, images, run_device)  # noqa: E731
                    cpu_mode = mode.startswith("cpu")
                    reset_peak_memory(device)
                    times = time_call(call, run_device, 1 if cpu_mode else args.warmup,
                                      args.cpu_iters if cpu_mode else args.iters, wall=True)
                    out = call()
                    pv, grid = out["pixel_values"], out["image_grid_thw"]
                    t, gh, gw = (int(x) for x in grid[0].tolist())
                    patches = t * gh * gw
                    if mode == "cpu-pil":
                        pil_ref = pv[:patches].float().cpu()
                    timed = summary("batch", times)
                    rec.update(
                        **timed,
                        ms_per_image=round(timed["batch_ms"] / n, 4),
                        screenshots_per_s=round(n / (timed["batch_ms"] * 1e-3), 2),
                        pixel_values_shape=list(pv.shape),
                        pixel_values_dtype=str(pv.dtype).removeprefix("torch."),
                        output_device=str(pv.device),
                        image_grid_thw=[t, gh, gw],
                        patches_per_image=patches,
                        visual_tokens_per_image=patches // 4,  # merge_size 2 x 2
                        resized_height=gh * 14,
                        resized_width=gw * 14,
                        **(peak_memory(device) if not cpu_mode else {}),
                        **(diff_vs(pil_ref, pv, patches) if mode != "cpu-pil" else {}),
                    )
                    log(f"{rec['name']:34s} {rec['batch_ms']:9.3f} ms/batch of {n}  {rec['screenshots_per_s']:9.1f} "
                        f"shots/s  pixel_values {rec['pixel_values_shape']} grid {rec['image_grid_thw']}"
                        + (f"  vs PIL mean|d| {rec['pixel_values_vs_pil_mean_abs_diff']}"
                           if "pixel_values_vs_pil_mean_abs_diff" in rec else ""))
                    emit(rec)
                    del out, pv
        del on_device
    finish()


if __name__ == "__main__":
    main()
