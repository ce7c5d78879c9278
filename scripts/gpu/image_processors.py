"""The two Qwen2-VL image processors of transformers 5.x, found by what they are rather than by name.

Key choice: transformers renamed these classes across releases. In 4.x `Qwen2VLImageProcessor` was the
PIL / numpy one and `Qwen2VLImageProcessorFast` the torchvision one; in 5.x (checked on 5.17 and 5.23)
`Qwen2VLImageProcessor` is the torchvision one (it takes `device=` and runs on CUDA),
`Qwen2VLImageProcessorPil` the PIL one, and the `Fast` name is a deprecated alias. So a class is picked by
its bases (`TorchvisionBackend` / `BaseImageProcessorFast` versus `PilBackend` / a plain
`BaseImageProcessor`), and a missing one (e.g. torchvision not installed) is reported, not fatal.

Not run directly; imported by bench_torch_tiling.py, bench_torch_generate.py and gui_sample.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

FAST_BASES = {"TorchvisionBackend", "BaseImageProcessorFast"}
PIL_BASES = {"PilBackend"}

# The Qwen2.5-VL GUI-agent setting and the processor's own ceiling (the hub preprocessor_config.json's
# max_pixels for Qwen2.5-VL).
GUI_MIN_PIXELS = 256 * 28 * 28
GUI_MAX_PIXELS = 1280 * 28 * 28
DEFAULT_MAX_PIXELS = 12845056


def _bases(cls) -> set[str]:
    return {b.__name__ for b in getattr(cls, "__mro__", ())}


def _lookup(names: list[str], accept) -> tuple[type | None, str]:
    import transformers

    seen = []
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated `Fast` alias warns on access
            try:
                cls = getattr(transformers, name, None)
            except Exception as e:  # noqa: BLE001 - a lazy import can fail for a missing backend
                seen.append(f"{name}: {type(e).__name__}: {e}")
                continue
        if cls is None:
            seen.append(f"{name}: absent")
        elif accept(_bases(cls)):
            return cls, name
        else:
            seen.append(f"{name}: bases {sorted(_bases(cls))}")
    return None, "; ".join(seen)


def fast_class() -> tuple[type | None, str]:
    """(the torchvision-backed class, its name) or (None, why not)."""
    return _lookup(["Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"], lambda b: bool(b & FAST_BASES))


def pil_class() -> tuple[type | None, str]:
    """(the PIL / numpy class, its name) or (None, why not)."""
    return _lookup(
        ["Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor"],
        lambda b: bool(b & PIL_BASES) or ("BaseImageProcessor" in b and not b & FAST_BASES),
    )


def make(cls, min_pixels: int, max_pixels: int):
    # Constructor min_pixels / max_pixels are accepted by every 4.x and 5.x release (5.23 deprecates them
    # only as call arguments).
    return cls(min_pixels=min_pixels, max_pixels=max_pixels)


def run_fast(proc, images: list[torch.Tensor], device: torch.device) -> dict:
    """The torchvision processor on uint8 (H, W, 3) tensors; its work and its output stay on `device`."""
    out = proc(images=images, return_tensors="pt", device=str(device))
    return dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])


def run_pil(proc, images: list[np.ndarray]) -> dict:
    """The PIL processor on uint8 (H, W, 3) arrays, converted to PIL images first as a decoder would give."""
    from PIL import Image

    out = proc(images=[Image.fromarray(a, "RGB") for a in images], return_tensors="pt")
    return dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])


def random_screens(n: int, width: int, height: int, seed: int) -> torch.Tensor:
    """(n, height, width, 3) uint8 noise: the processors' cost does not depend on the content."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (n, height, width, 3), dtype=torch.uint8, generator=g)


def process_screens(screens: torch.Tensor, min_pixels: int, max_pixels: int, device: torch.device) -> tuple[dict, str]:
    """pixel_values (float32, on `device`) and image_grid_thw for (n, H, W, 3) uint8 screens: the fast
    processor on `device` when there is one, else the PIL one on the CPU. Returns (outputs, which)."""
    cls, name = fast_class()
    if cls is not None:
        out = run_fast(make(cls, min_pixels, max_pixels), [s for s in screens.to(device)], device)
        return out, f"{name} (torchvision, on {device})"
    pil, pil_name = pil_class()
    if pil is None:
        raise RuntimeError(f"no Qwen2-VL image processor in this transformers: fast: {name}; pil: {pil_name}")
    out = run_pil(make(pil, min_pixels, max_pixels), [s.numpy() for s in screens])
    out["pixel_values"] = out["pixel_values"].to(device)
    return out, f"{pil_name} (PIL, on cpu; no torchvision processor: {name})"
