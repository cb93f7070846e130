"""How a layer's NVFP4 weight is run: the backends of the ``nvfp4`` method and how one is chosen.

A backend installs the NVFP4 triple as the layer's kernel tensors (flagged, so reloads copy into them) and
runs the GEMM: ``marlin`` (vLLM's Marlin FP4 kernel, CUDA sm75+), ``humming`` (vLLM's humming W4A16 kernels,
opt-in; see :class:`HummingBackend`) or ``emulation`` (dequantize + ``F.linear``; where there is no CUDA, or forced to
debug). Options: ``additional_config={"qerl_nvfp4": {"backend": ...,
"fp32_reduce": ...}}`` (:mod:`qerl_plugin.options`), else ``QERL_NVFP4_BACKEND`` / ``QERL_NVFP4_FP32_REDUCE``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.platforms import current_platform

from qerl_plugin import notices, nvfp4, options
from qerl_plugin.nvfp4 import GROUP_SIZE, NVFP4Error
# importing it registers torch.ops.qerl.nvfp4_gemv_row (decode_gemv)
from vllm_ext.nvfp4_gemv import SMALL_MAX_K, SMALL_MAX_N, decode_tile, small_linear
# ... and torch.ops.qerl.nvfp4_marlin_row (decode_gemv "shared")
from vllm_ext.nvfp4_marlin_row import marlin_divisor, marlin_row_tile
from vllm_ext.quant import MIN_CAPABILITY

__all__ = [
    "BACKEND_ENV",
    "DECODE_GEMV_ENV",
    "FP32_REDUCE_ENV",
    "KERNEL_FLAG",
    "Backend",
    "EmulationBackend",
    "HummingBackend",
    "humming_compute",
    "humming_gemm",
    "humming_schema",
    "humming_tensors",
    "MarlinBackend",
    "is_nvfp4_layer",
    "kernel_tensors",
    "select_backend",
    "warn_once",
]

logger = logging.getLogger("qerl.vllm.nvfp4")

BACKEND_ENV = options.NVFP4_BACKEND_ENV
FP32_REDUCE_ENV = options.NVFP4_FP32_REDUCE_ENV
DECODE_GEMV_ENV = options.NVFP4_DECODE_GEMV_ENV
HUMMING_BATCH_INVARIANT_ENV = options.HUMMING_BATCH_INVARIANT_ENV
KERNEL_FLAG = "_qerl_kernel"
NOTICE_PREFIX = "nvfp4/"  # this module's keys in qerl_plugin.notices


def warn_once(key: str, msg: str, *args: Any) -> None:
    """Log a warning on this module's logger the first time ``key`` is seen in this process
    (:func:`qerl_plugin.notices.warn_once`, keys under :data:`NOTICE_PREFIX`)."""
    notices.warn_once(logger, NOTICE_PREFIX + key, msg, *args)


def _current_vllm_config() -> Any:
    """vLLM's current config, or None without one (layers built directly, e.g. in tests)."""
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()
    except Exception:
        return None


def _configured() -> dict[str, Any]:
    """The checked ``additional_config["qerl_nvfp4"]`` of the current vLLM config (empty without one)."""
    extra = getattr(_current_vllm_config(), "additional_config", None)
    try:
        return options.nvfp4_options(extra if isinstance(extra, dict) else None)
    except ValueError as exc:
        raise NVFP4Error(f"nvfp4: {exc}") from None


def _option(name: str, env: str, default: str, parse: Callable[[Any, str], Any]) -> Any:
    """Option ``name`` from ``additional_config["qerl_nvfp4"]``, else ``$env`` (else ``default``) parsed."""
    value = _configured().get(name)
    if value is not None:
        return value
    try:
        return parse(os.environ.get(env, default), env)
    except ValueError as exc:
        raise NVFP4Error(f"nvfp4: {exc}") from None


def _tensor_parallel_size() -> int:
    """The current vLLM config's tensor-parallel size (1 without a config: layers built directly, e.g. in tests)."""
    parallel = getattr(_current_vllm_config(), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1))


