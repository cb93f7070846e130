#!/usr/bin/env bash
# qerl on any one CUDA GPU in minutes: tiny random Qwen2 model, synthetic arithmetic, NVFP4 + LoRA + AQN.
#
#   bash examples/tiny/run_tiny.sh                          # 20 GRPO steps, AQN over 5 stages
#   PRECISION=bf16 bash examples/tiny/run_tiny.sh           # the same with a 16-bit LoRA base, no AQN
#   bash examples/tiny/run_tiny.sh trainer.total_training_steps=5
set -euxo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export QERL_TINY_DIR=${QERL_TINY_DIR:-/tmp/qerl_tiny}
PRECISION=${PRECISION:-nvfp4}
PYTHON=${PYTHON:-python3}

"$PYTHON" "$HERE/make_tiny.py" "$QERL_TINY_DIR"

args=()
case "$PRECISION" in
  nvfp4) ;;
  bf16) args+=("actor_rollout_ref.rollout.quantization=null" "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false"
               "trainer.experiment_name=tiny-grpo-bf16") ;;
  *) echo "PRECISION must be nvfp4 or bf16, got '$PRECISION'" >&2; exit 2 ;;
esac

exec "$PYTHON" -m verl_ext.train "$HERE/config.yaml" "${args[@]}" "$@"
