"""Shared plumbing for the PyTorch GPU benchmarks in scripts/gpu: timing, memory, versions, JSON output.

Key choice: one JSON object per measurement on stdout (everything human goes to stderr), so a run's stdout
is a JSON-lines file the integrator can join with the Rust benchmarks' lines on `bench` + `name`. On CUDA a
measurement is timed with CUDA events around each call (after a synchronize, so queued work from the
previous call is not counted) and reported as the median; on CPU with perf_counter. Every measurement runs
inside `guarded`, which turns an exception into a JSON line with an `error` key and lets the script go on:
these scripts run first time on a borrowed GPU with no chance to debug there.

Not run directly; imported by the bench_torch_*.py scripts next to it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Callable

import torch

# No network on the GPU machine: anything that would ask the model hub fails at once instead of retrying.
# Set before transformers is first imported (this module imports it only inside environment()).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    """One measurement: one JSON line on stdout."""
    print(json.dumps(record, default=str), flush=True)


def resolve_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available in this torch ({torch.__version__})")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def environment(device: torch.device) -> dict:
    """Versions and the device name, repeated in every JSON line so lines stand alone."""
    env = dict(torch=torch.__version__, python=platform.python_version(), device_type=device.type)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object], device: torch.device, warmup: int, iters: int, wall: bool = False
) -> list[float]:
    """Milliseconds of each of `iters` calls of fn, after `warmup` untimed calls. CUDA events unless `wall`
    (perf_counter between two synchronizes: for calls with real host-side work, like image processors)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda" and not wall:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            clock = WallClock(device)
            fn()
            times.append(clock.ms())
    return times


class WallClock:
    """perf_counter with a device synchronize at every reading: for multi-phase steps (forward / backward /
    optimizer) whose phases each take far longer than one synchronize."""

    def __init__(self, device: torch.device):
        self.device = device
        sync(device)
        self.t0 = time.perf_counter()

    def ms(self) -> float:
        sync(self.device)
        return (time.perf_counter() - self.t0) * 1e3


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def summary(prefix: str, times_ms: list[float]) -> dict:
    """`{prefix}_ms` (median) plus min / max / every sample, in ms to 4 decimals."""
    return {
        f"{prefix}_ms": round(median(times_ms), 4),
        f"{prefix}_ms_min": round(min(times_ms), 4),
        f"{prefix}_ms_max": round(max(times_ms), 4),
        f"{prefix}_ms_all": [round(t, 4) for t in times_ms],
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """Peak allocated / reserved bytes since the last reset (null on CPU, where torch does not count)."""
    if device.type != "cuda":
        return dict(peak_mem_allocated_bytes=None, peak_mem_reserved_bytes=None)
    torch.cuda.synchronize(device)
    return dict(
        peak_mem_allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
        peak_mem_reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
    )


def allocated_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


FAILED: list[str] = []


@contextmanager
def guarded(record: dict):
    """Run one measurement; on an exception emit `record` with `error` (type, message, last frames) instead
    of dying, and free cached CUDA memory so the next measurement starts clean."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - report and go on: the GPU run cannot be debugged interactively
        tb = traceback.format_exc(limit=6)
        log(f"FAILED {record.get('name', '?')}: {type(e).__name__}: {e}\n{tb}")
        FAILED.append(str(record.get("name", "?")))
        emit(dict(record, error=f"{type(e).__name__}: {e}"[:2000], traceback=tb[-3000:]))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def finish() -> None:
    """Exit non-zero when any guarded measurement failed (after all of them ran)."""
    if FAILED:
        log(f"{len(FAILED)} measurement(s) failed: {', '.join(FAILED)}")
        raise SystemExit(1)