def select_backend() -> Backend:
    """The backend the options name; ``auto`` is Marlin on CUDA, emulation elsewhere (with a warning)."""
    choice = _option("backend", BACKEND_ENV, "auto", options.parse_backend)
    if choice == "emulation":
        return EmulationBackend()
    if choice == "humming":
        return HummingBackend()
    if choice == "auto" and not current_platform.is_cuda():
        warn_once(
            "emulation",
            "nvfp4: no CUDA device; NVFP4 layers run in emulation (dequantize + BF16 matmul on every call) "
            "- fine for tests, far too slow to serve"
        )
        return EmulationBackend()
    return MarlinBackend()


def is_nvfp4_layer(layer: torch.nn.Module) -> bool:
    """True when ``layer`` holds installed NVFP4 kernel tensors."""
    return bool(getattr(layer._parameters.get("weight"), KERNEL_FLAG, False)) if hasattr(layer, "_parameters") else False


def kernel_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The installed kernel tensors of an NVFP4 layer (``weight``, ``weight_scale``, ... and ``bias``)."""
    return {n: p for n, p in layer._parameters.items() if p is not None and getattr(p, KERNEL_FLAG, False)}


def _set_kernel(layer: torch.nn.Module, name: str, value: torch.Tensor) -> Parameter:
    """Install ``value`` as kernel tensor ``name``: copied into the existing buffer when there is one."""
    current = layer._parameters.get(name)
    if current is not None and getattr(current, KERNEL_FLAG, False):
        if current.shape != value.shape or current.dtype != value.dtype:
            raise NVFP4Error(
                f"{layer.qerl_nvfp4.prefix}.{name}: the reloaded weights give a {value.dtype} "
                f"{tuple(value.shape)} kernel tensor, the running one is {current.dtype} {tuple(current.shape)}; "
                "CUDA graphs hold the old buffer, so shapes cannot change - restart the engine"
            )
        current.data.copy_(value)
        return current
    if name in layer._parameters:
        delattr(layer, name)
    param = Parameter(value, requires_grad=False)
    setattr(param, KERNEL_FLAG, True)
    layer.register_parameter(name, param)
    return param


class Backend:
    """How one layer's NVFP4 weight is stored for its kernel and run."""

    name = "?"

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        """Install the kernel tensors of the triple ``packed`` uint8 [N, K/2], ``scale`` fp8 [N, K/16],
        ``gscale`` fp32 [1] (and ``raw_bias`` [N] or None); into the existing buffers when installed."""
        raise NotImplementedError

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        """Copy a reloaded natural-order bias into the kernel's bias."""
        raise NotImplementedError

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def row_weights(self, layer: torch.nn.Module, bias: torch.Tensor | None) -> tuple | None:
        """The weight in the one-row kernel's layout, ``(packed, scale, global_scale, natural-order bias or None)``,
        for callers that run that kernel themselves (the overlap LoRA mode's one-row path,
        :mod:`vllm_ext.nvfp4_gemv_lora`); None where the layer has no such copy."""
        return None


class EmulationBackend(Backend):
    """Kernel tensors = the compressed-tensors triple (``weight`` = packed uint8); dequantize per call."""

    name = "emulation"

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        _set_kernel(layer, "weight", packed)
        _set_kernel(layer, "weight_scale", scale)
        _set_kernel(layer, "weight_global_scale", gscale.reshape(1).to(torch.float32))
        if raw_bias is not None:
            _set_kernel(layer, "bias", raw_bias)

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        _set_kernel(layer, "bias", raw_bias)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = nvfp4.dequantize(layer.weight, layer.weight_scale, layer.weight_global_scale, dtype=x.dtype)
        return F.linear(x, w.to(x.device), bias)


