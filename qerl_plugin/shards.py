"""Output file layout of ``qerl quantize``: sizes, the split into shards, the index.

The split is huggingface_hub's (``split_state_dict_into_shards_factory``, the planner behind
``save_torch_state_dict``), run over the source tensors with the size of what each one becomes, so the
three tensors of one quantized weight always land in the same file. File names are the Hub's:
``model.safetensors``, or ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Mapping, Sequence

from qerl_plugin.source import INDEX_FILE, QuantizeError, TensorEntry, natural_key

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "human_size", "parse_size", "shard_layout", "write_index"]

DEFAULT_MAX_SHARD_SIZE = "5GB"


def human_size(n: float) -> str:
    """``181376`` -> ``181.38 kB`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def parse_size(value: int | str) -> int:
    """``5GB`` -> 5e9, ``500MiB`` -> 500 * 2**20, ``1000`` -> 1000 (bytes)."""
    if isinstance(value, int):
        if value <= 0:
            raise QuantizeError(f"max shard size must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*", str(value))
    if not m:
        raise QuantizeError(f"cannot read size {value!r}: write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    number, prefix, binary, _ = m.groups()
    base = 1024 if binary else 1000
    power = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[prefix.lower()]
    size = int(float(number) * base**power)
    if size <= 0:
        raise QuantizeError(f"max shard size must be positive, got {value!r}")
    return size


def shard_layout(
    entries: Sequence[TensorEntry],
    output_bytes: Callable[[TensorEntry], int],
    max_shard_size: int,
) -> dict[str, list[TensorEntry]]:
    """Output file name -> the source tensors written into it, in writing order.

    Each file holds at most ``max_shard_size`` bytes of output (``output_bytes(entry)`` per source tensor);
    a tensor larger than that gets a file of its own. A checkpoint without tensors still gets one
    (empty) ``model.safetensors``.
    """
    from huggingface_hub import constants, split_state_dict_into_shards_factory

    by_name = {e.name: e for e in entries}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=output_bytes,
        filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    if not split.filename_to_tensors:
        return {constants.SAFETENSORS_SINGLE_FILE: []}
    return {file: [by_name[n] for n in names] for file, names in split.filename_to_tensors.items()}


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` as transformers writes it, tensor names in natural order."""
    index = {
        "metadata": {"total_size": total_size},
        "weight_map": dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0]))),
    }
    with open(directory / INDEX_FILE, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
