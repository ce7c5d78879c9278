#!/usr/bin/env bash
# Benchmark: prompt processing + 32 generated tokens on a 1024x768 screenshot, askgui-model (candle, CPU)
# side by side with transformers (PyTorch, CPU), same random checkpoint, same machine, one run each
# after one warm-up. Prints both JSON timing lines and the ratio.
#
#   scripts/bench/bench_generate.sh PYTHON TOKENIZER_JSON IMAGE_1024x768 [THREADS]
#
# PYTHON is an interpreter with torch, transformers, torchvision, pillow, safetensors. TOKENIZER_JSON is the
# real Qwen tokenizer (.ci/run fetches it into .cache/). The checkpoint (real vocabulary, tiny widths) is
# written to target/bench-qwen2_5_vl and is not committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:?python with transformers}; tok=${2:?tokenizer.json}; img=${3:?1024x768 image}; threads=${4:-$(nproc)}
ckpt=target/bench-qwen2_5_vl
prompt="Where should I click to open the settings?"
[ -f "$ckpt/model.safetensors" ] || "$py" scripts/fixtures/random_checkpoint.py --shape generate-bench --out "$ckpt" --tokenizer "$tok"
cargo build --release -q -p askgui-model --example generate
run_rust() {
  RAYON_NUM_THREADS=$threads target/release/examples/generate --model "$ckpt" --image "$img" --prompt "$prompt" \
    --max-new-tokens 32 --ignore-eos --min-pixels 3136 --max-pixels 1003520 --timings 2>&1 >/dev/null | tail -1
}
run_rust >/dev/null
rust=$(run_rust)
hf=$("$py" scripts/bench/bench_transformers.py --model "$ckpt" --image "$img" --prompt "$prompt" --max-new-tokens 32 --threads "$threads" | tail -1)
echo "askgui-model: $rust"
echo "transformers: $hf"
"$py" - "$rust" "$hf" <<'PY'
import json, sys
r, h = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rt = r["preprocess_s"] + r["generate_s"]
ht = h["preprocess_s"] + h["generate_s"]
print(f"prompt tokens: ours {r['prompt_tokens']}, transformers {h['prompt_tokens']}; new tokens {r['new_tokens']} / {h['new_tokens']}")
print(f"preprocess: {r['preprocess_s']:.3f}s vs {h['preprocess_s']:.3f}s (transformers / ours = {h['preprocess_s'] / r['preprocess_s']:.2f}x)")
print(f"prefill+32 tokens: {r['generate_s']:.3f}s vs {h['generate_s']:.3f}s (transformers / ours = {h['generate_s'] / r['generate_s']:.2f}x)")
print(f"total: {rt:.3f}s vs {ht:.3f}s (transformers / ours = {ht / rt:.2f}x)")
PY
