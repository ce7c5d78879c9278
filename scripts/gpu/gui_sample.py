"""A random Qwen2.5-VL-3B-shaped model and one GUI-agent sample, built on the GPU in seconds, and the
checkpoint layout that lets the Rust side run the same step on the same weights and input.

Key choices:
- Real 3B sizes (Qwen/Qwen2.5-VL-3B-Instruct config.json): text hidden 2048, 36 layers, 16 heads, 2 kv
  heads, intermediate 11008, vocab 151936, rope_theta 1e6, mrope_section [16, 24, 24], tied embeddings;
  vision depth 32, hidden 1280, 16 heads, intermediate 3420, out_hidden 2048, window 112, full-attention
  blocks [7, 15, 23, 31], patch 14, merge 2, temporal patch 2. transformers 5 field names (nested
  text_config / vision_config, rope_parameters), checked on 5.17 and 5.23.
- The model is created under `torch.device(device)` in bf16, so no weight ever exists on the CPU, then every
  parameter is overwritten from a seeded device generator: norm weights 1, everything else N(0, 0.02)
  (biases too, so none hides behind a zero). 3.75 B parameters = 7.5 GB.
- The sample: one random uint8 screenshot through the Qwen2-VL image processor (see image_processors.py),
  then `text_tokens` token ids: 20 random ids, <|vision_start|>, the image pads, <|vision_end|>, random ids;
  the last `label_tokens` ids are supervised. mm_token_type_ids marks the image pads (1), which transformers
  5 needs to build the 3D rope positions.
- Checkpoint dir: transformers' save_pretrained (config.json nested, model.safetensors in bf16 with hub key
  names, generation_config.json), preprocessor_config.json, config_flat.json (hub layout, via
  scripts/make_fixtures.py), inputs.safetensors (pixel_values f32, image_grid_thw / input_ids / labels /
  attention_mask / mm_token_type_ids i64) and sample.json (how the sample was made).

Not run directly; imported by bench_torch_lora_step.py and bench_torch_generate.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import image_processors as ip  # noqa: E402
from timing import log  # noqa: E402

QWEN_TOKEN_IDS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)
TINY_TOKEN_IDS = dict(
    image_token_id=1020, video_token_id=1021, vision_start_token_id=1018, vision_end_token_id=1019,
    bos_token_id=1016, eos_token_id=1017, pad_token_id=1016,
)

TEXT_3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
    num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
VISION_3B = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
)
TEXT_TINY = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
)
VISION_TINY = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=112,
    fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
)

# The sample both benchmarks use, and its --tiny version.
SAMPLE_3B = dict(image_width=1080, image_height=2400, min_pixels=ip.GUI_MIN_PIXELS, max_pixels=ip.GUI_MAX_PIXELS,
                 text_tokens=200, label_tokens=50)
SAMPLE_TINY = dict(image_width=216, image_height=480, min_pixels=56 * 56, max_pixels=64 * 28 * 28,
                   text_tokens=40, label_tokens=10)
PREFIX_TOKENS = 20  # random ids before <|vision_start|>: a system prompt's worth, scaled down

INPUT_KEYS = ["input_ids", "attention_mask", "mm_token_type_ids", "labels", "pixel_values", "image_grid_thw"]


def token_ids(tiny: bool) -> dict:
    return TINY_TOKEN_IDS if tiny else QWEN_TOKEN_IDS


def config(tiny: bool):
    from transformers import Qwen2_5_VLConfig

    ids = token_ids(tiny)
    text = dict(TEXT_TINY if tiny else TEXT_3B)
    text.update(hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.02, use_sliding_window=False,
                bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    vision = dict(VISION_TINY if tiny else VISION_3B, hidden_act="silu", in_channels=3)
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=True,
    )


@torch.no_grad()
def init_weights_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Norm weights 1 (norm biases 0), every other parameter N(0, std), from a generator on the weights'
    device. Tied parameters are written once."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    done: set[int] = set()
    for _, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in done:
                continue
            done.add(id(p))
            if is_norm:
                p.fill_(1.0 if pname == "weight" else 0.0)
            else:
                p.normal_(0.0, std, generator=g)
    assert len(done) == len({id(p) for p in model.parameters()})


def build(tiny: bool, device: torch.device, attn: str, seed: int):
    """The random model in bf16 on `device`, created there (no CPU copy). Returns (model, seconds)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    t0 = time.perf_counter()
    cfg = config(tiny)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    init_weights_(model, seed)
    set_generation_ids(model, tiny)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - t0


def set_generation_ids(model, tiny: bool) -> None:
    ids = token_ids(tiny)
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.bos_token_id = ids["bos_token_id"]


