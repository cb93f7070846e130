#!/usr/bin/env bash
# QeRL DAPO on math with verl 0.9.1 + vLLM 0.24.0: NVFP4 base + LoRA + AQN on one GPU.
#
#   bash examples/dapo_math/run_dapo.sh                                  # Qwen2.5-7B-Instruct, QeRL (NVFP4 + AQN)
#   MODEL_SIZE=32b bash examples/dapo_math/run_dapo.sh                   # 3b | 7b | 14b | 32b
#   PRECISION=bf16 bash examples/dapo_math/run_dapo.sh                   # 16-bit LoRA baseline (no AQN, lr 5e-6)
#   MODEL_PATH=/models/qwen2.5-7b-nvfp4 bash examples/dapo_math/run_dapo.sh   # an NVFP4 checkpoint (qerl quantize)
#   bash examples/dapo_math/run_dapo.sh trainer.total_training_steps=50  # any verl override
#
# Data: DATA_DIR/{train,test}.parquet in verl's row format, e.g.
#   DAPO-Math-17k as verl's DAPO recipe prepares it (data_source math_dapo), any math set with
#   data_source + reward_model.ground_truth, or GSM8K (python scripts/data/prepare_gsm8k.py SRC DIR)
set -euxo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL_SIZE=${MODEL_SIZE:-7b}
MODEL_PATH=${MODEL_PATH:-}
DATA_DIR=${DATA_DIR:-$HOME/data/dapo-math}
PRECISION=${PRECISION:-nvfp4}
AQN=${AQN:-true}
LOGGER=${LOGGER:-console}
CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints}
ATTN=${ATTN:-}
PYTHON=${PYTHON:-python3}

args=(
  "data.train_files=$DATA_DIR/train.parquet"
  "data.val_files=$DATA_DIR/test.parquet"
  "trainer.logger=[$LOGGER]"
  "trainer.default_local_dir=$CKPT_DIR/dapo-math-qwen2.5-$MODEL_SIZE-$PRECISION"
  "actor_rollout_ref.rollout.custom.qerl.aqn.enable=$AQN"
)
if [[ -n "$MODEL_PATH" ]]; then args+=("actor_rollout_ref.model.path=$MODEL_PATH"); fi
if [[ -n "$ATTN" ]]; then args+=("+actor_rollout_ref.model.override_config.attn_implementation=$ATTN"); fi
case "$PRECISION" in
  nvfp4) ;;
  bf16)
    args+=(
      "actor_rollout_ref.rollout.quantization=null"
      "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false"
      "actor_rollout_ref.actor.optim.lr=5e-6"
      "trainer.experiment_name=dapo-math-qwen2.5-$MODEL_SIZE-bf16"
    )
    ;;
  *) echo "PRECISION must be nvfp4 or bf16, got '$PRECISION'" >&2; exit 2 ;;
esac

exec "$PYTHON" -m verl_ext.train "$HERE/config/qwen2.5-$MODEL_SIZE.yaml" "${args[@]}" "$@"
