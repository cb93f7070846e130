"""The NVFP4A16 checkpoint format: the ``quantization_config`` vLLM reads, which projections fuse, and the
check that a config read back from disk is NVFP4A16.

A ``qerl quantize`` checkpoint is a plain compressed-tensors checkpoint, the same as llmcompressor's
``NVFP4A16`` preset writes: one config group targeting ``Linear``, format ``nvfp4-pack-quantized``, an
``ignore`` list that always holds ``lm_head`` and covers whole fused groups (vLLM refuses a fused layer whose
parts differ). The config objects are compressed-tensors' own; see docs/design.md, "Checkpoint format".
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

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
    preset_name_to_scheme,
)
from compressed_tensors.utils.match import match_name

from qerl_plugin import options

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
    "nvfp4a16_problem",
    "nvfp4a16_quantization_config",
    "nvfp4a16_scheme",
    "parse_quantization_config",
    "quantization_config_dict",
    "validate_ignore_entries",
]

SCHEME = "NVFP4A16"
CONFIG_GROUP = "group_0"
FORMAT = CompressionFormat(options.FORMAT).value  # "nvfp4-pack-quantized", known to compressed-tensors
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


# What NVFP4A16 quantizes a weight as; every group of an NVFP4A16 config says exactly this, symmetric.
_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


def nvfp4a16_problem(quant_cfg: Any) -> str | None:
    """``None`` if ``quant_cfg`` (``config.json``'s ``quantization_config`` dict) is a compressed-tensors
    NVFP4A16 config, the weight-only NVFP4 that vLLM runs on its Marlin FP4 kernel; else what is wrong.

    Plain dict code: vLLM's front end checks a checkpoint with it before any layer exists. Attention-only
    groups (KV-cache quantization) are skipped, as vLLM skips them.
    """
    if not isinstance(quant_cfg, Mapping):
        return f"is a {type(quant_cfg).__name__}, not a JSON object"
    method = quant_cfg.get(QUANTIZATION_METHOD_NAME)
    if method != QUANTIZATION_METHOD:
        return f"has quant_method {method!r}, not a compressed-tensors NVFP4A16 config"
    groups = quant_cfg.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        return "has no config_groups (nothing is quantized)"
    checked = 0
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            return f"config group {name!r} is a {type(group).__name__}, not a JSON object"
        targets = group.get("targets") or []
        if len(targets) == 1 and str(targets[0]).endswith("Attention"):
            continue
        weights = group.get("weights") or {}
        if not isinstance(weights, Mapping):
            return f"config group {name!r} has weights={weights!r}, not a JSON object"
        got = {k: weights.get(k) for k in _NVFP4_WEIGHTS}
        if got != _NVFP4_WEIGHTS or weights.get("symmetric", True) is not True:
            return (
                f"config group {name!r} quantizes weights as {got} (symmetric={weights.get('symmetric')}); "
                f"NVFP4 is {_NVFP4_WEIGHTS}, symmetric"
            )
        if group.get("input_activations"):
            return (
                f"config group {name!r} also quantizes input activations (NVFP4 W4A4); "
                "nvfp4 runs weight-only NVFP4 with BF16 activations (NVFP4A16)"
            )
        fmt = group.get("format") or quant_cfg.get("format")
        if fmt not in (None, FORMAT):
            return f"config group {name!r} is stored as {fmt!r}, expected {FORMAT!r}"
        checked += 1
    if checked == 0:
        return "only quantizes attention (KV cache); no linear weights are NVFP4"
    return None


def is_nvfp4a16_config(config: QuantizationConfig) -> bool:
    """:func:`nvfp4a16_problem` of a parsed compressed-tensors ``QuantizationConfig`` finds nothing."""
    return nvfp4a16_problem(config.model_dump(mode="json")) is None


def is_ignored(module_name: str, ignore: Iterable[str]) -> bool:
    """compressed-tensors' rule: an entry equals the module name, or is ``re:<regex>`` that ``re.match``-es it."""
    return any(match_name(module_name, entry) for entry in ignore)


def fused_partners(module_name: str, groups: Sequence[Sequence[str]] = FUSED_GROUPS) -> tuple[str, ...]:
    """All module names of the fused layer ``module_name`` belongs to (itself included), in group order.

    ``model.layers.0.self_attn.k_proj`` -> the q/k/v names; a module outside any group -> ``(module_name,)``.
    """
    prefix, _, leaf = module_name.rpartition(".")
    group = next((g for g in groups if leaf in g), None)
    if group is None:
        return (module_name,)
    return tuple(f"{prefix}.{part}" if prefix else part for part in group)


def expand_fused_ignores(
    ignored_modules: Iterable[str], present_modules: Iterable[str], groups: Sequence[Sequence[str]] = FUSED_GROUPS
) -> tuple[set[str], dict[str, str]]:
    """Grow a set of ignored modules to whole fused groups.

    Returns the grown set and, for each module added, the ignored partner that pulled it in (so callers
    can tell the user why). ``present_modules`` limits the added names to modules that exist.
    """
    present = set(present_modules)
    ignored = set(ignored_modules)
    added: dict[str, str] = {}
    for name in sorted(ignored):
        for partner in fused_partners(name, groups):
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
