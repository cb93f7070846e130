"""The names qerl's packages share, and the options a vLLM engine takes from its ``additional_config``.

One definition of each: ``vllm_ext`` (inside vLLM), ``verl_ext`` (inside verl) and ``qerl_plugin`` import
them from here. Nothing here imports torch, vLLM or verl, so vLLM's plugin entry point reads it for free.

Engine options are keys of vLLM's ``additional_config``, which is part of vLLM's compile-cache key (an
engine built with AQN never reuses a graph compiled without it)::

    {"qerl_aqn": true}                                          AQN: every RMSNorm gets a noise buffer
    {"qerl_nvfp4": {"backend": "emulation", "fp32_reduce": false}}   how nvfp4 layers run (backend: auto = marlin,
                                                                humming (opt-in, vLLM's humming kernels), emulation)
    {"qerl_nvfp4": {"decode_gemv": true}}                       one-row calls on vllm_ext.nvfp4_gemv's kernel
                                                                (experimental; keeps a second copy of the weights;
                                                                "small": only layers with K <= 8192, N <= 16384;
                                                                "shared": every layer, reading Marlin's own
                                                                tensors: no copy, vllm_ext.nvfp4_marlin_row, the
                                                                default on Hopper with one GPU per engine, §4al;
                                                                "off": Marlin, the default elsewhere);
                                                                in the overlap mode with the LoRA inside it
                                                                (vllm_ext.nvfp4_gemv_lora; QERL_NO_PDL=1: no PDL,
                                                                QERL_PDL_FIRST=0: no PDL for a linear's first launch;
                                                                QERL_ROW_DECODE=f16: the float16 decode instead of
                                                                the one through FP8, sm_89+'s default since §4ba)
    {"qerl_lora": "overlap"}                                    the default: one adapter slot (max_loras=1), one
                                                                Triton launch per LoRA linear (vllm_ext.lora_fused)
                                                                on a second CUDA stream, beside the base GEMM, for
                                                                calls of <= 64 tokens; above, base GEMM then punica
    {"qerl_lora": "fused"}                                      the same kernel after the base GEMM, on one stream
    {"qerl_lora": "punica"}                                     vLLM's own multi-adapter kernels for every call
    {"qerl_lora": "dense"}                                      one adapter as two dense GEMMs (vllm_ext.lora_dense)

    vllm serve MODEL --quantization nvfp4 --additional-config '{"qerl_aqn": true}'
    LLM(MODEL, quantization="nvfp4", additional_config={"qerl_aqn": True})

Under verl, :mod:`verl_ext.rollout` writes ``qerl_aqn`` into the engine arguments when the run enables AQN.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "AQN_KEY",
    "COMPILE_ENV",
    "DECODE_GEMV_MODES",
    "FORMAT",
    "LORA_KEY",
    "LORA_DEFAULT",
    "LORA_MODES",
    "LORA_SPLIT_ADD_ENV",
    "FEW_ROW_LORA_ENV",
    "FEW_ROW_LORA_MAX_TOKENS",
    "METHOD",
    "NVFP4_BACKENDS",
    "NVFP4_BACKEND_ENV",
    "NVFP4_DECODE_GEMV_ENV",
    "NVFP4_FP32_REDUCE_ENV",
    "HUMMING_BATCH_INVARIANT_ENV",
    "NVFP4_KEY",
    "PEFT_PREFIX",
    "VERL_WORKER_EXTENSION",
    "WORKER_EXTENSION",
    "aqn_enabled",
    "engine_config",
    "lora_mode",
    "nvfp4_options",
    "parse_bool",
    "decode_gemv_default",
    "parse_decode_gemv",
]

# vLLM's ``--quantization nvfp4`` (vllm_ext.quant) and verl's ``rollout.quantization: nvfp4``.
METHOD = "nvfp4"
# compressed-tensors' CompressionFormat.nvfp4_pack_quantized: how an NVFP4A16 checkpoint stores its weights.
FORMAT = "nvfp4-pack-quantized"
# additional_config keys (see the module docstring).
AQN_KEY = "qerl_aqn"
NVFP4_KEY = "qerl_nvfp4"
# the environment variable an nvfp4 engine reads its backend from when additional_config names none
NVFP4_BACKEND_ENV = "QERL_NVFP4_BACKEND"
# ... and the other nvfp4 options the environment can give (vllm_ext.nvfp4_backends reads them)
NVFP4_FP32_REDUCE_ENV = "QERL_NVFP4_FP32_REDUCE"
NVFP4_DECODE_GEMV_ENV = "QERL_NVFP4_DECODE_GEMV"
HUMMING_BATCH_INVARIANT_ENV = "QERL_HUMMING_BATCH_INVARIANT"
NVFP4_BACKENDS = ("auto", "marlin", "humming", "emulation")
# decode_gemv: one-row calls of no layer, of the small ones (vllm_ext.nvfp4_gemv.small_linear), or of every layer the
# row kernel takes (these three keep a second, checkpoint-layout copy of the weights they take); or "shared": every
# layer, on the kernel that reads Marlin's own tensors (vllm_ext.nvfp4_marlin_row, no copy); a bool means off / all
DECODE_GEMV_MODES = ("off", "small", "all", "shared")
# where neither additional_config["qerl_nvfp4"] nor the environment names a mode: "shared" on Hopper (compute capability
# 9.x, where §4aj and §4al measured it) with one GPU per engine, "off" otherwise (decode_gemv_default)
DECODE_GEMV_DEFAULT_CAPABILITIES = range(90, 100)
LORA_KEY = "qerl_lora"
# vllm_ext.lora_fused | vLLM's multi-adapter kernels | vllm_ext.lora_dense | lora_fused's kernel on a side stream
LORA_MODES = ("fused", "punica", "dense", "overlap")
# The mode of an engine that names none: fused was faster than punica at batch 1, 8 and 64 inside a 7B engine on
# an H100 (docs/benchmarks.md §4g, §4h), and overlap faster than fused at all three (+2.9 / +1.8 / +3.6 %, 5 repeats,
# spreads <= 1.3 %; §4l lease 3); engines with more than one adapter slot run punica whatever the mode.
LORA_DEFAULT = "overlap"
# overlap mode: the op returns the base GEMM's output and the LoRA update apart and the model adds them, so that
# torch.compile fuses the add into the next kernel (1, the default: +2.6 / +2.2 / +2.1 % decode at b1 / b8 / b64 in
# one 7B H200 run, §4ah) instead of one add kernel per linear (0)
LORA_SPLIT_ADD_ENV = "QERL_LORA_SPLIT_ADD"
# overlap mode, experimental (a bool, default off): calls of 2 to FEW_ROW_LORA_MAX_TOKENS tokens of layers with
# decode_gemv's copy of the checkpoint layout (decode_gemv "all" or "small") run the Gluon GEMM with the LoRA's expand
# in its epilogue (vllm_ext.nvfp4_gluon_lora; 0.25 ms per 7B step under Marlin with the LoRA beside it at 8 rows on an
# H200, §4au) instead of Marlin and the LoRA kernel. Read per call, when the op runs (not traced)
FEW_ROW_LORA_ENV = "QERL_FEW_ROW_LORA"
FEW_ROW_LORA_MAX_TOKENS = 8  # §4au: faster than the default at 8 rows, slower at 16
# qerl's environment variables that change what vLLM traces and compiles (which op a layer calls, the arguments baked
# into the graph). vLLM keys its compile cache by its own variables only, so an engine started with another value
# of one of these would load the graph compiled for the first (it happened in §4ag); vllm_ext registers them as
# vLLM compile factors, so that each value gets its own cache entry.
COMPILE_ENV = (NVFP4_BACKEND_ENV, NVFP4_FP32_REDUCE_ENV, NVFP4_DECODE_GEMV_ENV, HUMMING_BATCH_INVARIANT_ENV,
               LORA_SPLIT_ADD_ENV)
# vLLM worker extensions: qerl's RPCs alone, and verl's extension with qerl's RPCs (what verl_ext starts).
WORKER_EXTENSION = "vllm_ext.worker_extension.QerlWorkerExtension"
VERL_WORKER_EXTENSION = "verl_ext.worker_extension.QerlVerlWorkerExtension"
# What PEFT puts in front of the wrapped model's module names (and its adapter files' tensor names).
PEFT_PREFIX = "base_model.model."

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(value: Any, what: str) -> bool:
    """``value`` as a bool: a bool, 0/1, or true/false, yes/no, on/off, 1/0 in any case; else ValueError naming ``what``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ValueError(f"{what}: expected true or false, got {value!r}")


