#!/usr/bin/env bash
# The trainer benchmark on the CPU: askgui-train against transformers + PEFT, LoRA on the same batches of the
# same model, one run each, reported as ratios (askgui / PyTorch).
#
# The fixed config: a synthetic world (askgui-data synth, 280x504 screens, kept unresized: 180 visual tokens
# a sample), a random Qwen2.5-VL of decoder hidden 512 x 8 layers and vision 256 x 4 (the shape of the
# model benchmark, random_checkpoint.py --shape train-bench) with the byte-level tokenizer, the compact system
# prompt, LoRA r 16 / alpha 32 on the 7 projections, batch 4, lr 1e-4, f32; gradient checkpointing on both
# sides or on neither (CKPT=1 / 0, default 0).
# askgui-train's throughput comes from its metrics.jsonl (step 1 is the warm-up on both sides), its peak
# RSS from /usr/bin/time; the batches are exported (train/examples/export_batches.rs) and replayed by
# scripts/bench/bench_trainer_peft.py.
#
#   scripts/bench/bench_trainer.sh PYTHON [OUT_DIR] [STEPS] [THREADS]
#     PYTHON   a Python with torch, transformers 5, peft, torchvision, pillow
#     OUT_DIR  default target/bench-trainer;  STEPS default 10;  THREADS default: all cores
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:?usage: scripts/bench/bench_trainer.sh PYTHON [OUT_DIR] [STEPS] [THREADS]}
out=${2:-target/bench-trainer}
steps=${3:-10}
ckpt=${CKPT:-0}
case $ckpt in 0) ours_ckpt=false peft_ckpt=() ;; 1) ours_ckpt=true peft_ckpt=(--gradient-checkpointing) ;;
  *) echo "CKPT must be 0 or 1" >&2; exit 2 ;; esac
threads=${4:-$(nproc)}
mkdir -p "$out"
out=$(cd "$out" && pwd)

cargo build --release -q -p askgui-data -p askgui-train --bins --example export_batches
bin=target/release

[ -f "$out/data/train.jsonl" ] || "$bin/askgui-data" synth --out "$out/data" --episodes 60 --width 280 --height 504 --split 1:0:0
"$py" - "$out/config.json" <<'PY'
import json, sys
c = json.load(open("train/assets/demo-config.json"))
t, v = c["text_config"], c["vision_config"]
t.update(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
         layer_types=["full_attention"] * 8)
t["rope_parameters"]["mrope_section"] = [8, 12, 12]
v.update(hidden_size=256, intermediate_size=1024, depth=4, num_heads=4, fullatt_block_indexes=[1, 3], out_hidden_size=512)
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY

args=(--init-config "$out/config.json" --mode lora --data "$out/data/train.jsonl" --task-mode full
  --system-prompt compact --min-pixels 3136 --max-pixels 401408 --lora-rank 16 --lora-alpha 32 --lora-dropout 0
  --lr 1e-4 --warmup-steps 0 --min-lr-ratio 1 --max-grad-norm 1 --batch-size 4 --grad-accum 1 --max-steps "$steps"
  --grad-checkpointing "$ours_ckpt" --save-every 0 --progress false --seed 0)

rm -rf "$out/run"
RAYON_NUM_THREADS=$threads /usr/bin/time -v -o "$out/askgui.time" \
  "$bin/askgui-train" "${args[@]}" --output-dir "$out/run" 2>"$out/askgui.log"
"$bin/examples/export_batches" --steps "$steps" --out "$out/batches.jsonl" -- "${args[@]}" --output-dir "$out/export" \
  2>>"$out/askgui.log"
"$py" scripts/bench/bench_trainer_peft.py --model "$out/run/init-model" --batches "$out/batches.jsonl" \
  --min-pixels 3136 --max-pixels 401408 --rank 16 --lr 1e-4 --threads "$threads" --attn sdpa "${peft_ckpt[@]}" \
  >"$out/peft.json" 2>"$out/peft.log"

"$py" - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]
m = [json.loads(l) for l in open(f"{out}/run/metrics.jsonl") if '"loss"' in l and '"elapsed_s"' in l]
secs = m[-1]["elapsed_s"] - m[0]["elapsed_s"]
ours = dict(
    tokens_per_s=sum(r["tokens"] for r in m[1:]) / secs,
    samples_per_s=sum(r["sequences"] for r in m[1:]) / secs,
    peak_rss_bytes=int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{out}/askgui.time").read())[1]) * 1024,
    first_loss=m[0]["loss"],
)
peft = json.loads(open(f"{out}/peft.json").read())
print(f"steps {len(m)} (1 warm-up), threads {peft['threads']}, gradient checkpointing {peft['gradient_checkpointing']}")
print(f"{'':16}{'askgui':>12}{'PEFT (' + peft['attn'] + ')':>16}{'ratio':>8}")
for k in ["tokens_per_s", "samples_per_s", "peak_rss_bytes"]:
    a, b = ours[k], peft[k]
    fa, fb = (f"{a / 2**20:.0f} MiB", f"{b / 2**20:.0f} MiB") if k == "peak_rss_bytes" else (f"{a:.1f}", f"{b:.2f}")
    print(f"{k:16}{fa:>12}{fb:>16}{a / b:>8.2f}")
d = abs(ours["first_loss"] - peft["first_loss"])
print(f"first loss (zero adapters): askgui {ours['first_loss']:.6f}, PEFT {peft['first_loss']:.6f}, |diff| {d:.2e}")
json.dump(dict(askgui=ours, peft=peft), open(f"{out}/result.json", "w"), indent=1)
PY
