"""Stream a Hugging Face checkpoint into an NVFP4A16 compressed-tensors checkpoint (``qerl quantize``).

The output is what vLLM 0.24 loads unmodified (``LLM(model=DST)``; its Marlin FP4 kernel runs it):

* every Linear of the decoder layers (``*_proj``) becomes ``weight_packed`` / ``weight_scale`` /
  ``weight_global_scale`` (:mod:`qerl_plugin.nvfp4`), q/k/v and gate/up sharing one global scale;
* ``lm_head``, embeddings, norms and biases are copied byte for byte;
* ``config.json`` gains the ``quantization_config`` of :mod:`qerl_plugin.format`; tokenizer,
  generation config and the other small files are copied; sharded outputs get
  ``model.safetensors.index.json``.

Memory stays near one output shard plus one tensor: tensors are read one at a time with
``safe_open``. A fused group's shared global scale needs the largest |w| over its parts, which may sit
in different shards; it is computed when the group is first reached, reading one part at a time.

Nothing is written next to SRC. The output is built in a hidden temporary directory beside DST and
renamed into place at the end, so an interrupted run leaves DST as it was.

    plan = plan_quantization("Qwen2.5-7B-Instruct")        # reads headers only
    print(format_plan(plan))
    quantize_checkpoint("Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct-NVFP4A16")
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "SUPPORTED_ARCHITECTURES",
    "OutputTensor",
    "QuantizeError",
    "QuantizePlan",
    "QuantizeResult",
    "TensorEntry",
    "format_plan",
    "human_size",
    "parse_size",
    "plan_quantization",
    "quantize_checkpoint",
    "resolve_source",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# Dense decoder architectures whose Linears are exactly the seven ``*_proj`` of each layer.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
_SUPPORTED_TEXT = "Qwen2/Qwen2.5 (Qwen2ForCausalLM), Qwen3, Llama, Mistral"

# Linear weights of the supported architectures, and the looser rule used with --force.
_LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")
_GENERIC_LINEAR_RE = re.compile(r"^(?:.*\.)?layers\.\d+\.(?:.*\.)?[^.]+_proj\.weight$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.\d+\.")
# Tensor names that only a quantized checkpoint has.
_QUANTIZED_SUFFIXES = (
    ".weight_packed",
    ".weight_scale",
    ".weight_global_scale",
    ".weight_zero_point",
    ".weight_scale_inv",
    ".input_scale",
    ".input_global_scale",
    ".qweight",
    ".qzeros",
    ".g_idx",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_FLOAT_DTYPES = {"BF16", "F16", "F32"}
_ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class QuantizeError(ValueError):
    """Bad input for ``qerl quantize``; the message names the file or tensor and the fix."""


# ---------------------------------------------------------------------------------------------------
# plan


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the source checkpoint, from its safetensors header."""

    name: str
    file: str  # file name relative to SRC
    dtype: str  # safetensors dtype, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _ST_DTYPE_BYTES.get(self.dtype, 0)
        for d in self.shape:
            n *= d
        return n

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output checkpoint and the source tensor it comes from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str

    @property
    def nbytes(self) -> int:
        n = _ST_DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class QuantizePlan:
    """What :func:`quantize_checkpoint` will do, decided from config.json and the safetensors headers."""

    src: Path
    architecture: str
    config: dict
    tensors: list[TensorEntry]  # processing order: file by file
    quantized: dict[str, str]  # tensor name -> module name, for the weights that become NVFP4
    fused: dict[str, tuple[str, ...]]  # module -> modules sharing its global scale (present ones, in order)
    kept_reason: dict[str, str]  # tensor name -> why it stays as is
    ignore: list[str]  # the quantization_config ignore list
    notes: list[str] = field(default_factory=list)
    copy_files: list[str] = field(default_factory=list)
    skipped_files: list[tuple[str, str]] = field(default_factory=list)

    @property
    def src_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def outputs_of(self, entry: TensorEntry) -> list[OutputTensor]:
        if entry.name not in self.quantized:
            return [OutputTensor(entry.name, entry.dtype, entry.shape, entry.name)]
        rows, cols = entry.shape
        module = self.quantized[entry.name]
        return [
            OutputTensor(f"{module}.weight_packed", "U8", (rows, cols // 2), entry.name),
            OutputTensor(f"{module}.weight_scale", "F8_E4M3", (rows, cols // nvfp4.GROUP_SIZE), entry.name),
            OutputTensor(f"{module}.weight_global_scale", "F32", (1,), entry.name),
        ]

    @property
    def dst_bytes(self) -> int:
        return sum(o.nbytes for t in self.tensors for o in self.outputs_of(t))

    def shard_layout(self, max_shard_size: int) -> list[list[TensorEntry]]:
        """Source tensors grouped into output shards of at most ``max_shard_size`` bytes (a single tensor
        larger than that gets a shard of its own); the parts of one quantized weight stay together."""
        shards: list[list[TensorEntry]] = []
        current: list[TensorEntry] = []
        size = 0
        for entry in self.tensors:
            n = sum(o.nbytes for o in self.outputs_of(entry))
            if current and size + n > max_shard_size:
                shards.append(current)
                current, size = [], 0
            current.append(entry)
            size += n
        if current or not shards:
            shards.append(current)
        return shards


def _natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


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
        local = snapshot_download(
            repo_id=text,
            ignore_patterns=["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.gguf", "*.onnx", "original/*", "consolidated*"],
        )
    except Exception as exc:  # network, auth, missing repo: all mean the same to the user
        raise QuantizeError(
            f"SRC {text!r} is not a local directory and could not be downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); check the id, your network "
            "and HF_TOKEN, or download it yourself and pass the directory"
        ) from None
    return Path(local).resolve()


def _read_config(src: Path) -> dict:
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


def _check_not_quantized(config: dict, src: Path) -> None:
    for key in (fmt.QUANTIZATION_CONFIG_NAME, "compression_config"):
        if key in config:
            qc = config[key]
            method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
            raise QuantizeError(
                f"{src / CONFIG_FILE}: the model is already quantized ({key} with quant_method {method!r}); "
                "qerl quantize needs the original BF16/FP16 checkpoint"
            )


def _architecture(config: dict, src: Path, force: bool) -> str:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    arch = archs[0] if archs else None
    if arch in SUPPORTED_ARCHITECTURES:
        return arch
    if arch is None and model_type in SUPPORTED_ARCHITECTURES.values():
        return next(a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type)
    described = f"{arch or '(no architectures)'} (model_type {model_type!r})"
    if force:
        return arch or str(model_type)
    hint = ""
    if "moe" in str(model_type).lower() or "moe" in str(arch).lower() or "num_experts" in config:
        hint = " Mixture-of-experts models are not handled: their experts are not plain *_proj Linears."
    raise QuantizeError(
        f"{src / CONFIG_FILE}: architecture {described} is not supported; qerl quantize handles "
        f"{_SUPPORTED_TEXT}.{hint} To try anyway, pass --force: every 2-D *_proj weight inside the decoder "
        "layers is quantized and every other 2-D weight is kept and listed in the ignore list (use --ignore "
        "to keep more); then check that vLLM loads the result"
    )


def _open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:
        raise QuantizeError(
            f"{path}: not a readable safetensors file ({exc}); it is truncated or corrupt: download it again"
        ) from None


def _weight_files(src: Path) -> tuple[list[str], dict[str, str] | None]:
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
        files = sorted(set(weight_map.values()), key=_natural_key)
        for name in files:
            if not (src / name).is_file():
                raise QuantizeError(
                    f"{src / name}: missing; {INDEX_FILE} lists it (e.g. for "
                    f"{next(k for k, v in weight_map.items() if v == name)}): download the complete checkpoint"
                )
        return files, weight_map
    files = sorted((p.name for p in src.glob("*.safetensors")), key=_natural_key)
    if not files:
        others = sorted(p.name for p in src.iterdir() if p.suffix in {".bin", ".pt", ".pth"})
        if others:
            raise QuantizeError(
                f"{src}: only PyTorch weights ({', '.join(others[:3])}), no *.safetensors; convert first, e.g. "
                "AutoModelForCausalLM.from_pretrained(SRC, dtype='auto').save_pretrained(NEW_DIR)"
            )
        raise QuantizeError(f"{src}: no *.safetensors weights; SRC must be a Hugging Face model directory")
    return files, None


def _read_headers(src: Path, files: Sequence[str], weight_map: dict[str, str] | None) -> list[TensorEntry]:
    entries: list[TensorEntry] = []
    seen: dict[str, str] = {}
    for name in files:
        with _open_safetensors(src / name) as f:
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


def _other_files(src: Path, weight_files: Iterable[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Top-level files to copy, and what is skipped (with why)."""
    weight_files = set(weight_files)
    copy, skipped = [], []
    for p in sorted(src.iterdir(), key=lambda p: p.name):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            skipped.append((p.name + "/", "directory"))
        elif p.name in weight_files or p.name in (CONFIG_FILE, INDEX_FILE):
            continue
        elif p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
            skipped.append((p.name, "weights not used by the safetensors checkpoint"))
        elif p.is_file():
            copy.append(p.name)
    return copy, skipped


def plan_quantization(
    src: str | os.PathLike,
    ignore: Iterable[str] = (),
    force: bool = False,
) -> QuantizePlan:
    """Decide, from config.json and the safetensors headers only, what each tensor becomes.

    Raises :class:`QuantizeError` for every problem that is visible without reading tensor data.
    """
    src = resolve_source(src)
    config = _read_config(src)
    _check_not_quantized(config, src)
    arch = _architecture(config, src, force)
    try:
        entries_ignore = fmt.validate_ignore_entries(ignore)
    except ValueError as exc:
        raise QuantizeError(f"--ignore: {exc}") from None
    files, weight_map = _weight_files(src)
    tensors = _read_headers(src, files, weight_map)
    by_name = {t.name: t for t in tensors}
    notes: list[str] = []
    if force and arch not in SUPPORTED_ARCHITECTURES:
        notes.append(f"--force: architecture {arch} is not one qerl quantize knows; check that vLLM loads the output")

    # already quantized?
    for t in tensors:
        if t.name.endswith(_QUANTIZED_SUFFIXES):
            raise QuantizeError(
                f"{src / t.file}: tensor {t.name} belongs to a quantized checkpoint; "
                "qerl quantize needs the original BF16/FP16 checkpoint"
            )

    linear_re = _LINEAR_RE if arch in SUPPORTED_ARCHITECTURES else _GENERIC_LINEAR_RE
    linear = {t.name: t.module for t in tensors if linear_re.match(t.name)}
    # 2-D weights inside the decoder layers that are not the Linears we know
    unexpected = [
        t for t in tensors
        if t.name not in linear and _LAYER_RE.search(t.name) and t.name.endswith(".weight") and len(t.shape) >= 2
    ]  # fmt: skip
    if unexpected and not force:
        t = unexpected[0]
        raise QuantizeError(
            f"{src / t.file}: tensor {t.name} {list(t.shape)} is not one of the Linear weights of {arch} "
            "(q/k/v/o_proj, gate/up/down_proj); this checkpoint has modules qerl quantize does not know. "
            "Pass --force to keep such tensors unquantized (they go into the ignore list)"
        )

    # --ignore: compressed-tensors' matching, grown to whole fused groups (vLLM fuses q/k/v and gate/up)
    all_modules = {t.module for t in tensors}
    for entry in entries_ignore:
        if not any(fmt.is_ignored(m, [entry]) for m in all_modules) and entry not in fmt.ALWAYS_IGNORED:
            if entry.startswith("re:"):
                notes.append(f"--ignore {entry!r} matches no module")
                continue
            candidates = sorted(set(linear.values()), key=_natural_key) or ["model.layers.0.mlp.down_proj"]
            wanted = entry.removesuffix(".weight")
            same_leaf = [c for c in candidates if c.rpartition(".")[2] == wanted.rpartition(".")[2]]
            close = difflib.get_close_matches(wanted, same_leaf or candidates, n=1, cutoff=0.0)
            example = close[0] if close else candidates[0]
            raise QuantizeError(
                f"--ignore {entry!r} matches no module of {src}; give a module name like {example!r} "
                "(no '.weight') or a regex like 're:.*mlp\\.down_proj$'"
            )
    linear_modules = set(linear.values())
    ignored = {m for m in linear_modules if fmt.is_ignored(m, entries_ignore)}
    ignored, added = fmt.expand_fused_ignores(ignored, linear_modules)
    for partner, by in sorted(added.items(), key=lambda kv: _natural_key(kv[0])):
        notes.append(f"also keeping {partner}: vLLM fuses it with ignored {by}")

    quantized: dict[str, str] = {}
    kept_reason: dict[str, str] = {}
    for t in tensors:
        if t.name in linear and linear[t.name] not in ignored:
            if t.dtype not in _FLOAT_DTYPES:
                why = "the checkpoint looks already quantized" if t.dtype.startswith(("F8", "I", "U")) else "unsupported dtype"
                raise QuantizeError(
                    f"{src / t.file}: Linear weight {t.name} has dtype {t.dtype} ({why}); "
                    "qerl quantize needs the original BF16/FP16/FP32 checkpoint"
                )
            if len(t.shape) != 2:
                raise QuantizeError(
                    f"{src / t.file}: Linear weight {t.name} has shape {list(t.shape)}, expected 2-D; "
                    f"keep it unquantized with --ignore {t.module}"
                )
            if t.shape[1] % nvfp4.GROUP_SIZE:
                raise QuantizeError(
                    f"{src / t.file}: {t.name} has input dimension {t.shape[1]}, not divisible by the NVFP4 "
                    f"group size {nvfp4.GROUP_SIZE}; keep it unquantized with --ignore {t.module}"
                )
            quantized[t.name] = t.module
        elif t.name in linear:
            kept_reason[t.name] = "ignored"
        elif t.module in ignored:
            kept_reason[t.name] = "ignored"
        elif t.module == "lm_head" or t.module.endswith(".lm_head"):
            kept_reason[t.name] = "lm_head stays in high precision"
        elif len(t.shape) < 2:
            kept_reason[t.name] = "bias" if t.name.endswith(".bias") else "norm" if "norm" in t.module else "1-D"
        elif "embed" in t.module:
            kept_reason[t.name] = "embedding"
        else:
            kept_reason[t.name] = "not a decoder Linear"

    # fused groups among the quantized modules; their parts must share a dtype for one global scale
    q_modules = set(quantized.values())
    module_weight = {m: by_name[f"{m}.weight"] for m in q_modules}
    fused: dict[str, tuple[str, ...]] = {}
    for m in q_modules:
        group = tuple(p for p in fmt.fused_partners(m) if p in q_modules)
        fused[m] = group
        dtypes = {module_weight[p].dtype for p in group}
        if len(dtypes) > 1:
            raise QuantizeError(
                f"{src}: the fused projections {', '.join(group)} have different dtypes ({sorted(dtypes)}); "
                "they must share one global scale: re-export the checkpoint in one dtype"
            )

    # the ignore list: lm_head, every ignored Linear, and every other kept 2-D weight that vLLM might build as
    # a Linear (unknown layer modules with --force, heads outside the layers); listing a non-Linear is harmless
    for t in unexpected:
        kept_reason[t.name] = "unknown module, kept (--force)"
    kept_2d = {t.module for t in tensors if kept_reason.get(t.name) in ("not a decoder Linear", "unknown module, kept (--force)")}
    ignore_list = sorted(set(ignored) | kept_2d, key=_natural_key)

    copy_files, skipped = _other_files(src, files)
    return QuantizePlan(
        src=src,
        architecture=arch,
        config=config,
        tensors=tensors,
        quantized=quantized,
        fused=fused,
        kept_reason=kept_reason,
        ignore=list(fmt.nvfp4a16_quantization_config(ignore_list).ignore or []),
        notes=notes,
        copy_files=copy_files,
        skipped_files=skipped,
    )


def format_plan(plan: QuantizePlan, max_shard_size: int | None = None) -> str:
    """The plan as text: one line per tensor, then the totals."""
    lines = [f"source: {plan.src} ({plan.architecture})"]
    width = max((len(t.name) for t in plan.tensors), default=10)
    for t in plan.tensors:
        shape = f"{t.dtype}{list(t.shape)}"
        if t.name in plan.quantized:
            m = plan.quantized[t.name]
            group = plan.fused.get(m, (m,))
            extra = f"  global scale shared with {', '.join(p.rpartition('.')[2] for p in group if p != m)}" if len(group) > 1 else ""
            lines.append(f"  quantize  {t.name:<{width}}  {shape} -> NVFP4{extra}")
        else:
            lines.append(f"  keep      {t.name:<{width}}  {shape}  ({plan.kept_reason.get(t.name, '')})")
    for note in plan.notes:
        lines.append(f"note: {note}")
    for name in plan.copy_files:
        lines.append(f"  copy      {name}")
    for name, why in plan.skipped_files:
        lines.append(f"  skip      {name}  ({why})")
    n_lin = len(plan.quantized) + sum(1 for r in plan.kept_reason.values() if r in ("ignored", "lm_head stays in high precision"))
    src_b, dst_b = plan.src_bytes, plan.dst_bytes
    ratio = dst_b / src_b if src_b else 0.0
    shards = ""
    if max_shard_size:
        n = len(plan.shard_layout(max_shard_size))
        shards = f" in {n} file{'s' if n != 1 else ''}"
    lines.append(
        f"{len(plan.quantized)} of {n_lin} Linear weights quantized to NVFP4; "
        f"size {human_size(src_b)} -> {human_size(dst_b)}{shards} ({ratio:.2f}x)"
    )
    lines.append(f"ignore list: {plan.ignore}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# run


@dataclass
class QuantizeResult:
    dst: Path
    files: list[str]
    src_bytes: int
    dst_bytes: int
    num_quantized: int


class _Readers:
    """safetensors handles by file, read one tensor at a time.

    At most ``keep`` files stay open: a handle maps its whole file, and the pages it has read count as
    this process's memory until it closes; reopening costs one header parse.
    """

    def __init__(self, src: Path, keep: int = 1):
        self.src = src
        self.keep = keep
        self._handles: dict[str, object] = {}

    def get(self, entry: TensorEntry) -> torch.Tensor:
        h = self._handles.pop(entry.file, None)
        if h is None:
            h = _open_safetensors(self.src / entry.file)
            while len(self._handles) >= self.keep:
                del self._handles[next(iter(self._handles))]  # least recently used
        self._handles[entry.file] = h
        try:
            return h.get_tensor(entry.name)
        except Exception as exc:
            raise QuantizeError(
                f"{self.src / entry.file}: cannot read tensor {entry.name} ({exc}); the file is corrupt: download it again"
            ) from None

    def close(self) -> None:
        self._handles.clear()


def _check_dst(src: Path, dst: Path, overwrite: bool) -> None:
    dst_r = dst.resolve()
    if dst_r == src or dst_r in src.parents or src in dst_r.parents:
        raise QuantizeError(f"DST {dst} overlaps SRC {src}; write the quantized checkpoint to a separate directory")
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir():
            raise QuantizeError(f"DST {dst} exists and is not a directory; choose another path")
        if any(dst.iterdir()) and not overwrite:
            raise QuantizeError(f"DST {dst} is not empty; pass --overwrite to replace it, or choose another directory")


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    ignore: Iterable[str] = (),
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    plan: QuantizePlan | None = None,
) -> QuantizeResult:
    """Write the NVFP4A16 checkpoint of ``src`` to ``dst``; see the module docstring."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    limit = parse_size(max_shard_size)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuantizeError(f"--device {device}: no CUDA device here; use --device cpu")
    if plan is None:
        plan = plan_quantization(src, ignore=ignore, force=force)
    src_dir = plan.src
    dst = Path(dst).expanduser()
    _check_dst(src_dir, dst, overwrite)
    for note in plan.notes:
        log(f"note: {note}")

    parent = dst.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in sorted(parent.glob(f".{glob.escape(dst.name)}.qerl-*")):
        log(f"note: {stale} is left over from an interrupted run; it is safe to delete")
    need = plan.dst_bytes + sum((src_dir / f).stat().st_size for f in plan.copy_files)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise QuantizeError(f"{parent}: {human_size(free)} free, the output needs {human_size(need)}; free some space or choose another DST")

    layout = plan.shard_layout(limit)
    names = _shard_names(len(layout))
    tag = uuid.uuid4().hex[:8]
    tmp = parent / f".{dst.name}.qerl-partial-{tag}"
    tmp.mkdir()
    old: Path | None = None
    readers = _Readers(src_dir)
    gscales: dict[tuple[str, ...], torch.Tensor] = {}
    by_name = {t.name: t for t in plan.tensors}

    def label(entry: TensorEntry) -> str:
        return f"{entry.name} in {src_dir / entry.file}"

    def group_scale(module: str) -> torch.Tensor | None:
        group = plan.fused.get(module, (module,))
        if len(group) == 1:
            return None
        if group not in gscales:
            amaxes = []
            for part in group:  # one tensor in memory at a time
                entry = by_name[f"{part}.weight"]
                w = readers.get(entry).to(device)
                nvfp4.check_weight(w, label(entry))
                amaxes.append(w.abs().amax().reshape(1))
                del w
            gscales[group] = nvfp4.global_scale(*amaxes)
        return gscales[group]

    weight_map: dict[str, str] = {}
    total = 0
    try:
        bar = tqdm(total=plan.src_bytes, unit="B", unit_scale=True, desc="qerl quantize", disable=not progress, file=sys.stderr)
        done = 0
        for shard_name, entries in zip(names, layout):
            out: dict[str, torch.Tensor] = {}
            for entry in entries:
                tensor = readers.get(entry)
                if entry.name in plan.quantized:
                    module = plan.quantized[entry.name]
                    try:
                        q = nvfp4.quantize(tensor.to(device), group_scale(module), name=label(entry))
                    except nvfp4.NVFP4Error as exc:
                        raise QuantizeError(str(exc)) from None
                    for key, value in q.tensors(module).items():
                        out[key] = value.cpu()
                else:
                    out[entry.name] = tensor
                del tensor
                done += 1
                bar.update(entry.nbytes)
                bar.set_postfix_str(f"{done}/{len(plan.tensors)} tensors", refresh=False)
            expected = {o.name for e in entries for o in plan.outputs_of(e)}
            assert set(out) == expected, f"internal error: shard {shard_name} tensors differ from the plan"
            save_file(out, str(tmp / shard_name), metadata={"format": "pt"})
            for key, value in out.items():
                weight_map[key] = shard_name
                total += value.numel() * value.element_size()
            del out
        bar.close()
        readers.close()

        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items(), key=lambda kv: _natural_key(kv[0])))}
            with open(tmp / INDEX_FILE, "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
        config = dict(plan.config)
        config[fmt.QUANTIZATION_CONFIG_NAME] = fmt.quantization_config_dict(plan.ignore)
        with open(tmp / CONFIG_FILE, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for name in plan.copy_files:
            shutil.copy2(src_dir / name, tmp / name)

        # swap into place: DST (if any) moves aside, the new tree takes its name, the old one goes
        if dst.exists():
            if any(dst.iterdir()):
                old = parent / f".{dst.name}.qerl-old-{tag}"
                dst.rename(old)
            else:
                dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        readers.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not dst.exists():
            old.rename(dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for name, why in plan.skipped_files:
        log(f"skipped {name} ({why})")
    return QuantizeResult(
        dst=dst,
        files=sorted(p.name for p in dst.iterdir()),
        src_bytes=plan.src_bytes,
        dst_bytes=total,
        num_quantized=len(plan.quantized),
    )