def engine_config(*, aqn: bool) -> dict[str, Any]:
    """The ``additional_config`` entries of an engine for a run with (or without) AQN."""
    return {AQN_KEY: True} if aqn else {}


def aqn_enabled(additional_config: Mapping[str, Any] | None) -> bool:
    """Whether an engine with this ``additional_config`` builds its RMSNorms with AQN noise buffers."""
    if not additional_config or AQN_KEY not in additional_config:
        return False
    return parse_bool(additional_config[AQN_KEY], f"additional_config[{AQN_KEY!r}]")


def nvfp4_options(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``additional_config["qerl_nvfp4"]``, checked: ``backend`` (one of :data:`NVFP4_BACKENDS`), ``fp32_reduce`` (a
    bool) and ``decode_gemv`` (one of :data:`DECODE_GEMV_MODES`), each present only when given."""
    opts = (additional_config or {}).get(NVFP4_KEY) or {}
    what = f"additional_config[{NVFP4_KEY!r}]"
    if not isinstance(opts, Mapping):
        raise ValueError(f"{what}: expected a mapping such as {{'backend': 'marlin'}}, got {opts!r}")
    unknown = sorted(set(opts) - {"backend", "fp32_reduce", "decode_gemv"})
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; the keys are backend, fp32_reduce and decode_gemv")
    out: dict[str, Any] = {}
    if "backend" in opts:
        out["backend"] = parse_backend(opts["backend"], f"{what} backend")
    if "fp32_reduce" in opts:
        out["fp32_reduce"] = parse_bool(opts["fp32_reduce"], f"{what} fp32_reduce")
    if "decode_gemv" in opts:
        out["decode_gemv"] = parse_decode_gemv(opts["decode_gemv"], f"{what} decode_gemv")
    return out


def decode_gemv_default(capability: int | None, tensor_parallel: int = 1) -> str:
    """The ``decode_gemv`` mode of an engine whose options and environment name none, on a GPU of compute capability
    ``capability`` (major * 10 + minor; None where unknown) with ``tensor_parallel`` GPUs per engine: ``shared`` on
    Hopper without tensor parallelism, ``off`` otherwise.

    ``shared`` became the default on Hopper by criteria fixed before the runs (docs/benchmarks.md §4ak, §4al): §2's
    engine check passed 11/11 with it, and in one H200 run with LoRA (on the tiles shipped before §4al's sweep) it
    decoded 12.3 % faster than ``off`` at batch 1 and equal at batch 8 and 64, with the same greedy tokens. Other GPUs,
    and engines split over several GPUs, have not run its kernel, so they keep ``off``."""
    if tensor_parallel != 1:
        return "off"
    return "shared" if capability in DECODE_GEMV_DEFAULT_CAPABILITIES else "off"


def parse_decode_gemv(value: Any, what: str) -> str:
    """A ``decode_gemv`` mode (one of :data:`DECODE_GEMV_MODES`): ``off``, ``small``, ``all`` or ``shared``, any case,
    or a bool as :func:`parse_bool` reads one (true: ``all``, false: ``off``); else ValueError naming ``what``."""
    if isinstance(value, str) and value.strip().lower() in DECODE_GEMV_MODES:
        return value.strip().lower()
    try:
        return "all" if parse_bool(value, what) else "off"
    except ValueError:
        raise ValueError(f"{what}: expected off, small, all or shared (or true / false), got {value!r}") from None


def lora_mode(additional_config: Mapping[str, Any] | None) -> str:
    """``additional_config["qerl_lora"]``: how LoRA layers run (one of :data:`LORA_MODES`, default
    :data:`LORA_DEFAULT`)."""
    value = (additional_config or {}).get(LORA_KEY, LORA_DEFAULT)
    choice = str(value).strip().lower()
    if choice not in LORA_MODES:
        raise ValueError(f"additional_config[{LORA_KEY!r}]={value!r}: expected one of {', '.join(LORA_MODES)}")
    return choice


def parse_backend(value: Any, what: str) -> str:
    """An nvfp4 backend name (auto, marlin, humming, emulation), any case; else ValueError naming ``what``."""
    choice = str(value).strip().lower()
    if choice not in NVFP4_BACKENDS:
        raise ValueError(f"{what}={value!r}: expected {', '.join(NVFP4_BACKENDS[:-1])} or {NVFP4_BACKENDS[-1]}")
    return choice
