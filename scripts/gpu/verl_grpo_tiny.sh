#!/usr/bin/env bash
# GPU: verl 0.9.1 main_ppo on a tiny Qwen2 with qerl (NVFP4 + LoRA + AQN): nvfp4, bf16, dapo, resume phases.
#   bash scripts/gpu/verl_grpo_tiny.sh            # all phases
#   bash scripts/gpu/verl_grpo_tiny.sh nvfp4      # one phase per call (each < 10 min); resume needs nvfp4
# Needs vllm/verl/ray and this project installed into /tmp/site (see /work/shared/gpu/README.md).
set -euo pipefail
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-./.out}
PYTHON=${PYTHON:-python3}
exec "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/verl_grpo_tiny.py" "$@"
