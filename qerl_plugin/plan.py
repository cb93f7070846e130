"""Planning for ``qerl quantize``: what each source tensor becomes, decided before any data is read.

From config.json and the safetensors headers (:mod:`qerl_plugin.source`) :func:`plan_quantization`
picks the Linear weights to quantize, the fused groups that share a global scale, the tensors kept as
they are (with why) and the ``ignore`` list; every problem visible there raises :class:`QuantizeError`.
:func:`format_plan` prints the plan (``qerl quantize --dry-run``).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.shards import human_size, shard_layout
from qerl_plugin.source import (
    CONFIG_FILE,
    ST_DTYPE_BYTES,
    QuantizeError,
    TensorEntry,
    natural_key,
    other_files,
    read_config,
    read_headers,
    resolve_source,
    weight_files,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "OutputTensor",
    "QuantizePlan",
    "format_plan",
    "plan_quantization",
]

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
_FLOAT_DTYPES = {"BF16", "F16", "F32"}


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output checkpoint and the source tensor it comes from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str

    @property
    def nbytes(self) -> int:
        n = ST_DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class QuantizePlan:
    """What :func:`qerl_plugin.quantize.quantize_checkpoint` will do, decided from config.json and the safetensors headers."""

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

    def output_bytes(self, entry: TensorEntry) -> int:
        """Bytes that ``entry`` takes in the output checkpoint."""
        return sum(o.nbytes for o in self.outputs_of(entry))

    @property
    def dst_bytes(self) -> int:
        return sum(self.output_bytes(t) for t in self.tensors)

    def shard_layout(self, max_shard_size: int) -> dict[str, list[TensorEntry]]:
        """Output file name -> source tensors, at most ``max_shard_size`` bytes of output per file
        (:func:`qerl_plugin.shards.shard_layout`); a quantized weight's three tensors share a file."""
        return shard_layout(self.tensors, self.output_bytes, max_shard_size)


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


def plan_quantization(
    src: str | os.PathLike,
    ignore: Iterable[str] = (),
    force: bool = False,
) -> QuantizePlan:
    """Decide, from config.json and the safetensors headers only, what each tensor becomes.

    Raises :class:`QuantizeError` for every problem that is visible without reading tensor data.
    """
    src = resolve_source(src)
    config = read_config(src)
    _check_not_quantized(config, src)
    arch = _architecture(config, src, force)
    try:
        entries_ignore = fmt.validate_ignore_entries(ignore)
    except ValueError as exc:
        raise QuantizeError(f"--ignore: {exc}") from None
    files, weight_map = weight_files(src)
    tensors = read_headers(src, files, weight_map)
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
            candidates = sorted(set(linear.values()), key=natural_key) or ["model.layers.0.mlp.down_proj"]
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
    for partner, by in sorted(added.items(), key=lambda kv: natural_key(kv[0])):
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
    ignore_list = sorted(set(ignored) | kept_2d, key=natural_key)

    copy_files, skipped = other_files(src, files)
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
