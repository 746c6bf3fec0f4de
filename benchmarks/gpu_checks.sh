#!/usr/bin/env bash
# The project's own GPU checks, run by ../shared/gpu/check.sh on a lent GPU (at most 3 minutes): GPT-2 small
# (124M) in bf16 on one GPU, the runner's step against a plain torch loop of the same model, with tokens/s and
# model FLOPs utilisation (benchmarks/lm_step.py; random token ids, no network needed).
set -uo pipefail
cd "$(dirname "$0")/.."
timeout 170 python benchmarks/lm_step.py --preset gpt2 --device cuda --precision bf16 --rounds 2 --steps 40 --warmup 10
