#!/usr/bin/env bash
# Everything askgui checks and times on a GPU machine, in two stages that each fit one 10-minute call.
#
#   scripts/gpu/device_run.sh OUT check   # ~4 min: check-gpu + the CUDA tests, the trainer on the CPU against
#                                         # the GPU (f32, bf16, packed, reference kernels), a two-rank NCCL
#                                         # start, the server on the CPU against the GPU, the kernel
#                                         # benchmarks beside PyTorch's
#   scripts/gpu/device_run.sh OUT model   # ~5 min: the 3B-shaped LoRA step and generation, PyTorch then askgui
#   scripts/gpu/device_run.sh OUT train   # ~9 min: the training path as a lab runs it (issue 48): check-gpu
#                                         # and the CUDA tests; the 3B-shaped LoRA step with the default
#                                         # settings (askgui-train on 1080x2400 episodes; PEFT; PEFT +
#                                         # Liger, whose wheel travels in target/wheels); the ops (the fused
#                                         # loss against Liger's), attention (1k, 4k, 8k and vision) and
#                                         # tiling beside PyTorch
#   scripts/gpu/device_run.sh OUT serve   # ~8 min: askgui-serve under load on the GPU (issue 50): the 3B-shaped
#                                         # checkpoint, 1080x2400 screenshots, concurrency 1, 16 and 64 beside
#                                         # transformers' batched generate; OpenAI chat requests; a 64-client
#                                         # load run (every answer 200 or 429, GPU memory sampled)
#   scripts/gpu/device_run.sh OUT paged   # the paged KV cache: CUDA tests, the server, the decode step, the
#                                         # 3B-shaped generation (OLD_GENERATE=NAME: also an older build's
#                                         # generate example, put in the bundle's examples/ as NAME)
#
# Needs, built on a machine with Rust (no GPU needed there; carry target/gpu-bundle.tar.xz and target/gpu-data):
#   scripts/build_cuda_artifacts.sh --xz --example generate --example lora_step --example bench_cuda
#   askgui-data synth --out target/gpu-data/train --episodes 24 --seed 11 --width 224 --height 400 --split 1:0:0
#   gzip -c QWEN_TOKENIZER.json > target/gpu-data/tokenizer.json.gz   # the 3B generation's tokenizer
# and the PyTorch stack on the GPU machine (scripts/gpu/README.md). Every log lands in a folder that is
# packed into OUT/STAGE.tar.gz (a device call returns few files); OUT/STAGE-summary.txt holds the verdicts
# and is printed last. Exit status: the number of failed steps. BENCH=0 leaves the kernel benchmarks and
# the CuPy attention check out of `check` (about 2.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: scripts/gpu/device_run.sh OUT check|model|train|serve|paged}
stage=${2:?usage: scripts/gpu/device_run.sh OUT check|model|train|serve|paged}
bundle=${BUNDLE:-target/gpu-bundle}
data=target/gpu-data
work=$(mktemp -d)/$stage
mkdir -p "$out" "$work"
summary=$out/$stage-summary.txt
: >"$summary"
failed=0
nccl=${NCCL_LIB_DIR:-$(python3 -c 'import glob, os, nvidia
print(next((os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(p + "/**/libnccl.so*", recursive=True)), ""))' 2>/dev/null)}
export LD_LIBRARY_PATH="${CUDA_LIB_DIR:-/usr/local/cuda/lib64}${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

note() { echo "$*" | tee -a "$summary"; }
# step NAME TIMEOUT_S COMMAND...: runs it with its output in $work/NAME.log and notes the verdict.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name: $*" >&2
  timeout "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  note "$name: rc $rc in $((SECONDS - t0)) s"
  # The logs so far, in case the call's time runs out before the end.
  tar -C "$(dirname "$work")" --exclude='*.safetensors' -czf "$out/$stage.tar.gz" "$stage"
  [ "$rc" = 0 ] && return
  failed=$((failed + 1))
  { grep -m3 -E '^Error|panicked|FAILED|Traceback' "$work/$name.log" || tail -4 "$work/$name.log"; } | sed 's/^/    /' |
    tee -a "$summary"
}

# gpu_peak FILE COMMAND...: runs COMMAND while sampling the GPU's used memory every 200 ms; the largest
# sample (MiB, the whole GPU as nvidia-smi sees it) goes to FILE.
gpu_peak() {
  local file=$1 sampler rc
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$file.samples" 2>/dev/null &
  sampler=$!
  "$@"
  rc=$?
  kill "$sampler" 2>/dev/null
  sort -n "$file.samples" | tail -1 >"$file"
  return $rc
}

[ -d "$bundle" ] || tar -C target -xJf "$bundle.tar.xz" || exit 1
# Tests that read fixtures through the build machine's absolute path find them through a link.
root=$(sed -n 's/^root //p' "$bundle/BUILD_INFO" 2>/dev/null)
if [ -n "$root" ] && [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv >"$work/nvidia-smi.csv" 2>&1
python3 -c "import torch, transformers, peft; print(torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__)" \
  >"$work/versions.txt" 2>&1
cp "$bundle/BUILD_INFO" "$work/" 2>/dev/null
note "$(head -2 "$work/nvidia-smi.csv" | tail -1); torch $(cat "$work/versions.txt")"

train=$bundle/bin/askgui-train
# train NAME FLAGS...: four LoRA steps of the tiny fixture on the synthetic episodes.
train() {
  local name=$1
  shift
  step "train-$name" 240 "$train" --model model/tests/fixtures/tiny-qwen2_5_vl --data "$data/train/train.jsonl" \
    --output-dir "$work/train-$name" --max-pixels 12544 --max-steps 4 --batch-size 4 --lora-dropout 0 \
    --progress false --seed 0 "$@"
}
compare() { # compare REF RUN RTOL
  step "compare-$2-vs-$1" 60 python3 scripts/gpu/compare_train_runs.py "$work/train-$1" "$work/train-$2" --rtol "$3" \
    --label "$2 vs $1"
  grep -E "PASS|FAIL" "$work/compare-$2-vs-$1.log" | sed 's/^/    /' >>"$summary"
}

# The server on the GPU answers as the one on the CPU (the tiny fixture, f32, greedy).
serve_smoke() {
  local serve=$bundle/bin/askgui-serve servers=() d
  for d in cpu:18101 cuda:18102; do
    "$serve" --model model/tests/fixtures/tiny-qwen2_5_vl --no-ui --device "${d%:*}" --dtype f32 --port "${d#*:}" \
      >"$work/serve-${d%:*}.log" 2>&1 &
    servers+=($!)
  done
  step serve-cpu-vs-cuda 240 python3 scripts/gpu/serve_smoke.py http://127.0.0.1:18101 http://127.0.0.1:18102
  tail -2 "$work/serve-cpu-vs-cuda.log" | sed 's/^/    /' >>"$summary"
  kill "${servers[@]}" 2>/dev/null
}

case $stage in
  check)
    # check-gpu, then the CUDA test executable (the bundle's other tests are CPU tests CI runs).
    step cuda-tests 300 "$bundle/run.sh" cuda
    grep -E "FAIL|test result|passed|failed" "$work/cuda-tests.log" | sed 's/^/    /' | head -20 >>"$summary"
    [ "${BENCH:-1}" = 0 ] || step attention-cupy 180 python3 scripts/checks/check_attention_kernels.py
    train cpu --device cpu
    train cuda --device cuda --dtype f32
    train cuda-packed --device cuda --dtype f32 --packing
    train cuda-reference --device cuda --dtype f32 --kernels reference
    train cuda-bf16 --device cuda --dtype bf16
    train cuda-bf16-packed --device cuda --dtype bf16 --packing
    # f32: the same arithmetic in another order (cuBLAS, our kernels' reductions): far under 1e-4.
    compare cpu cuda 1e-4
    compare cuda cuda-packed 1e-4
    compare cuda cuda-reference 1e-4
    # bf16 weights and activations round to 8 bits of mantissa (0.4%); over 4 steps a loss within 1%.
    compare cpu cuda-bf16 1e-2
    compare cuda-bf16 cuda-bf16-packed 1e-2
    # Two torchrun-style ranks on one GPU: the NCCL id travels over the rendezvous, then NCCL refuses two
    # ranks on one device. What must hold: both ranks exit with an error naming the cause, no hang.
    for r in 0 1; do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
        timeout 120 "$train" --model model/tests/fixtures/tiny-qwen2_5_vl --data "$data/train/train.jsonl" \
        --output-dir "$work/nccl" --max-pixels 12544 --max-steps 2 --batch-size 4 --progress false \
        --device cuda >"$work/nccl-rank$r.log" 2>&1 &
    done
    t0=$SECONDS
    wait
    note "nccl two ranks on one GPU: ended after $((SECONDS - t0)) s; rank 0: $(grep -m1 -E '^Error|panicked' "$work/nccl-rank0.log"); rank 1: $(grep -m1 -E '^Error|panicked' "$work/nccl-rank1.log")"
    serve_smoke
    if [ "${BENCH:-1}" != 0 ]; then
      step bench-cuda 240 "$bundle/run.sh" --example bench_cuda all
      SKIP_CHECK_GPU=1 step torch-kernels 300 scripts/gpu/run_all.sh "$work/torch" attention tiling
    fi
    ;;
  model)
    ckpt=target/gpu-bench/qwen3b-random
    step torch-lora 300 python3 scripts/gpu/bench_torch_lora_step.py --save-checkpoint "$ckpt" --lora-dropout 0
    step askgui-lora 300 "$bundle/run.sh" --example lora_step --model "$ckpt" --path ops --checkpointing \
      --image-size 1080x2400 --text-tokens 200 --supervised 50 --rank 64 --lm-only --steps 5 --device cuda --dtype bf16
    step torch-generate 240 python3 scripts/gpu/bench_torch_generate.py --load-checkpoint "$ckpt"
    gunzip -c "$data/tokenizer.json.gz" >"$ckpt/tokenizer.json" && cp "$data/tokenizer_config.json" "$ckpt/"
    python3 -c "import numpy as np; from PIL import Image; Image.fromarray(np.random.default_rng(0).integers(0, 256, (2400, 1080, 3), dtype=np.uint8)).save('$work/screen.png')"
    step askgui-generate 240 "$bundle/run.sh" --example generate --model "$ckpt" --image "$work/screen.png" \
      --prompt "Open the settings and turn on dark mode." --max-new-tokens 32 --ignore-eos --timings --repeat 5 \
      --device cuda --dtype bf16
    ;;
  train)
    step cuda-tests 240 "$bundle/run.sh" cuda
    grep -E "FAIL|test result|passed|failed" "$work/cuda-tests.log" | sed 's/^/    /' | head -20 >>"$summary"
    # Liger-Kernel for the PyTorch anchor (a small wheel carried in target/wheels; no network there).
    pip install -q --no-deps --no-index target/wheels/liger_kernel-*.whl >"$work/liger-install.log" 2>&1 ||
      note "liger-kernel: not installed (see liger-install.log); its rows are left out"
    ckpt=target/gpu-bench/qwen3b-random
    step torch-lora 200 gpu_peak "$work/torch-lora.mem" python3 scripts/gpu/bench_torch_lora_step.py \
      --save-checkpoint "$ckpt"
    step torch-lora-liger 200 gpu_peak "$work/torch-lora-liger.mem" python3 scripts/gpu/bench_torch_lora_step.py \
      --load-checkpoint "$ckpt" --liger
    # askgui-train with the defaults a user gets (dropout 0.05, packing, the data path's decode and tiling)
    # on synthetic 1080x2400 episodes, the same random 3B checkpoint.
    gunzip -c "$data/tokenizer.json.gz" >"$ckpt/tokenizer.json" && cp "$data/tokenizer_config.json" "$ckpt/"
    "$bundle/bin/askgui-data" synth --out "$work/data" --episodes 24 --seed 5 --width 1080 --height 2400 \
      --split 1:0:0 >"$work/synth.log" 2>&1
    step askgui-train-defaults 240 gpu_peak "$work/askgui-train.mem" "$train" --model "$ckpt" \
      --data "$work/data/train.jsonl" --output-dir "$work/run-defaults" --max-steps 6 --device cuda --progress false
    python3 scripts/gpu/train_summary.py "$work/run-defaults" "$work"/torch-lora.log "$work"/torch-lora-liger.log \
      --mem "$work"/askgui-train.mem "$work"/torch-lora.mem "$work"/torch-lora-liger.mem 2>&1 | sed 's/^/    /' >>"$summary"
    step bench-ops 150 "$bundle/run.sh" --example bench_cuda norm_rope_ce
    step torch-ops 150 python3 scripts/gpu/bench_torch_ops.py
    grep -h linear_cross_entropy "$work/bench-ops.log" "$work/torch-ops.log" | sed 's/^/    /' >>"$summary"
    step bench-attention 150 "$bundle/run.sh" --example bench_cuda attention
    step bench-tiling 60 "$bundle/run.sh" --example bench_cuda tiling
    SKIP_CHECK_GPU=1 step torch-kernels 200 scripts/gpu/run_all.sh "$work/torch" attention tiling
    ;;
  serve)
    ckpt=target/gpu-bench/qwen3b-random
    gunzip -c "$data/tokenizer.json.gz" >"$work/tokenizer.json"
    step checkpoint-3b 240 python3 scripts/fixtures/random_checkpoint.py --shape 3b --device cuda --out "$ckpt" \
      --tokenizer "$work/tokenizer.json"
    bench=(python3 scripts/bench/bench_serve.py --device cuda --binary "$bundle/bin/askgui-serve" --model "$ckpt"
      --width 1080 --height 2400 --max-tokens 32 --timeout 120)
    step serve-agent 300 gpu_peak "$work/serve-agent.mem" "${bench[@]}" --concurrency 1,16,64 --requests 64
    grep -h '"ratios"' "$work/serve-agent.log" | python3 -c 'import json, sys; d = json.load(sys.stdin); print("ratios", d["ratios"]); print("askgui 64:", d["askgui"]["64"])' 2>&1 |
      sed 's/^/    /' >>"$summary"
    step serve-openai 120 "${bench[@]}" --concurrency 1,16 --requests 32 --api openai --askgui-only
    step serve-load 150 gpu_peak "$work/serve-load.mem" python3 scripts/bench/load_test_serve.py --device cuda \
      --binary "$bundle/bin/askgui-serve" --model "$ckpt" --clients 64 --duration 60 --screenshots 200 \
      --screenshot-size 1080x2400 --max-tokens 32
    # Flat after warm-up: the used memory 15 s into the load run against its end (samples 200 ms apart).
    note "    GPU memory (MiB): agent bench peak $(cat "$work/serve-agent.mem" 2>/dev/null); load run peak \
$(cat "$work/serve-load.mem" 2>/dev/null), at 15 s $(sed -n 75p "$work/serve-load.mem.samples" 2>/dev/null), at the end \
$(tail -1 "$work/serve-load.mem.samples" 2>/dev/null)"
    ;;
  paged)
    # The paged KV cache: the CUDA tests (the paged kernel's among them), the server on the CPU against
    # the GPU (its decode steps and action-name forks read the cache through the paged kernel), the paged
    # decode step against concatenation + attention, then the 3B-shaped generation with this build and,
    # when $OLD_GENERATE names it, the generate example of the build before the paged cache.
    step cuda-tests 300 "$bundle/run.sh" cuda
    grep -E "FAIL|test result|paged" "$work/cuda-tests.log" | sed 's/^/    /' | head -20 >>"$summary"
    serve_smoke
    step bench-paged 120 "$bundle/run.sh" --example bench_cuda paged
    sed 's/^/    /' "$work/bench-paged.log" >>"$summary"
    ckpt=target/gpu-bench/qwen3b-random
    gunzip -c "$data/tokenizer.json.gz" >"$work/tokenizer.json"
    step checkpoint-3b 300 python3 scripts/fixtures/random_checkpoint.py --shape 3b --device cuda --out "$ckpt" \
      --tokenizer "$work/tokenizer.json"
    python3 -c "import numpy as np; from PIL import Image; Image.fromarray(np.random.default_rng(0).integers(0, 256, (2400, 1080, 3), dtype=np.uint8)).save('$work/screen.png')"
    gen=(--model "$ckpt" --image "$work/screen.png" --prompt "Open the settings and turn on dark mode."
      --max-new-tokens 32 --ignore-eos --timings --repeat 5 --device cuda --dtype bf16)
    step generate-paged 240 "$bundle/run.sh" --example generate "${gen[@]}"
    grep -h '^{' "$work/generate-paged.log" | sed 's/^/    paged: /' >>"$summary"
    if [ -n "${OLD_GENERATE:-}" ]; then
      step generate-before 240 "$bundle/run.sh" --example "$OLD_GENERATE" "${gen[@]}"
      grep -h '^{' "$work/generate-before.log" | sed 's/^/    before: /' >>"$summary"
    fi
    ;;
  *) echo "unknown stage $stage: check, model, train, serve or paged" >&2; exit 2 ;;
esac
tar -C "$(dirname "$work")" --exclude='*.safetensors' -czf "$out/$stage.tar.gz" "$stage"
note "$stage: $failed failed; logs in $out/$stage.tar.gz"
cat "$summary"
exit "$failed"
