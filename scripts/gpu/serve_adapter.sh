#!/usr/bin/env bash
# Serve an NVFP4A16 checkpoint with a LoRA adapter through `vllm serve` on localhost, send one OpenAI
# completion through the adapter (and one through the base), print them, stop the server.
#
#   bash scripts/gpu/serve_adapter.sh                      # tiny model + adapter built on the spot
#   bash scripts/gpu/serve_adapter.sh CKPT ADAPTER_DIR     # yours (CKPT from `qerl quantize`)
#   QUANTIZATION=none bash scripts/gpu/serve_adapter.sh    # vLLM's stock compressed-tensors path
#
# Output: $OUT/serve_adapter.json and $OUT/serve_adapter/server.log (OUT defaults to ./.out).
# The work is done by serve_adapter.py (health wait, timeouts, the server is killed on any exit).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-./.out}"
args=(--quantization "${QUANTIZATION:-nvfp4}")
if [[ $# -ge 2 && "$1" != -* && "$2" != -* ]]; then
  args+=(--model "$1" --adapter "$2")
  shift 2
fi
exec "${PYTHON:-python3}" scripts/gpu/serve_adapter.py "${args[@]}" "$@"
