#!/usr/bin/env bash
# What LoRA dropout costs askgui-train: PAIRS pairs of runs on bench_trainer.sh's small mix, packed (the
# same data, model shape and flags, with gradient checkpointing off), one run with `--lora-dropout 0` and
# one with `--lora-dropout P` in each pair, the order alternating from pair to pair so that a drift of a
# shared machine falls on both sides. Prints each run's tokens/s (steps 2.. over their wall time, step 1
# being the warm-up, as bench_trainer.sh), each pair's ratio, and the median and range of the ratios.
#
#   scripts/bench/bench_dropout.sh [OUT_DIR] [PAIRS] [STEPS] [P]
#     OUT_DIR default target/bench-dropout;  PAIRS default 5;  STEPS default 6;  P default 0.05
#     ASKGUI_BIN=DIR: take askgui-train and askgui-data from DIR instead of building them
# Needs python3 (standard library only) to write the model config.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/bench-dropout}
pairs=${2:-5}
steps=${3:-6}
p=${4:-0.05}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [ -z "${ASKGUI_BIN:-}" ]; then
  cargo build --release -q -p askgui-data -p askgui-train --bins
fi
# A copy of its own: another build into the same target folder cannot swap the binary mid-measurement.
bin=${ASKGUI_BIN:-${CARGO_TARGET_DIR:-target}/release}
cp "$bin/askgui-train" "$bin/askgui-data" "$out/"

[ -f "$out/data/train.jsonl" ] || "$out/askgui-data" synth --out "$out/data" --episodes 60 --width 280 --height 504 \
  --split 1:0:0
# bench_trainer.sh's model: decoder 512 x 8 layers, vision 256 x 4.
python3 - "$out/config.json" <<'PY'
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
  --system-prompt compact --min-pixels 3136 --max-pixels 401408 --lora-rank 16 --lora-alpha 32
  --lr 1e-4 --warmup-steps 0 --min-lr-ratio 1 --max-grad-norm 1 --batch-size 4 --grad-accum 1 --max-steps "$steps"
  --grad-checkpointing false --save-every 0 --progress false --seed 0 --packing)

# tokens/s of run $1: steps 2.. over the wall time from step 1's end to the last step's.
tps() {
  python3 - "$out/$1/metrics.jsonl" <<'PY'
import json, sys
m = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l and '"elapsed_s"' in l]
print(f'{sum(r["tokens"] for r in m[1:]) / (m[-1]["elapsed_s"] - m[0]["elapsed_s"]):.1f}')
PY
}

ratios=()
for i in $(seq 1 "$pairs"); do
  order=(0 "$p")
  [ $((i % 2)) = 0 ] && order=("$p" 0)
  for d in "${order[@]}"; do
    rm -rf "$out/run-$d"
    "$out/askgui-train" "${args[@]}" --lora-dropout "$d" --output-dir "$out/run-$d" 2>"$out/run-$d.log"
  done
  a=$(tps "run-$p") b=$(tps run-0)
  r=$(python3 -c "print(f'{$a / $b:.3f}')")
  ratios+=("$r")
  echo "pair $i: dropout $p $a tokens/s, dropout 0 $b tokens/s, ratio $r"
done
python3 - "${ratios[@]}" <<'PY'
import statistics, sys
r = sorted(float(x) for x in sys.argv[1:])
print(f"ratio (dropout / no dropout) over {len(r)} pairs: median {statistics.median(r):.3f}, range {r[0]:.3f}-{r[-1]:.3f}")
PY
