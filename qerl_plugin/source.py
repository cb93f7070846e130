"""The source side of ``qerl quantize``: find the checkpoint and read what it holds without its data.

A local model directory is used as is; a Hub id is downloaded (safetensors and small files only).
From ``config.json``, ``model.safetensors.index.json`` and the safetensors headers this module lists
every tensor (:class:`TensorEntry`) and the other files to copy. Each problem raises
:class:`QuantizeError` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "ST_DTYPE_BYTES",
    "QuantizeError",
    "TensorEntry",
    "natural_key",
    "open_safetensors",
    "other_files",
    "read_config",
    "read_headers",
    "resolve_source",
    "weight_files",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# Weight files of other formats: never copied, never downloaded.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_HUB_IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.gguf", "*.onnx", "original/*", "consolidated*"]
ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class QuantizeError(ValueError):
    """Bad input for ``qerl quantize``; the message names the file or tensor and the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the source checkpoint, from its safetensors header."""

    name: str
    file: str  # file name relative to SRC
    dtype: str  # safetensors dtype, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ST_DTYPE_BYTES.get(self.dtype, 0)
        for d in self.shape:
            n *= d
        return n

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]


def natural_key(name: str) -> list:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def resolve_source(src: str | os.PathLike) -> Path:
    """A local model directory as is; otherwise a Hugging Face Hub id, downloaded (safetensors + small files)."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantizeError(f"SRC {str(src)!r} is a file; pass the model directory that holds config.json")
        return path.resolve()
    text = str(src)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) or text.startswith((".", "/")):
        raise QuantizeError(f"SRC {text!r} does not exist; pass a local model directory or a Hub id like 'Qwen/Qwen2.5-7B'")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        raise QuantizeError(f"SRC {text!r} is not a local directory and huggingface_hub is not installed") from None
    try:
        local = snapshot_download(repo_id=text, ignore_patterns=_HUB_IGNORE_PATTERNS)
    except Exception as exc:  # network, auth, missing repo: all mean the same to the user
        raise QuantizeError(
            f"SRC {text!r} is not a local directory and could not be downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check the id, your network "
            "and HF_TOKEN, or download it yourself and pass the directory"
        ) from None
    return Path(local).resolve()


def read_config(src: Path) -> dict:
    """``SRC/config.json`` as a dict."""
    path = src / CONFIG_FILE
    if not path.is_file():
        raise QuantizeError(
            f"{src}: no {CONFIG_FILE}; SRC must be a Hugging Face model directory "
            "(the folder with config.json and *.safetensors)"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise QuantizeError(f"{path}: cannot read it as JSON ({exc}); restore the model's original config.json") from None
    if not isinstance(config, dict):
        raise QuantizeError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def open_safetensors(path: Path):
    """``safe_open(path)``; a file safetensors cannot parse raises :class:`QuantizeError`."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:
        raise QuantizeError(
            f"{path}: not a readable safetensors file ({exc}); it is truncated or corrupt: download it again"
        ) from None


def weight_files(src: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read (relative names) and the index's weight map, if there is an index."""
    index_path = src / INDEX_FILE
    if index_path.is_file():
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise QuantizeError(f"{index_path}: cannot read its weight_map ({exc}); download it again") from None
        files = sorted(set(weight_map.values()), key=natural_key)
        for name in files:
            if not (src / name).is_file():
                raise QuantizeError(
                    f"{src / name}: missing; {INDEX_FILE} lists it (e.g. for "
                    f"{next(k for k, v in weight_map.items() if v == name)}): download the complete checkpoint"
                )
        return files, weight_map
    files = sorted((p.name for p in src.glob("*.safetensors")), key=natural_key)
    if not files:
        others = sorted(p.name for p in src.iterdir() if p.suffix in {".bin", ".pt", ".pth"})
        if others:
            raise QuantizeError(
                f"{src}: only PyTorch weights ({', '.join(others[:3])}), no *.safetensors; convert first, e.g. "
                "AutoModelForCausalLM.from_pretrained(SRC, dtype='auto').save_pretrained(NEW_DIR)"
            )
        raise QuantizeError(f"{src}: no *.safetensors weights; SRC must be a Hugging Face model directory")
    return files, None


def read_headers(src: Path, files: Sequence[str], weight_map: dict[str, str] | None) -> list[TensorEntry]:
    """Every tensor of ``files``, file by file; with an index, a tensor counts only in the file it names."""
    entries: list[TensorEntry] = []
    seen: dict[str, str] = {}
    for name in files:
        with open_safetensors(src / name) as f:
            for key in f.keys():
                if key in seen:
                    raise QuantizeError(f"{src / name}: tensor {key} is also in {seen[key]}; the checkpoint is inconsistent")
                if weight_map is not None and weight_map.get(key, name) != name:
                    continue  # the index says another file holds it: vLLM and transformers read that one
                seen[key] = name
                sl = f.get_slice(key)
                entries.append(TensorEntry(key, name, sl.get_dtype(), tuple(sl.get_shape())))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(seen))
        if missing:
            raise QuantizeError(
                f"{src / weight_map[missing[0]]}: has no tensor {missing[0]} although {INDEX_FILE} says so "
                f"({len(missing)} missing); download the complete checkpoint"
            )
    return entries


def other_files(src: Path, used: Iterable[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Top-level files to copy, and what is skipped (with why); ``used`` are the safetensors files read."""
    used = set(used)
    copy, skipped = [], []
    for p in sorted(src.iterdir(), key=lambda p: p.name):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            skipped.append((p.name + "/", "directory"))
        elif p.name in used or p.name in (CONFIG_FILE, INDEX_FILE):
            continue
        elif p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
            skipped.append((p.name, "weights not used by the safetensors checkpoint"))
        elif p.is_file():
            copy.append(p.name)
    return copy, skipped
