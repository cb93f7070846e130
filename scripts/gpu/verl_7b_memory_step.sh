#!/usr/bin/env bash
# GPU: Qwen2.5-7B shape, LoRA r32, through verl 0.9.1: peak memory and step time, BF16-LoRA vs NVFP4-LoRA.
#   bash scripts/gpu/verl_7b_memory_step.sh build      # once (~2-4 min)
#   bash scripts/gpu/verl_7b_memory_step.sh bf16       # each run < 10 min
#   bash scripts/gpu/verl_7b_memory_step.sh nvfp4 summary
set -euo pipefail
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-./.out}
PYTHON=${PYTHON:-python3}
exec "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/verl_7b_memory_step.py" "$@"
