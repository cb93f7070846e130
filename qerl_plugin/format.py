"""The NVFP4A16 checkpoint format: the ``quantization_config`` vLLM reads, and which projections fuse.

A checkpoint written by ``qerl quantize`` is a plain compressed-tensors checkpoint, the same shape as
what llmcompressor writes for ``QuantizationModifier(scheme="NVFP4A16", targets="Linear",
ignore=["lm_head"])``:

* one config group ``group_0`` targeting ``Linear`` with compressed-tensors' ``NVFP4A16`` preset
  (4-bit float weights, ``tensor_group`` strategy, 16-element groups, FP8-E4M3 group scales, no
  activation quantization), format ``nvfp4-pack-quantized``, status ``compressed``;
* an ``ignore`` list naming every Linear kept in high precision (``lm_head`` always);
* per quantized module the tensors ``weight_packed`` / ``weight_scale`` / ``weight_global_scale``.

vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``. Its NVFP4 layers keep one global
scale per fused layer (the largest of the parts, with a warning when they differ), so the parts of a
fused layer share one global scale, as llmcompressor makes them share; and vLLM refuses a fused layer
whose parts are not all quantized or all ignored, so the ignore list covers whole groups.

The config objects come from compressed-tensors itself (``QuantizationConfig``, the ``NVFP4A16`` preset,
``CompressionFormat``); this module adds only what compressed-tensors does not describe: the fused
groups and the checks on configs read back from disk.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from compressed_tensors.base import (
    COMPRESSION_VERSION_NAME,
    QUANTIZATION_CONFIG_NAME,
    QUANTIZATION_METHOD,
    QUANTIZATION_METHOD_NAME,
    SPARSITY_CONFIG_NAME,
    TRANSFORM_CONFIG_NAME,
)
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    QuantizationType,
    preset_name_to_scheme,
)
from compressed_tensors.utils.match import match_name

__all__ = [
    "CONFIG_GROUP",
    "FORMAT",
    "FUSED_GROUPS",
    "PARAM_NAMES",
    "QUANTIZATION_CONFIG_NAME",
    "SCHEME",
    "expand_fused_ignores",
    "fused_partners",
    "is_ignored",
    "is_nvfp4a16_config",
    "nvfp4a16_quantization_config",
    "nvfp4a16_scheme",
    "parse_quantization_config",
    "quantization_config_dict",
    "validate_ignore_entries",
]

SCHEME = "NVFP4A16"
CONFIG_GROUP = "group_0"
FORMAT = CompressionFormat.nvfp4_pack_quantized.value  # "nvfp4-pack-quantized"
TARGETS = ("Linear",)
ALWAYS_IGNORED = ("lm_head",)
# The tensors that replace ``<module>.weight`` (compressed-tensors' NVFP4PackedCompressor, symmetric, A16).
PARAM_NAMES = ("weight_packed", "weight_scale", "weight_global_scale")

# Projections that vLLM fuses into one layer; their parts share one NVFP4 global scale.
# (vLLM: ``packed_modules_mapping`` qkv_proj / gate_up_proj; llmcompressor: its default fused mappings.)
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
_FUSED_BY_LEAF = {leaf: group for group in FUSED_GROUPS for leaf in group}


def nvfp4a16_scheme(targets: Iterable[str] = TARGETS) -> QuantizationScheme:
    """compressed-tensors' ``NVFP4A16`` preset for ``targets``, stored as ``nvfp4-pack-quantized``."""
    scheme = preset_name_to_scheme(SCHEME, list(targets))
    scheme.format = FORMAT
    return scheme


def nvfp4a16_quantization_config(ignore: Iterable[str] = ()) -> QuantizationConfig:
    """The compressed ``QuantizationConfig`` of an NVFP4A16 checkpoint; ``lm_head`` is always ignored."""
    names: list[str] = list(ALWAYS_IGNORED)
    for name in ignore:
        if name not in names:
            names.append(name)
    return QuantizationConfig(
        config_groups={CONFIG_GROUP: nvfp4a16_scheme()},
        format=FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=names,
    )