class MarlinBackend(Backend):
    """vLLM's Marlin FP4 layout (``prepare_fp4_layer_for_marlin``) and GEMM (``apply_fp4_marlin_linear``)."""

    name = "marlin"

    def __init__(self, fp32_reduce: bool | None = None, decode_gemv: bool | str | None = None):
        if not current_platform.is_cuda():
            raise NVFP4Error(
                "nvfp4's Marlin FP4 kernel needs an NVIDIA GPU (compute capability >= 7.5); this platform is "
                f"{getattr(current_platform, 'device_name', '?')!r}. Serve the BF16 checkpoint without "
                f"--quantization, or set {BACKEND_ENV}=emulation for a (slow) functional check"
            )
        cap = current_platform.get_device_capability()
        if cap is not None and cap.to_int() < MIN_CAPABILITY:
            raise NVFP4Error(
                f"nvfp4's Marlin FP4 kernel needs compute capability >= {MIN_CAPABILITY / 10:.1f} (Turing or "
                f"newer, tuned for Hopper); this GPU is {cap.major}.{cap.minor}. Serve the BF16 checkpoint "
                "without --quantization on this GPU"
            )
        if fp32_reduce is None:
            fp32_reduce = _option("fp32_reduce", FP32_REDUCE_ENV, "1", options.parse_bool)
        self.fp32_reduce = fp32_reduce
        # experimental (docs/benchmarks.md §4j): one-row calls on vllm_ext.nvfp4_gemv's kernel, which reads the
        # checkpoint layout, so the layer keeps that copy of its weights next to Marlin's: in every layer the kernel
        # takes ("all"), or only in the small ones (q/k/v and o; nvfp4_gemv.small_linear); or ("shared", §4ah) on
        # vllm_ext.nvfp4_marlin_row's kernel, which reads Marlin's own tensors: no copy
        # Where neither names a mode: shared on Hopper with one GPU per engine, off otherwise
        # (options.decode_gemv_default, §4al)
        default = options.decode_gemv_default(None if cap is None else cap.to_int(), _tensor_parallel_size())
        if decode_gemv is None:  # the option or the environment, parsed there
            self.decode_gemv = _option("decode_gemv", DECODE_GEMV_ENV, default, options.parse_decode_gemv)
        else:
            self.decode_gemv = options.parse_decode_gemv(decode_gemv, "decode_gemv")
        named = decode_gemv is not None or "decode_gemv" in _configured() or bool(os.environ.get(DECODE_GEMV_ENV))
        if self.decode_gemv == "shared" and not named:
            warn_once("decode_gemv", "nvfp4: decode_gemv shared, the default on Hopper since qerl's §4al: one-row "
                      "GEMMs run on qerl's kernel that reads Marlin's own tensors (vllm_ext.nvfp4_marlin_row; "
                      "docs/benchmarks.md §4al); decode_gemv: off or %s=off keeps them on Marlin", DECODE_GEMV_ENV)
        elif self.decode_gemv == "all":
            warn_once("decode_gemv", "nvfp4: decode_gemv on - one-row GEMMs run on qerl's experimental NVFP4 kernel; "
                      "each layer keeps a second copy of its 4-bit weights")
        elif self.decode_gemv == "shared":
            warn_once("decode_gemv", "nvfp4: decode_gemv shared - one-row GEMMs run on qerl's NVFP4 kernel that reads "
                      "Marlin's own tensors (no second copy of the weights; vllm_ext.nvfp4_marlin_row), the default "
                      "on Hopper with one GPU per engine only; in one H200 run it was 12.3% faster than decode_gemv "
                      "off at batch 1 and equal at batch 8 and 64 (docs/benchmarks.md §4al)")
        elif self.decode_gemv == "small":
            warn_once("decode_gemv", "nvfp4: decode_gemv small - one-row GEMMs of the layers with K <= %d and N <= %d "
                      "(q/k/v and o) run on qerl's NVFP4 kernel; those layers keep a second copy of their 4-bit "
                      "weights", SMALL_MAX_K, SMALL_MAX_N)

    @staticmethod
    def _marlin(layer, packed, scale, gscale, raw_bias) -> torch.nn.Module:  # noqa: ANN001
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_fp4_layer_for_marlin

        scratch = torch.nn.Module()
        scratch.weight = Parameter(packed, requires_grad=False)
        scratch.weight_scale = Parameter(scale, requires_grad=False)
        # compressed-tensors stores the divisor 448*6/amax; Marlin takes its inverse (as vLLM's CT scheme).
        scratch.weight_global_scale = Parameter(1.0 / gscale.max().to(torch.float32), requires_grad=False)
        scratch.bias = None if raw_bias is None else Parameter(raw_bias.clone(), requires_grad=False)
        scratch.params_dtype = layer.params_dtype
        scratch.output_size_per_partition = layer.output_size_per_partition
        scratch.input_size_per_partition = layer.input_size_per_partition
        prepare_fp4_layer_for_marlin(scratch)
        return scratch

    @staticmethod
    def _fused_bias(layer: torch.nn.Module) -> bool:
        # Marlin adds a bias in its own (permuted) order. A layer with skip_bias_add returns its bias to the
        # caller, who adds it in natural order: keep that one raw and out of the GEMM.
        return not getattr(layer, "skip_bias_add", False)

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        fused = raw_bias is not None and self._fused_bias(layer)
        m = self._marlin(layer, packed, scale, gscale, raw_bias if fused else None)
        _set_kernel(layer, "weight", m.weight.data)
        _set_kernel(layer, "weight_scale", m.weight_scale.data)
        _set_kernel(layer, "weight_global_scale", m.weight_global_scale.data)
        if raw_bias is not None:
            _set_kernel(layer, "bias", m.bias.data if fused else raw_bias)
        if getattr(layer, "workspace", None) is None:
            layer.workspace = m.workspace  # plain attribute: kept (not re-created) across reloads
        row = self._gemv_ok(layer)
        self._note_shape(layer, row)
        if row and self.decode_gemv == "shared":
            # the row kernel reads Marlin's tensors: only its divisor (and a natural-order fused bias) are its own
            _set_kernel(layer, "qerl_gemv_gscale", marlin_divisor(m.weight_global_scale.data, layer.params_dtype))
            if fused:
                _set_kernel(layer, "qerl_gemv_bias", raw_bias.clone())
        elif row:
            _set_kernel(layer, "qerl_gemv_packed", packed.clone())
            _set_kernel(layer, "qerl_gemv_scale", scale.clone())
            _set_kernel(layer, "qerl_gemv_gscale", gscale.reshape(-1)[:1].to(torch.float32).clone())
            if fused:  # Marlin's bias is permuted; the one-row kernel adds the natural-order one
                _set_kernel(layer, "qerl_gemv_bias", raw_bias.clone())

    def _note_shape(self, layer: torch.nn.Module, row: bool) -> None:
        """Once per weight shape and mode: whether its one-row calls take qerl's row kernel (``row``, what
        :meth:`_gemv_ok` said) or stay on Marlin (so a run's log says which layers a decode_gemv check covered;
        ``scripts/gpu/compare_evals.py --path``)."""
        if self.decode_gemv == "off":
            return
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        where = "run on qerl's row kernel" if row else "stay on Marlin"
        warn_once(f"decode_gemv {self.decode_gemv} {n}x{k}", "nvfp4: decode_gemv %s: one-row calls of %d x %d "
                  "weights %s", self.decode_gemv, n, k, where)

    def _gemv_ok(self, layer: torch.nn.Module) -> bool:
        """Whether this layer's one-row calls take the row kernel (and the layer keeps its copy) in this mode."""
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        if self.decode_gemv == "all":
            return decode_tile(n, k) is not None
        if self.decode_gemv == "shared":  # Marlin's layout unpadded
            return marlin_row_tile(n, k) is not None
        return self.decode_gemv == "small" and small_linear(n, k)

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_pad_dim,
            marlin_padded_nk,
            marlin_permute_bias,
        )

        if not self._fused_bias(layer):
            _set_kernel(layer, "bias", raw_bias)
            return
        if "qerl_gemv_bias" in layer._parameters:
            _set_kernel(layer, "qerl_gemv_bias", raw_bias)
        n = layer.output_size_per_partition
        padded_n, _ = marlin_padded_nk(n, layer.input_size_per_partition, GROUP_SIZE)
        _set_kernel(layer, "bias", marlin_permute_bias(marlin_pad_dim(raw_bias, n, padded_n)))

    def row_weights(self, layer: torch.nn.Module, bias: torch.Tensor | None) -> tuple | None:
        if self.decode_gemv == "off" or "qerl_gemv_gscale" not in layer._parameters:
            return None
        # the caller's bias is Marlin's permuted one exactly when it is fused; the row kernel takes the natural order
        row_bias = None if bias is None else layer._parameters.get("qerl_gemv_bias", bias)
        if "qerl_gemv_packed" not in layer._parameters:  # "shared": Marlin's own tensors (int32 codes)
            return layer.weight, layer.weight_scale, layer.qerl_gemv_gscale, row_bias
        return layer.qerl_gemv_packed, layer.qerl_gemv_scale, layer.qerl_gemv_gscale, row_bias

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        row = self.row_weights(layer, bias)
        if row is not None:
            # one op, opaque to torch.compile, so that the row count is read at run time: vLLM compiles the model
            # once at a large token count and drops the guards, so a Python test on the rows here would be decided
            # for every batch size when the model is traced (the Marlin branch; §4k). Marlin takes the caller's
            # bias, the row kernel row_weights' natural-order one (added in its epilogue)
            return torch.ops.qerl.nvfp4_marlin_or_row(
                x, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.workspace,
                layer.output_size_per_partition, layer.input_size_per_partition, bias, self.fp32_reduce, *row,
            )  # fmt: skip
        return marlin_gemm(x, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.workspace,
                            layer.output_size_per_partition, layer.input_size_per_partition, bias, self.fp32_reduce)


