#!/usr/bin/env bash
# The trainer benchmark on the CPU: askgui-train, right-padded and with --packing, against transformers + PEFT
# (right-padded), LoRA on the same batches of the same model, one run each, reported as ratios (askgui / PyTorch).
#
# The data (MIX): `small` (default), a synthetic world (askgui-data synth) of 280x504 screens kept unresized
# (180 visual tokens a sample); `phone`, Navi-plus's length mix: 1080x2400 phone screens at askgui's default
# pixel budget (max 1280 merged tokens: 1,272 a screenshot), 1-3 screenshots a sample (--history-images 2),
# and the ambiguous tasks' ASK and SAY turns. The model: a random Qwen2.5-VL of decoder hidden 512 x 8 layers and vision 256 x 4 (the shape of the
# model benchmark, random_checkpoint.py --shape train-bench) with the byte-level tokenizer, the compact system
# prompt, LoRA r 16 / alpha 32 on the 7 projections, batch 4, lr 1e-4, f32; gradient checkpointing on both
# sides or on neither (CKPT=1 / 0, default 0).
# askgui-train's throughput comes from its metrics.jsonl (step 1 is the warm-up on both sides; supervised
# tokens/s, and the padding fraction from computed_tokens), its peak RSS from /usr/bin/time; the batches are exported (train/examples/export_batches.rs) and replayed by
# scripts/bench/bench_trainer_peft.py.
#
#   [MIX=small|phone] [CKPT=0|1] scripts/bench/bench_trainer.sh PYTHON [OUT_DIR] [STEPS] [THREADS]
#     PYTHON   a Python with torch, transformers 5, peft, torchvision, pillow
#     OUT_DIR  default target/bench-trainer;  STEPS default 10;  THREADS default: all cores
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:?usage: scripts/bench/bench_trainer.sh PYTHON [OUT_DIR] [STEPS] [THREADS]}
mix=${MIX:-small}
out=${2:-target/bench-trainer-$mix}
steps=${3:-10}
ckpt=${CKPT:-0}
case $ckpt in 0) ours_ckpt=false peft_ckpt=() ;; 1) ours_ckpt=true peft_ckpt=(--gradient-checkpointing) ;;
  *) echo "CKPT must be 0 or 1" >&2; exit 2 ;; esac
threads=${4:-$(nproc)}
mkdir -p "$out"
out=$(cd "$out" && pwd)

cargo build --release -q -p askgui-data -p askgui-train --bins --example export_batches
bin=target/release

case $mix in
  small) synth=(--episodes 60 --width 280 --height 504) mix_args=(--min-pixels 3136 --max-pixels 401408) ;;
  phone) synth=(--episodes 40 --width 1080 --height 2400)
    mix_args=(--min-pixels 3136 --max-pixels 1003520 --history-images 2) ;;
  *) echo "MIX must be small or phone" >&2; exit 2 ;;
esac
[ -f "$out/data/train.jsonl" ] || "$bin/askgui-data" synth --out "$out/data" "${synth[@]}" --split 1:0:0
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

task_mode=full
[ "$mix" = phone ] && task_mode=ambiguous
args=(--init-config "$out/config.json" --mode lora --data "$out/data/train.jsonl" --task-mode "$task_mode"
  --system-prompt compact "${mix_args[@]}" --lora-rank 16 --lora-alpha 32 --lora-dropout 0
  --lr 1e-4 --warmup-steps 0 --min-lr-ratio 1 --max-grad-norm 1 --batch-size 4 --grad-accum 1 --max-steps "$steps"
  --grad-checkpointing "$ours_ckpt" --save-every 0 --progress false --seed 0)

for run in padded packed; do
  extra=()
  [ $run = packed ] && extra=(--packing)
  rm -rf "$out/$run"
  RAYON_NUM_THREADS=$threads /usr/bin/time -v -o "$out/$run.time" \
    "$bin/askgui-train" "${args[@]}" "${extra[@]}" --output-dir "$out/$run" 2>"$out/$run.log"
done
"$bin/examples/export_batches" --steps "$steps" --out "$out/batches.jsonl" -- "${args[@]}" --output-dir "$out/export" \
  2>>"$out/padded.log"
"$py" scripts/bench/bench_trainer_peft.py --model "$out/padded/init-model" --batches "$out/batches.jsonl" \
  "${mix_args[@]:0:4}" --rank 16 --lr 1e-4 --threads "$threads" --attn sdpa "${peft_ckpt[@]}" \
  >"$out/peft.json" 2>"$out/peft.log"

"$py" - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]

def ours(run):
    m = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"loss"' in l and '"elapsed_s"' in l]
    secs, t = m[-1]["elapsed_s"] - m[0]["elapsed_s"], m[1:]
    return dict(
        tokens_per_s=sum(r["tokens"] for r in t) / secs,
        supervised_tokens_per_s=sum(r["supervised_tokens"] for r in t) / secs,
        samples_per_s=sum(r["sequences"] for r in t) / secs,
        padding_fraction=1 - sum(r["tokens"] for r in t) / sum(r["computed_tokens"] for r in t),
        peak_rss_bytes=int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{out}/{run}.time").read())[1]) * 1024,
        first_loss=m[0]["loss"],
        losses=[r["loss"] for r in m],
    )

runs = dict(padded=ours("padded"), packed=ours("packed"))
peft = json.loads(open(f"{out}/peft.json").read())
print(f"steps {len(runs['padded']['losses'])} (1 warm-up), threads {peft['threads']}, "
      f"gradient checkpointing {'on' if peft['gradient_checkpointing'] else 'off'} on every side")
print(f"{'':24}{'askgui padded':>14}{'askgui packed':>14}{'PEFT (' + peft['attn'] + ')':>14}{'padded/PEFT':>12}{'packed/PEFT':>12}")
for k in ["supervised_tokens_per_s", "tokens_per_s", "samples_per_s", "padding_fraction", "peak_rss_bytes"]:
    a, b, c = runs["padded"][k], runs["packed"][k], peft[k]
    f = (lambda x: f"{x / 2**20:.0f} MiB") if k == "peak_rss_bytes" else (lambda x: f"{x:.3f}" if k == "padding_fraction" else f"{x:.1f}")
    ra, rb = ("-", "-") if k == "padding_fraction" else (f"{a / c:.2f}", f"{b / c:.2f}")
    print(f"{k:24}{f(a):>14}{f(b):>14}{f(c):>14}{ra:>12}{rb:>12}")
for run in runs:
    d = max(abs(x - y) for x, y in zip(runs[run]["losses"], peft["losses"]))
    print(f"{run}: largest |loss - PEFT loss| over the steps {d:.2e} (first loss {runs[run]['first_loss']:.6f}, PEFT {peft['first_loss']:.6f})")
json.dump(dict(askgui=runs, peft=peft), open(f"{out}/result.json", "w"), indent=1)
PY
