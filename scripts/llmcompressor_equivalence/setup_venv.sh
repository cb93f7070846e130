#!/usr/bin/env bash
# Create (or check) a separate venv with llmcompressor 0.14.0.1 for the byte-equivalence check.
#
#   scripts/llmcompressor_equivalence/setup_venv.sh VENV
#
# llmcompressor 0.14.0.1 pins compressed-tensors 0.19.0, transformers 5.15-5.17 and torch 2.10-2.14,
# which clash with qerl's stack (compressed-tensors 0.17.0, transformers 5.9.0, torch 2.11.0), so it
# lives in its own venv. Idempotent: a venv that already holds the pinned versions is left alone.
# Every other dependency is pinned by constraints.txt next to this script.
#
# torch is the CPU build of 2.13.0. pip finds it through its configuration (find-links /opt/wheels on
# the qerl machines); elsewhere set LLMC_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu so plain
# PyPI's multi-GB CUDA wheels are not pulled. PYTHON picks the interpreter (default python3, 3.10-3.13).
set -euo pipefail

if [[ $# -ne 1 || "$1" == -* ]]; then
    echo "usage: $0 VENV   (directory of the llmcompressor venv; created if missing)" >&2
    exit 2
fi
venv="$1"
python="${PYTHON:-python3}"
LLMC_VERSION="0.14.0.1"
TORCH_VERSION="2.13.0"
CT_VERSION="0.19.0"
TRANSFORMERS_VERSION="5.17.0"

check() {
    "$venv/bin/python" - "$LLMC_VERSION" "$TORCH_VERSION" "$CT_VERSION" "$TRANSFORMERS_VERSION" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
want = dict(zip(["llmcompressor", "torch", "compressed-tensors", "transformers"], sys.argv[1:]))
bad = []
for pkg, v in want.items():
    try:
        have = version(pkg)
    except PackageNotFoundError:
        have = "missing"
    if have.split("+")[0] != v:
        bad.append(f"{pkg} {have} (want {v})")
import torch
if torch.version.cuda is not None:
    bad.append(f"torch {torch.__version__} is a CUDA build (want the CPU build)")
if bad:
    print("; ".join(bad))
    sys.exit(1)
EOF
}

if [[ -x "$venv/bin/python" ]] && check >/dev/null 2>&1; then
    echo "llmcompressor venv at $venv is ready (llmcompressor $LLMC_VERSION, torch $TORCH_VERSION CPU)"
    exit 0
fi

start=$(date +%s)
if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

# every package pinned to the versions the equivalence was shown with (pip freeze of a working venv)
constraints="$(cd "$(dirname "$0")" && pwd)/constraints.txt"

torch_args=()
if [[ -n "${LLMC_TORCH_INDEX_URL:-}" ]]; then
    torch_args=(--index-url "$LLMC_TORCH_INDEX_URL")
fi
# torch first and alone, so the CPU build is the one that satisfies llmcompressor's requirement
"${pip[@]}" install -q "${torch_args[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" install -q -c "$constraints" "llmcompressor==$LLMC_VERSION"

if ! problems="$(check)"; then
    echo "error: the venv at $venv does not hold the pinned versions: $problems" >&2
    echo "fix: remove $venv and rerun; for a CUDA torch, set LLMC_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
    exit 1
fi
echo "llmcompressor venv at $venv set up in $(( $(date +%s) - start )) s"
