//! The model backend: a Qwen2.5-VL / Qwen2-VL checkpoint (and its LoRA adapters) behind [`Backend`].
