#!/usr/bin/env bash
# Run the PyTorch GPU benchmarks on the GPU machine and keep every JSON line and log under OUT.
#
#   scripts/gpu/run_all.sh OUT [smoke] [attention] [tiling] [lora] [lora-nockpt] [generate]
#
# Default: smoke attention tiling lora generate (about 7 minutes on an H100; split it over two calls when
# one call is limited to 10 minutes: `smoke attention tiling`, then `lora generate`). Each script runs under
# its own timeout and a failure does not stop the others; the exit status is the number of failed scripts.
# `smoke` runs every script with --tiny on the GPU first (about a minute), so a CUDA-only mistake shows up
# in OUT/smoke-*.log next to the real numbers. `lora` writes the random 3B checkpoint and the exact input
# to $CKPT (default target/gpu-bench/qwen3b-random: 8 GB, kept on the GPU machine only while it stays
# warm); `generate` loads it when it is there. PYTHON picks the interpreter (default python3), DEVICE the
# --device (default cuda; `DEVICE=cpu scripts/gpu/run_all.sh /tmp/out smoke` is the CPU check).
# First of all, when an askgui-train binary is at hand ($ASKGUI_TRAIN, else the CUDA bundle's
# target/gpu-bundle/bin/askgui-train from scripts/build_cuda_artifacts.sh, else target/release/askgui-train),
# `askgui-train check-gpu` checks askgui's kernels against their references: OUT/check-gpu.txt; a failure
# counts as a failed script. SKIP_CHECK_GPU=1 leaves it out (scripts/gpu/device_run.sh runs it itself).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: scripts/gpu/run_all.sh OUT [smoke] [attention] [tiling] [lora] [lora-nockpt] [generate]}
shift
benches=${*:-smoke attention tiling lora generate}
py=${PYTHON:-python3}
dev=${DEVICE:-cuda}
ckpt=${CKPT:-target/gpu-bench/qwen3b-random}
mkdir -p "$out"
failed=0

run() { # run NAME TIMEOUT_S SCRIPT ARGS...
  local name=$1 limit=$2 script=$3
  shift 3
  echo "== $name: $script $* (timeout ${limit}s)" >&2
  local t0=$SECONDS
  timeout "$limit" "$py" "scripts/gpu/$script" --device "$dev" "$@" >"$out/$name.jsonl" 2>"$out/$name.log"
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s, $(wc -l <"$out/$name.jsonl") JSON lines" >&2
  [ "$rc" = 0 ] || { failed=$((failed + 1)); tail -5 "$out/$name.log" >&2; }
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/nvidia-smi.csv" 2>&1 || true
"$py" -c "import torch, transformers, peft; print(torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__)" \
  >"$out/versions.txt" 2>&1 || true

train_bin=${ASKGUI_TRAIN:-}
[ "${SKIP_CHECK_GPU:-0}" != 1 ] || train_bin=none
for b in target/gpu-bundle/bin/askgui-train target/release/askgui-train; do
  [ -n "$train_bin" ] || { [ -x "$b" ] && train_bin=$b; }
done
if [ "$train_bin" = none ]; then
  echo "== check-gpu: skipped (SKIP_CHECK_GPU=1)" >&2
elif [ -n "$train_bin" ]; then
  echo "== check-gpu: $train_bin check-gpu --device $dev" >&2
  LD_LIBRARY_PATH="${CUDA_LIB_DIR:-/usr/local/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 300 \
    "$train_bin" check-gpu --device "$dev" >"$out/check-gpu.txt" 2>"$out/check-gpu.log"
  rc=$?
  echo "== check-gpu: rc $rc; $(tail -1 "$out/check-gpu.txt")" >&2
  [ "$rc" = 0 ] || { failed=$((failed + 1)); grep FAIL "$out/check-gpu.txt" | head -5 >&2; tail -3 "$out/check-gpu.log" >&2; }
else
  echo "== check-gpu: skipped (no askgui-train binary: set ASKGUI_TRAIN or build target/gpu-bundle)" >&2
fi

for b in $benches; do
  case $b in
    smoke)
      run smoke-attention 120 bench_torch_attention.py --tiny
      run smoke-tiling 120 bench_torch_tiling.py --tiny
      run smoke-lora 120 bench_torch_lora_step.py --tiny
      run smoke-generate 120 bench_torch_generate.py --tiny
      ;;
    attention) run attention 240 bench_torch_attention.py ;;
    tiling) run tiling 240 bench_torch_tiling.py ;;
    lora)
      rm -rf "$ckpt"
      run lora 300 bench_torch_lora_step.py --save-checkpoint "$ckpt"
      mkdir -p "$out/checkpoint-meta"
      for f in config.json config_flat.json generation_config.json preprocessor_config.json sample.json \
        torch_lora_step.json inputs.safetensors adapter_init/adapter_config.json; do
        [ -f "$ckpt/$f" ] && cp "$ckpt/$f" "$out/checkpoint-meta/$(basename "$f")"
      done
      ;;
    lora-nockpt)
      if [ -f "$ckpt/model.safetensors" ]; then
        run lora-nockpt 300 bench_torch_lora_step.py --no-gradient-checkpointing --load-checkpoint "$ckpt"
      else
        run lora-nockpt 300 bench_torch_lora_step.py --no-gradient-checkpointing
      fi
      ;;
    generate)
      if [ -f "$ckpt/model.safetensors" ]; then
        run generate 240 bench_torch_generate.py --load-checkpoint "$ckpt"
      else
        run generate 240 bench_torch_generate.py
      fi
      ;;
    *) echo "unknown benchmark $b" >&2; failed=$((failed + 1)) ;;
  esac
done
echo "== done: $failed failed; results in $out" >&2
exit "$failed"
