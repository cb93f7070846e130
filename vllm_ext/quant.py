"""vLLM quantization method ``nvfp4``: NVFP4 weights, BF16 activations on Marlin FP4, LoRA on top.

It serves a compressed-tensors NVFP4A16 checkpoint as stored and quantizes a BF16/FP16 checkpoint while
loading to the same bytes. This module is the config and its registration, cheap because :func:`register`
runs in every vLLM process; the layer code (:mod:`vllm_ext.nvfp4_linear`) loads with the first layer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from qerl_plugin import notices, options
from qerl_plugin.upstream import MARLIN_FP4_MIN_CAPABILITY

if TYPE_CHECKING:  # pragma: no cover
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

__all__ = ["METHOD_NAME", "MIN_CAPABILITY", "NVFP4Config", "NVFP4ConfigError", "register"]

logger = logging.getLogger("qerl.vllm.quant")

METHOD_NAME = options.METHOD
MIN_CAPABILITY = 10 * MARLIN_FP4_MIN_CAPABILITY[0] + MARLIN_FP4_MIN_CAPABILITY[1]  # Marlin FP4 (W4A16): sm75+
# Keys accepted in a ``quantization_config`` that names ``quant_method: nvfp4`` (BF16 checkpoint, online).
_ONLINE_KEYS = {"quant_method", "ignore"}


class NVFP4ConfigError(ValueError):
    """A checkpoint/config that ``--quantization nvfp4`` cannot serve; the message says what to do."""


# ---------------------------------------------------------------------------------------------------
# checkpoint config inspection (pure dict code: runs in vLLM's front end before any layer exists)


def _nvfp4a16_problem(quant_cfg: dict[str, Any]) -> str | None:
    from qerl_plugin.format import nvfp4a16_problem  # compressed-tensors loads only when a checkpoint is read

    return nvfp4a16_problem(quant_cfg)


def _online_config_problem(quant_cfg: dict[str, Any]) -> str | None:
    unknown = set(quant_cfg) - _ONLINE_KEYS
    if unknown:
        return f"has unknown keys {sorted(unknown)} (allowed: {sorted(_ONLINE_KEYS)})"
    ignore = quant_cfg.get("ignore", [])
    if not isinstance(ignore, (list, tuple)) or not all(isinstance(x, str) for x in ignore):
        return f"has ignore={ignore!r}; expected a list of module names or 're:<regex>' patterns"
    return None


def _note_stock_path(quant_cfg: dict[str, Any]) -> None:
    """Once per process: an NVFP4A16 checkpoint loaded without ``--quantization nvfp4`` runs on vLLM's stock
    compressed-tensors path, without qerl's decode kernels; say so and how to choose qerl's method. Never raises:
    the stock path must load whatever this check thinks of the config."""
    try:
        if quant_cfg.get("quant_method") != "compressed-tensors" or _nvfp4a16_problem(quant_cfg) is not None:
            return
    except Exception:  # noqa: BLE001 (a config this check cannot read is vLLM's to judge)
        return
    notices.warn_once(logger, "quant/stock path",
                      "qerl: this NVFP4A16 checkpoint runs on vLLM's stock compressed-tensors path; --quantization "
                      "nvfp4 runs it on qerl's nvfp4 method instead (what verl's rollout runs; on Hopper with one GPU "
                      "per engine, its one-row decode calls take qerl's row kernel with the LoRA fused, on the layers "
                      "whose Marlin layout allows it)")


def _fix_hint(method: Any) -> str:
    return (
        "nvfp4 serves compressed-tensors NVFP4A16 checkpoints (`qerl quantize`, llmcompressor's NVFP4A16 "
        "preset) and plain BF16/FP16 checkpoints (quantized while loading). Fix: drop `--quantization nvfp4` "
        f"to serve this checkpoint with vLLM's own {method!r} method, or point vLLM at the BF16 checkpoint "
        "(or a `qerl quantize` output) instead."
    )


# ---------------------------------------------------------------------------------------------------
# the config


class NVFP4Config(QuantizationConfig):
    """``--quantization nvfp4``.

    ``ct_config`` is vLLM's own :class:`CompressedTensorsConfig` for an NVFP4A16 checkpoint (its target
    matching, ignore list, KV-cache scheme and MoE methods are reused as is); ``None`` means a BF16/FP16
    checkpoint quantized while loading, skipping the modules in ``ignore`` (names or ``re:`` patterns).
    """

    def __init__(self, ct_config: CompressedTensorsConfig | None = None, ignore: list[str] | None = None):
        self._ct = ct_config
        self._packed_modules_mapping: dict[str, list[str]] = {}
        super().__init__()  # sets packed_modules_mapping through the property below
        self.ignore: list[str] = list(ignore or [])
        if ct_config is not None and ignore:
            raise NVFP4ConfigError("ignore is read from the checkpoint's quantization_config; pass none here")

    # vLLM assigns the model's fused-module map here (configure_quant_config); the CT config needs it too.
    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return self._packed_modules_mapping

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value: dict[str, list[str]]) -> None:
        self._packed_modules_mapping = value
        if self._ct is not None:
            self._ct.packed_modules_mapping = value

    @property
    def source(self) -> str:
        """``"checkpoint"`` (compressed-tensors NVFP4A16) or ``"bf16"`` (quantized while loading)."""
        return "bf16" if self._ct is None else "checkpoint"

    @property
    def ct_config(self) -> CompressedTensorsConfig | None:
        return self._ct

    def __repr__(self) -> str:
        return f"NVFP4Config(source={self.source!r}, ignore={self.ignore if self._ct is None else self._ct.ignore})"

    # -- QuantizationConfig interface ---------------------------------------------------------------

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty: a checkpoint without quantization_config (BF16) gets NVFP4Config() (vLLM get_quant_config).
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NVFP4Config:
        method = config.get("quant_method")
        if method == "compressed-tensors":
            problem = _nvfp4a16_problem(config)
            if problem is not None:
                raise NVFP4ConfigError(f"The checkpoint's quantization_config {problem}. " + _fix_hint(method))
            from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
                CompressedTensorsConfig,
            )

            # CompressedTensorsConfig.from_config edits config_groups in place: give it a copy.
            return cls(ct_config=CompressedTensorsConfig.from_config(dict(config)))
        if method in (None, METHOD_NAME):
            problem = _online_config_problem(config)
            if problem is not None:
                raise NVFP4ConfigError(
                    f"quantization_config {config!r} {problem}. For a BF16 checkpoint quantized while loading "
                    "use no quantization_config, or {'quant_method': 'nvfp4', 'ignore': [...]} "
                    "(e.g. through hf_overrides) to keep some modules in BF16."
                )
            return cls(ignore=list(config.get("ignore", [])))
        raise NVFP4ConfigError(f"The checkpoint's quantization_config has quant_method {method!r}. " + _fix_hint(method))

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """Claim a compressed-tensors NVFP4A16 checkpoint when the user asked for ``--quantization nvfp4``."""
        if user_quant != METHOD_NAME:
            if user_quant is None:
                _note_stock_path(hf_quant_cfg)
            return None
        method = hf_quant_cfg.get("quant_method")
        if method == METHOD_NAME:
            problem = _online_config_problem(hf_quant_cfg)
        else:
            problem = _nvfp4a16_problem(hf_quant_cfg)
        if problem is None:
            return METHOD_NAME
        raise NVFP4ConfigError(
            f"`--quantization nvfp4` cannot load this checkpoint: its config.json quantization_config {problem}. "
            + _fix_hint(method)
        )

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:  # noqa: ANN001 (vllm WeightsMapper)
        if self._ct is not None:
            self._ct.apply_vllm_mapper(hf_to_vllm_mapper)
        else:
            self.ignore = [
                t if (t.startswith("re:") or "." not in t) else (hf_to_vllm_mapper._map_name(t) or t)
                for t in self.ignore
            ]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm_ext import nvfp4_linear  # the layer code and its heavy vLLM imports, on first use

        return nvfp4_linear.get_quant_method(self, layer, prefix)


# ---------------------------------------------------------------------------------------------------
# registration


def register() -> None:
    """Register ``nvfp4`` with vLLM (idempotent; the vLLM-AQN hook lives in ``vllm_ext.noisy_norm``)."""
    from vllm.model_executor.layers import quantization as vq

    registered = getattr(vq, "_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", {}).get(METHOD_NAME)
    if METHOD_NAME in QUANTIZATION_METHODS and registered is NVFP4Config:
        return
    if registered is not None:
        logger.warning("quantization method %r was registered by %r; qerl-plugin replaces it", METHOD_NAME, registered)
    register_quantization_config(METHOD_NAME)(NVFP4Config)
    logger.debug("registered vLLM quantization method %r", METHOD_NAME)