def load(ckpt: Path, device: torch.device, attn: str):
    """A saved checkpoint onto `device` in bf16: straight there with device_map, else through the CPU.
    Returns (model, seconds, how)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    t0 = time.perf_counter()
    kw = dict(dtype=torch.bfloat16, attn_implementation=attn)
    try:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ckpt), device_map=str(device), **kw)
        how = f"from_pretrained(device_map={device})"
    except (ImportError, ValueError, RuntimeError, TypeError) as e:
        log(f"from_pretrained with device_map failed ({type(e).__name__}: {e}); loading on the CPU, then .to()")
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ckpt), **kw).to(device)
        how = "from_pretrained on cpu, then .to(device)"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - t0, how


def is_tiny(model) -> bool:
    return model.config.text_config.vocab_size < 151643


def make_sample(model, spec: dict, device: torch.device, seed: int) -> tuple[dict, dict]:
    """(tensors on `device` named as INPUT_KEYS, a description). `spec` keys as SAMPLE_3B."""
    cfg = model.config
    screens = ip.random_screens(1, spec["image_width"], spec["image_height"], seed)  # (1, H, W, 3) uint8
    t0 = time.perf_counter()
    out, processor = ip.process_screens(screens, spec["min_pixels"], spec["max_pixels"], device)
    process_s = time.perf_counter() - t0
    grid = out["image_grid_thw"].to(torch.int64)
    merge = cfg.vision_config.spatial_merge_size
    n_img = int(grid.prod()) // (merge * merge)

    n_text = spec["text_tokens"]
    if n_text < PREFIX_TOKENS + 2 + spec["label_tokens"]:
        raise ValueError(f"text_tokens {n_text} < {PREFIX_TOKENS} prefix + 2 vision markers + {spec['label_tokens']} labels")
    text_max = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                   cfg.text_config.bos_token_id)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    rand = lambda n: torch.randint(0, text_max, (n,), generator=g)  # noqa: E731
    ids = torch.cat([
        rand(PREFIX_TOKENS),
        torch.tensor([cfg.vision_start_token_id]),
        torch.full((n_img,), cfg.image_token_id),
        torch.tensor([cfg.vision_end_token_id]),
        rand(n_text - PREFIX_TOKENS - 2),
    ]).to(torch.int64)[None]  # (1, T)
    labels = torch.full_like(ids, -100)
    labels[:, -spec["label_tokens"]:] = ids[:, -spec["label_tokens"]:]
    tensors = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == cfg.image_token_id).to(torch.int64),
        labels=labels,
        pixel_values=out["pixel_values"].to(torch.float32),
        image_grid_thw=grid,
    )
    tensors = {k: v.to(device) for k, v in tensors.items()}
    desc = dict(spec, seed=seed, processor=processor, process_s=round(process_s, 4))
    return tensors, describe(tensors, desc, merge)


def describe(tensors: dict, desc: dict, merge: int) -> dict:
    grid = tensors["image_grid_thw"]
    visual = int(grid.prod()) // (merge * merge)
    seq = int(tensors["input_ids"].shape[1])
    return dict(
        desc,
        image_grid_thw=[int(x) for x in grid[0].tolist()],
        pixel_values_shape=list(tensors["pixel_values"].shape),
        visual_tokens=visual,
        text_tokens=seq - visual,
        label_tokens=int((tensors["labels"] != -100).sum()),
        total_tokens=seq,
    )


def save(model, ckpt: Path, tensors: dict, desc: dict) -> float:
    """Weights, configs and the sample under `ckpt`; returns seconds."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    ckpt.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(ckpt, safe_serialization=True, max_shard_size="50GB")
    save_file({k: tensors[k].detach().contiguous().cpu() for k in INPUT_KEYS}, str(ckpt / "inputs.safetensors"))
    (ckpt / "sample.json").write_text(json.dumps(desc, indent=2) + "\n")
    try:
        # the project's helpers: preprocessor_config.json as our other checkpoints have it, and the hub's
        # flat config.json layout beside transformers 5's nested one
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import make_fixtures as mf

        prep = mf.preprocessor_config(desc["min_pixels"], desc["max_pixels"], "Qwen2_5_VLProcessor")
        mf.write_json(ckpt / "preprocessor_config.json", prep)
        nested = json.loads((ckpt / "config.json").read_text())
        flat = mf.flat_config(nested)
        flat["torch_dtype"] = "bfloat16"
        mf.write_json(ckpt / "config_flat.json", flat)
    except Exception as e:  # noqa: BLE001 - the nested config.json alone loads in transformers and in Rust
        log(f"warning: preprocessor_config.json / config_flat.json not written: {type(e).__name__}: {e}")
    return time.perf_counter() - t0


def load_sample(ckpt: Path, model, device: torch.device) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    tensors = {k: v.to(device) for k, v in load_file(str(ckpt / "inputs.safetensors")).items()}
    missing = [k for k in INPUT_KEYS if k not in tensors]
    if missing:
        raise SystemExit(f"{ckpt}/inputs.safetensors lacks {missing}")
    desc = json.loads((ckpt / "sample.json").read_text()) if (ckpt / "sample.json").exists() else {}
    desc["loaded_from"] = str(ckpt)
    return tensors, describe(tensors, desc, model.config.vision_config.spatial_merge_size)


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