@functools.lru_cache(maxsize=1)
def humming_schema():  # noqa: ANN201
    """humming's schema of the weights `qerl quantize` writes: the checkpoint's ``quantization_config``
    (:func:`qerl_plugin.format.quantization_config_dict`) read as vLLM's ``HummingConfig`` reads it."""
    from humming.schema import BaseWeightSchema
    from vllm.model_executor.layers.quantization.humming import compressed_tensors_get_config

    from qerl_plugin.format import quantization_config_dict

    return BaseWeightSchema.from_config(compressed_tensors_get_config(quantization_config_dict(), "weights"))


def humming_batch_invariant() -> bool:
    """Whether ``QERL_HUMMING_BATCH_INVARIANT`` asks for humming's batch-invariant mode (unset or empty: no); a value
    that is not a yes or a no is an error naming the variable."""
    try:
        return options.parse_bool(os.environ.get(HUMMING_BATCH_INVARIANT_ENV) or "false", HUMMING_BATCH_INVARIANT_ENV)
    except ValueError as exc:
        raise NVFP4Error(f"nvfp4: {exc}") from None


def humming_compute(batch_invariant: bool = False) -> str:
    """The compute config vLLM gives humming's linears (``VLLM_BATCH_INVARIANT`` as ``batch_invariant``,
    ``VLLM_HUMMING_USE_F16_ACCUM`` off)."""
    return json.dumps({"use_batch_invariant": bool(batch_invariant), "use_f16_accum": False, "gemm_type": "dense"})


