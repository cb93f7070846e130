"""What ``qerl bench rollout`` compares: configs (BF16 / NVFP4 / stock NVFP4, with or without LoRA and AQN)
times variants (engine switches to try), and the speed targets the report checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qerl_plugin.options import METHOD

__all__ = ["BASELINE", "CONFIGS", "DEFAULT_CONFIGS", "MAX_LORA_OVERHEAD", "QLORA_BASELINE", "TARGETS", "VARIANTS",
           "BenchConfig",
           "Variant", "applies", "parse_variant"]


@dataclass(frozen=True)
class BenchConfig:
    quant: str | None  # None (BF16) | "nvfp4" (ours) | "stock" (vLLM's compressed-tensors NVFP4A16 path)
    #                    | "humming" (vLLM's humming JIT W4A16 kernels on the NVFP4A16 checkpoint)
    #                    | "nf4" (QLoRA's base: vLLM's bitsandbytes loader quantizes a BF16 checkpoint to NF4)
    lora: bool = False
    aqn: bool = False


CONFIGS: dict[str, BenchConfig] = {
    "bf16": BenchConfig(None),
    "bf16-lora": BenchConfig(None, lora=True),
    "nvfp4": BenchConfig(METHOD),
    "nvfp4-lora": BenchConfig(METHOD, lora=True),
    "nvfp4-lora-aqn": BenchConfig(METHOD, lora=True, aqn=True),
    # vLLM's own compressed-tensors NVFP4A16 scheme (same Marlin kernel): the stock reference
    "stock-nvfp4": BenchConfig("stock"),
    "stock-nvfp4-lora": BenchConfig("stock", lora=True),
    # the same checkpoint through `--quantization humming` (JIT GEMMs, FP4 weights x BF16; needs the humming-kernels
    # package and a CUDA toolkit; ours on humming's GEMM is the humming-backend variant, §4ad):
    # a candidate faster small-batch kernel than Marlin, measured here before any integration
    "humming-nvfp4": BenchConfig("humming"),
    "humming-nvfp4-lora": BenchConfig("humming", lora=True),
    # QLoRA's base, the paper's other baseline (its 1.5x rollout / 1.7x end-to-end are against it): NF4 through
    # vLLM's bitsandbytes loader, which quantizes real BF16 files while loading (needs the bitsandbytes package)
    "nf4": BenchConfig("nf4"),
    "nf4-lora": BenchConfig("nf4", lora=True),
}
DEFAULT_CONFIGS = "bf16,bf16-lora,nvfp4,nvfp4-lora,nvfp4-lora-aqn"
BASELINE = "bf16-lora"
QLORA_BASELINE = "nf4-lora"  # a second ratio, where a run has it: the paper's headline multipliers are against QLoRA


@dataclass(frozen=True)
class Variant:
    """Engine switches. ``only`` limits it to configs where it changes something: "lora", "nvfp4" (our
    method) or "quant" (any NVFP4 config, stock included). A combination ("a+b") runs on every config
    that at least one part applies to (the other parts are no-ops there)."""

    help: str
    env: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # LLM(...) keyword arguments
    compilation: dict[str, Any] = field(default_factory=dict)  # compilation_config entries
    nvfp4: dict[str, Any] = field(default_factory=dict)  # additional_config["qerl_nvfp4"] entries
    additional: dict[str, Any] = field(default_factory=dict)  # other additional_config entries
    only: str | None = None  # None | "lora" | "nvfp4" | "quant"
    lora_tuned: bool = False
    parts: tuple[str, ...] = ()  # presets of a combination


VARIANTS: dict[str, Variant] = {
    "default": Variant("vLLM defaults and qerl's (LoRA: overlap); max_loras=1, max_lora_rank = adapter rank, capture "
                       "sizes = --batches"),
    "dual-stream": Variant("LoRA shrink/expand on a second CUDA stream, overlapping the base GEMM (and PDL)",
                           env={"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}, only="lora"),
    "lora-tuned": Variant("LoRA Triton kernels with shape-specific configs written by this bench "
                          "(split-K sized to K, one N tile for the rank) via VLLM_TUNED_CONFIG_FOLDER",
                          only="lora", lora_tuned=True),
    "specialize": Variant("LoRA kernel grids sized to the active adapter count (specialize_active_lora)",
                          engine={"specialize_active_lora": True}, only="lora"),
    "fully-sharded": Variant("fully_sharded_loras (matters only with tensor parallelism)",
                             engine={"fully_sharded_loras": True}, only="lora"),
    "rank64": Variant("max_lora_rank=64 with the rank-32 adapter (cost of a padded rank)",
                      engine={"max_lora_rank": 64}, only="lora"),
    "max-loras-4": Variant("max_loras=4 (RL needs 1)", engine={"max_loras": 4}, only="lora"),
    "decode-gemv": Variant("one-row GEMMs on qerl's experimental NVFP4 kernel (vllm_ext.nvfp4_gemv; keeps a second "
                           "copy of the 4-bit weights)", nvfp4={"decode_gemv": True}, only="nvfp4"),
    "decode-gemv-small": Variant("decode-gemv for the small layers only (K <= 8192, N <= 16384: q/k/v and o), the "
                                 "others' one-row GEMMs on Marlin; the second copy is theirs alone",
                                 nvfp4={"decode_gemv": "small"}, only="nvfp4"),
    "decode-gemv-shared": Variant("decode-gemv on every layer with the kernel that reads Marlin's own tensors "
                                  "(vllm_ext.nvfp4_marlin_row; no second copy; the default on Hopper since §4al)",
                                  nvfp4={"decode_gemv": "shared"}, only="nvfp4"),
    "gluon-lora": Variant("decode-gemv's copy on every layer and, with an adapter, calls of 2-8 tokens on the Gluon "
                          "GEMM with the LoRA's expand in its epilogue (vllm_ext.nvfp4_gluon_lora, "
                          "QERL_FEW_ROW_LORA=1; experimental, §4au)", env={"QERL_FEW_ROW_LORA": "1"},
                          nvfp4={"decode_gemv": True}, only="nvfp4"),
    "decode-gemv-off": Variant("every GEMM on Marlin, one-row calls too (the default before §4al, and on GPUs other "
                               "than Hopper)", nvfp4={"decode_gemv": "off"}, only="nvfp4"),
    "pdl-first-off": Variant("decode_gemv's first launch per linear (the row kernel alone, or row+lora's shrink) as a "
                             "plain launch, as before §4p (QERL_PDL_FIRST=0)", env={"QERL_PDL_FIRST": "0"},
                             only="nvfp4"),
    "row-decode-f16": Variant("the one-row kernels' E2M1 decode as before §4ba (float16 bit moves in PTX) instead "
                              "of through FP8 (QERL_ROW_DECODE=f16)", env={"QERL_ROW_DECODE": "f16"}, only="nvfp4"),
    "humming-backend": Variant("nvfp4 layers on vLLM's humming W4A16 kernels (backend humming; needs the humming-kernels "
                               "package; split-K partials added in bf16)", nvfp4={"backend": "humming"}, only="nvfp4"),
    "no-fp32-reduce": Variant("Marlin reduces split-K partials in BF16 instead of FP32",
                              nvfp4={"fp32_reduce": False}, only="nvfp4"),
    "marlin-atomic": Variant("VLLM_MARLIN_USE_ATOMIC_ADD=1 (vLLM applies it only where n < 2048)",
                             env={"VLLM_MARLIN_USE_ATOMIC_ADD": "1"}, only="quant"),
    "piecewise": Variant("piecewise CUDA graphs only (no full decode graph)",
                         compilation={"cudagraph_mode": "PIECEWISE"}),
    "full-decode-only": Variant("full CUDA graphs for decode only", compilation={"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "no-async": Variant("async scheduling off", engine={"async_scheduling": False}),
    "dense-lora": Variant("the adapter as two dense cuBLAS GEMMs per slice instead of punica (vllm_ext.lora_dense)",
                          additional={"qerl_lora": "dense"}, only="lora"),
    "punica-lora": Variant("vLLM's punica kernels for every LoRA call (qerl's default is overlap)",
                           additional={"qerl_lora": "punica"}, only="lora"),
    "overlap-lora": Variant("fused-lora's kernel on a second CUDA stream beside the base GEMM (one op per linear: "
                            "fork, base GEMM, kernel, join, add) for calls of at most 64 tokens",
                            additional={"qerl_lora": "overlap"}, only="lora"),
    "overlap-add-in-op": Variant("the overlap mode with its add inside the op, one add kernel per linear (the "
                                 "default until §4ah; QERL_LORA_SPLIT_ADD=0)", env={"QERL_LORA_SPLIT_ADD": "0"},
                                 only="lora"),
    "lora-split-add": Variant("the overlap mode's add left to torch.compile, fused into the next kernel (§4ag; the "
                              "default since §4ah, named: QERL_LORA_SPLIT_ADD=1)", env={"QERL_LORA_SPLIT_ADD": "1"},
                              only="lora"),
    "fused-lora": Variant("the adapter's shrink and expand in one Triton launch per linear for calls of at most 64 "
                          "tokens, punica above (vllm_ext.lora_fused)", additional={"qerl_lora": "fused"}, only="lora"),
}

# Speed targets: decode ratios of nvfp4-lora vs bf16-lora in the same run, per shape and batch size; LoRA
# overhead on NVFP4.
TARGETS = {"7B": {1: 2.5, 8: 2.2, 64: 1.3}, "32B": {1: 3.0}}
MAX_LORA_OVERHEAD = 0.10


def parse_variant(name: str) -> Variant:
    """A preset name, or presets joined with '+' (settings merged left to right)."""
    parts = [p.strip() for p in name.split("+") if p.strip()]
    unknown = [p for p in parts if p not in VARIANTS]
    if not parts or unknown:
        raise ValueError(f"unknown variant {name!r} (unknown: {unknown}); choose from {sorted(VARIANTS)} or join with '+'")
    if len(parts) == 1:
        return VARIANTS[parts[0]]
    return Variant(
        help=" + ".join(VARIANTS[p].help for p in parts),
        env={k: v for p in parts for k, v in VARIANTS[p].env.items()},
        engine={k: v for p in parts for k, v in VARIANTS[p].engine.items()},
        compilation={k: v for p in parts for k, v in VARIANTS[p].compilation.items()},
        nvfp4={k: v for p in parts for k, v in VARIANTS[p].nvfp4.items()},
        additional={k: v for p in parts for k, v in VARIANTS[p].additional.items()},
        lora_tuned=any(VARIANTS[p].lora_tuned for p in parts),
        parts=tuple(parts),
    )


def applies(variant: Variant, cfg: BenchConfig) -> bool:
    """Whether ``variant`` changes anything for ``cfg`` (see :class:`Variant`'s ``only``)."""
    if variant.parts:
        return any(applies(VARIANTS[p], cfg) for p in variant.parts)
    return (
        variant.only is None
        or (variant.only == "lora" and cfg.lora)
        or (variant.only == "nvfp4" and cfg.quant == METHOD)
        or (variant.only == "quant" and cfg.quant is not None)
    )
