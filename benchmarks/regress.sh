#!/usr/bin/env bash
# The side-by-side runs that guard the communication core against regressions (gloo, this machine,
# namespaces + tbf): the demo's five strategies, the gradient stage vs DDP, SlimGC on the GPT and
# EmbRace 2D on the sampled word LM at 100 Mbit/s, and the core overhead against raw torch.distributed.
# Compare with README's published figures. Usage: benchmarks/regress.sh OUT_DIR  (~20 min; run it alone)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/regress.sh OUT_DIR}
LB=.venv/bin/lowband
mkdir -p "$OUT"
$LB demo --out "$OUT/demo"
$LB bench -w fmnist-cnn -s "ddp+stage+powersgd" -n 4 --rate 100mbit --rounds 6 --steps-per-round 20 \
    --out "$OUT/stage-100mbit"
$LB bench -w shakespeare-gpt -s "powersgd+slimgc" -n 4 --rate 100mbit --rounds 5 --steps-per-round 20 \
    --out "$OUT/slimgc-gpt"
$LB bench -w wordlm-sampled -s "embrace+embrace:schedule=2d,overlap=true" -n 4 --rate 100mbit --rounds 4 \
    --steps-per-round 8 --out "$OUT/embrace-wordlm"
.venv/bin/python benchmarks/core_overhead.py --world-sizes 2,4 --sizes 64KB,1MB,4MB,16MB --reps 100 \
    --warmup 5 --fusion-tensors 1000 --fusion-reps 3 --out "$OUT/core_overhead_check.json"