def humming_tensors(packed, scale, global_scale, dtype=None):  # noqa: ANN001, ANN201
    """An NVFP4 triple in humming's own schema, converted as vLLM's ``HummingLinearMethod`` converts a
    compressed-tensors ``nvfp4-pack-quantized`` layer (``convert_humming``): ``(schema, {"weight", "weight_scale",
    "global_scale"})``, the codes as int32 words, the FP8 scales as they are, and the global scale as a multiplier
    (1 / the divisor)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    tensors = {"weight_packed": packed.contiguous(), "weight_scale": scale.contiguous(),
               "weight_global_scale": global_scale.reshape(-1)[:1].to(torch.float32)}
    return humming_schema().convert_humming(tensors=tensors, shape_n_stacks=[n], shape_k_stacks=[k],
                                            param_dtype=dtype or torch.bfloat16)


class HummingBackend(Backend):
    """vLLM's humming W4A16 GEMM (the ``humming-kernels`` package vLLM 0.24 depends on: Hopper kernels with TMA loads,
    warp specialisation and warpgroup MMA, JIT-compiled by the engine's first calls), set up as vLLM 0.24's
    ``HummingLinearMethod`` sets up a compressed-tensors NVFP4A16 layer. Its split-K (stream-K) partial sums are added
    into the bf16 output with atomics: on the 7B decode linears it was 1.31x Marlin at 64 rows and 2-3 % faster at 1
    and 8 (docs/benchmarks.md §4ac), and the 7B engine decoded 13.8 % faster at batch 64, level at 1 and 8 (§4ad); at
    1.8-3.5x Marlin's GEMM error and not bit-reproducible from call to call. In that mode the engine **failed** §2's
    check against transformers + PEFT (teacher-forced max |d logprob| 0.54-0.67 against a tolerance of 0.53, where
    Marlin gives 0.35 on the same machine; §4ae); in humming's batch-invariant mode (``QERL_HUMMING_BATCH_INVARIANT=1``:
    no split-K) it passed (0.30), but that mode is 2.3-2.8x slower than Marlin per 7B step (§4ac). Experimental and
    opt-in, for speed studies: ``additional_config={"qerl_nvfp4": {"backend": "humming"}}``. Fused layers' parts share
    one global scale (as `qerl quantize` writes them); the bias is added after the GEMM, in natural order."""

    name = "humming"

    def __init__(self):
        # vLLM's compute config; QERL_HUMMING_BATCH_INVARIANT=1: humming's batch-invariant mode (no split-K: Marlin's
        # error and reproducible, 2.3-2.8x slower per 7B step, §4ac), the diagnostic run of §4ae
        invariant = humming_batch_invariant()
        self.compute = humming_compute(invariant)
        if not current_platform.is_cuda():
            raise NVFP4Error("nvfp4 backend 'humming' needs an NVIDIA GPU; this platform is "
                             f"{getattr(current_platform, 'device_name', '?')!r}. Use backend 'auto' (Marlin)")
        try:
            import humming  # noqa: F401
        except ImportError as exc:
            raise NVFP4Error(
                f"nvfp4 backend 'humming' needs vLLM's humming kernels ({exc}), a dependency of vLLM 0.24: pip install "
                "humming-kernels==0.1.6, on a machine with a CUDA toolkit for its JIT (NVRTC or nvcc, g++, ninja); "
                "or use backend 'auto' (Marlin)"
            ) from None
        if invariant:
            warn_once("humming", "nvfp4: backend humming - vLLM's humming W4A16 kernels in their batch-invariant mode "
                      "(QERL_HUMMING_BATCH_INVARIANT; no split-K: reproducible, passed §2's engine check, 2.3-2.8x "
                      "slower than Marlin per 7B step; docs/benchmarks.md §4ac, §4ae)")
        else:
            warn_once("humming", "nvfp4: backend humming - vLLM's humming W4A16 kernels (split-K partial sums added in "
                      "bf16 with atomics: not bit-reproducible, 1.8-3.5x Marlin's GEMM error; the engine failed §2's "
                      "check against transformers + PEFT: for speed studies only; docs/benchmarks.md §4ac, §4ae)")

    @staticmethod
    def _humming(n: int, k: int, packed, scale, gscale, dtype) -> torch.nn.Module:  # noqa: ANN001
        """A scratch module with humming's tensors of the triple (``weight``, ``weight_scale``, ``global_scale``),
        its stream-K ``locks`` and its layer config string (``config``); N padded to 256 and K to 128, as vLLM."""
        from humming.layer import HummingMethod

        schema, tensors = humming_tensors(packed, scale, gscale.max().reshape(1), dtype)
        scratch = torch.nn.Module()
        for name, tensor in tensors.items():
            scratch.register_parameter(name, Parameter(tensor.clone(), requires_grad=False))
        scratch.register_buffer("locks", torch.zeros(1024, dtype=torch.int32, device=packed.device))
        meta = HummingMethod.prepare_layer_meta(layer=scratch, shape_n=n, shape_k=k, weight_schema=schema,
                                                pad_n_to_multiple=256, pad_k_to_multiple=128, has_bias=False,
                                                torch_dtype=dtype)
        HummingMethod.transform_humming_layer(scratch)
        scratch.config = meta.to_str()
        return scratch

    def install(self, layer, packed, scale, gscale, raw_bias) -> None:  # noqa: ANN001
        h = self._humming(layer.output_size_per_partition, layer.input_size_per_partition, packed, scale, gscale,
                          layer.params_dtype)
        _set_kernel(layer, "weight", h.weight.data)
        _set_kernel(layer, "weight_scale", h.weight_scale.data)
        _set_kernel(layer, "weight_global_scale", h.global_scale.data)
        if raw_bias is not None:
            _set_kernel(layer, "bias", raw_bias)
        layer.qerl_humming_config = h.config
        if getattr(layer, "qerl_humming_locks", None) is None:
            layer.qerl_humming_locks = h.locks  # plain attribute: kept across reloads (CUDA graphs hold it)

    def refresh_bias(self, layer: torch.nn.Module, raw_bias: torch.Tensor) -> None:
        _set_kernel(layer, "bias", raw_bias)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = humming_gemm(x, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.qerl_humming_locks,
                         layer.qerl_humming_config, self.compute)
        return y if bias is None else y + bias


def humming_gemm(x, weight, weight_scale, global_scale, locks, config: str, compute: str):  # noqa: ANN001, ANN201
    """``x @ W.T`` on humming's GEMM op, from the tensors and config :meth:`HummingBackend._humming` makes."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.humming.humming_gemm(config, compute, None, x2, weight, weight_scale=weight_scale,
                                       global_scale=global_scale, locks=locks)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def marlin_gemm(x, weight, weight_scale, weight_global_scale, workspace, size_n, size_k, bias, fp32_reduce):  # noqa: ANN001, ANN202
    """``x @ W.T (+ bias)`` on vLLM's Marlin FP4 GEMM, from the tensors :meth:`MarlinBackend._marlin` makes."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

    return apply_fp4_marlin_linear(
        input=x,
        weight=weight,
        weight_scale=weight_scale,
        weight_global_scale=weight_global_scale,
        workspace=workspace,
        size_n=size_n,
        size_k=size_k,
        bias=bias,
        use_fp32_reduce=fp32_reduce,
    )


MARLIN_OR_ROW_OP = "qerl::nvfp4_marlin_or_row"


@torch.library.custom_op(MARLIN_OR_ROW_OP, mutates_args=())
def nvfp4_marlin_or_row(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
    workspace: torch.Tensor, size_n: int, size_k: int, bias: torch.Tensor | None, fp32_reduce: bool,
    packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, row_bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """decode_gemv's GEMM: one row of ``x`` on the one-row kernel (checkpoint-layout ``packed``/``scale``/``gscale``,
    natural-order ``row_bias``; or, with int32 ``packed``, Marlin's own tensors and their divisor, read by
    :mod:`vllm_ext.nvfp4_marlin_row`), any other count on Marlin (its tensors and permuted ``bias``), decided per
    call."""
    if x.numel() == x.shape[-1]:
        if packed.dtype == torch.int32:
            return torch.ops.qerl.nvfp4_marlin_row(x, packed, scale, gscale, row_bias)
        return torch.ops.qerl.nvfp4_gemv_row(x, packed, scale, gscale, row_bias)
    return marlin_gemm(x, weight, weight_scale, weight_global_scale, workspace, size_n, size_k, bias, fp32_reduce)


@nvfp4_marlin_or_row.register_fake
def _nvfp4_marlin_or_row_fake(x, weight, weight_scale, weight_global_scale, workspace, size_n, size_k, bias,  # noqa: ANN001, ANN202
                              fp32_reduce, packed, scale, gscale, row_bias):
    return x.new_empty((*x.shape[:-1], size_n))