def quantization_config_dict(ignore: Iterable[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json``, keyed as compressed-tensors writes it.

    ``ModelCompressor.update_config`` adds ``version``, ``quant_method``, an empty ``sparsity_config``
    and the ``transform_config`` around the ``QuantizationConfig`` dump; so do we.
    """
    import compressed_tensors

    dumped = nvfp4a16_quantization_config(ignore).model_dump(mode="json", exclude={"quant_method"})
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **dumped,
    }


def parse_quantization_config(data: dict[str, Any]) -> QuantizationConfig:
    """Validate a ``quantization_config`` dict read from ``config.json`` with compressed-tensors' model.

    Raises ``ValueError`` naming what is wrong when it is not a compressed-tensors config.
    """
    if not isinstance(data, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(data).__name__}")
    method = data.get(QUANTIZATION_METHOD_NAME)
    if method != QUANTIZATION_METHOD:
        raise ValueError(f"quantization_config has quant_method {method!r}, expected {QUANTIZATION_METHOD!r}")
    fields = {k: v for k, v in data.items() if k in QuantizationConfig.model_fields}
    return QuantizationConfig.model_validate(fields)


def is_nvfp4a16_config(config: QuantizationConfig) -> bool:
    """True when every config group is NVFP4 weight-only (what vLLM runs on its Marlin FP4 kernel)."""
    if not config.config_groups:
        return False
    for scheme in config.config_groups.values():
        if not isinstance(scheme, QuantizationScheme) or scheme.weights is None:
            return False
        w = scheme.weights
        if not (
            w.num_bits == 4
            and w.type == QuantizationType.FLOAT
            and w.strategy == QuantizationStrategy.TENSOR_GROUP
            and w.group_size == 16
            and w.symmetric
        ):
            return False
        if scheme.input_activations is not None:
            return False
        if (scheme.format or config.format) != FORMAT:
            return False
    return True


def is_ignored(module_name: str, ignore: Iterable[str]) -> bool:
    """compressed-tensors' rule: an entry equals the module name, or is ``re:<regex>`` that ``re.match``-es it."""
    return any(match_name(module_name, entry) for entry in ignore)


def fused_partners(module_name: str) -> tuple[str, ...]:
    """All module names of the fused layer ``module_name`` belongs to (itself included), in group order.

    ``model.layers.0.self_attn.k_proj`` -> the q/k/v names; a module outside any group -> ``(module_name,)``.
    """
    prefix, _, leaf = module_name.rpartition(".")
    group = _FUSED_BY_LEAF.get(leaf)
    if group is None:
        return (module_name,)
    return tuple(f"{prefix}.{part}" if prefix else part for part in group)


def expand_fused_ignores(ignored_modules: Iterable[str], present_modules: Iterable[str]) -> tuple[set[str], dict[str, str]]:
    """Grow a set of ignored modules to whole fused groups.

    Returns the grown set and, for each module added, the ignored partner that pulled it in (so callers
    can tell the user why). ``present_modules`` limits the added names to modules that exist.
    """
    present = set(present_modules)
    ignored = set(ignored_modules)
    added: dict[str, str] = {}
    for name in sorted(ignored):
        for partner in fused_partners(name):
            if partner in present and partner not in ignored:
                ignored.add(partner)
                added[partner] = name
    return ignored, added


def _is_regex(entry: str) -> bool:
    return entry.startswith("re:")


def validate_ignore_entries(entries: Iterable[str]) -> list[str]:
    """Check ``--ignore`` entries; a ``re:`` entry must compile. Returns them as a list."""
    out = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"ignore entry {entry!r}: expected a module name or 're:<regex>'")
        if _is_regex(entry):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ValueError(f"ignore entry {entry!r}: invalid regular expression ({exc})") from None
        out.append(entry)
    return out
