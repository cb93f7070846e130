"""``qerl eval --backend vllm``: generation with ``vllm.LLM`` on a GPU, a LoRA adapter served unmerged.

MODEL is a BF16 checkpoint (``--quantization nvfp4`` quantizes it at load with qerl's ``nvfp4`` method) or
an NVFP4A16 compressed-tensors checkpoint from ``qerl quantize``: vLLM detects it and runs its stock
compressed-tensors path (Marlin FP4) unless ``--quantization nvfp4`` hands it to qerl's ``nvfp4`` method, the one
verl's rollout runs (the same Marlin FP4 for many rows; on Hopper one-row decode steps take qerl's row kernel,
``decode_gemv``). An adapter is passed per request as a ``LoRARequest``; ``max_lora_rank`` is the
smallest value vLLM accepts that holds the adapter's rank. :mod:`qerl_plugin.evaluate` loads this module
by name only when the vLLM backend is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from qerl_plugin import options
from qerl_plugin.evaluate_inputs import AdapterInfo, EvalError, ModelInfo
from qerl_plugin.evaluate_metrics import Completion

if TYPE_CHECKING:  # pragma: no cover
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

__all__ = [
    "ADAPTER_NAME",
    "VLLMBackend",
    "allowed_lora_ranks",
    "check_adapter_for_vllm",
    "engine_kwargs",
    "kernels_line",
    "lora_request",
    "max_lora_rank_for",
    "sampling_params",
    "to_completion",
]

ADAPTER_NAME = "qerl-eval-adapter"


def allowed_lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(get_args(MaxLoRARanks)))


def max_lora_rank_for(adapter: AdapterInfo, allowed: Sequence[int] | None = None, asked: int | None = None) -> int:
    """The smallest allowed ``max_lora_rank`` that holds the adapter's rank; refuses a rank above them all. ``asked``
    (``--max-lora-rank``): that value instead, where vLLM allows it and it holds the adapter (vLLM pads the adapter
    to it: qerl's fused LoRA kernels take ranks of 16 and more, so an r8 adapter served at 16 runs them)."""
    allowed = sorted(allowed if allowed is not None else allowed_lora_ranks())
    if asked is not None:
        if asked not in allowed or asked < adapter.rank:
            raise EvalError(f"--max-lora-rank {asked}: expected one of vLLM's {allowed} at or above the adapter's rank "
                            f"{adapter.rank} ({adapter.path})")
        return asked
    fits = [r for r in allowed if r >= adapter.rank]
    if not fits:
        raise EvalError(
            f"--adapter {adapter.path}: LoRA rank {adapter.rank} is above vLLM's largest max_lora_rank "
            f"{allowed[-1]} (allowed: {allowed}); retrain with a smaller rank, or use --backend hf for a small model"
        )
    return fits[0]


def engine_kwargs(
    info: ModelInfo,
    *,
    adapter: AdapterInfo | None = None,
    quantization: str | None = None,
    dtype: str = "auto",
    seed: int = 0,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_lora_rank: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for MODEL (and the adapter). ``max_num_seqs`` 1 decodes one sequence at a
    time, so every decode step is a one-row GEMM (the path ``decode_gemv`` changes)."""
    kwargs: dict[str, Any] = {"model": str(info.path), "dtype": dtype, "seed": seed}
    if quantization == options.METHOD:
        kwargs["quantization"] = options.METHOD
    elif quantization is not None:
        raise EvalError(f"--quantization {quantization!r}: qerl eval knows {options.METHOD!r} (or none)")
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if max_lora_rank is not None and adapter is None:
        raise EvalError(f"--max-lora-rank {max_lora_rank} without --adapter: there is no LoRA to serve")
    if adapter is not None:
        rank = max_lora_rank_for(adapter, asked=max_lora_rank)
        check_adapter_for_vllm(adapter, rank, info.config.get("max_position_embeddings"))
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=rank)
    return kwargs


def kernels_line(info: ModelInfo, kwargs: dict[str, Any]) -> str:
    """Which quantization path the engine built from ``kwargs`` runs MODEL on, in words for the eval log."""
    if kwargs.get("quantization") == options.METHOD:
        if info.quantization == "nvfp4a16":
            return "qerl's nvfp4 method on the NVFP4A16 checkpoint (the kernels verl's rollout runs)"
        return "qerl's nvfp4 method, the BF16 weights quantized at load"
    if info.quantization == "nvfp4a16":
        return ("vLLM's stock compressed-tensors path for NVFP4A16; --quantization nvfp4 runs qerl's nvfp4 method "
                "instead, as verl's rollout does")
    if info.quantization:
        return f"vLLM's own {info.quantization} method"
    return "no quantization"


def check_adapter_for_vllm(adapter: AdapterInfo, max_lora_rank: int, max_position_embeddings: int | None = None) -> None:
    """vLLM's own adapter checks (``PEFTHelper.validate_legal``: rank, bias, unsupported features), run
    before the engine starts instead of at the first request."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    try:
        helper = PEFTHelper.from_local_dir(str(adapter.path), max_position_embeddings=max_position_embeddings)
        helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank, max_loras=1))
    except (ValueError, TypeError) as exc:
        raise EvalError(f"--adapter {adapter.path}: vLLM cannot serve it: {exc}") from None


def lora_request(adapter: AdapterInfo | None) -> "LoRARequest | None":
    """The request that applies the adapter (unmerged) to a generation, or None without one."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, 1, str(adapter.path))


def sampling_params(n: int, temperature: float, max_new_tokens: int, eos_ids: Sequence[int]) -> "SamplingParams":
    """Plain sampling at ``temperature`` (0: greedy), no top-k/top-p, stopping at any of ``eos_ids``."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=1.0,
        max_tokens=max_new_tokens,
        stop_token_ids=list(eos_ids),
        skip_special_tokens=True,
    )


def to_completion(output: Any) -> Completion:
    """A vLLM ``CompletionOutput`` as a :class:`Completion`."""
    return Completion(text=output.text, num_tokens=len(output.token_ids), truncated=output.finish_reason == "length")


class VLLMBackend:
    """``vllm.LLM`` behind the interface of :class:`qerl_plugin.evaluate_hf.HFBackend`."""

    name = "vllm"

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Any = None,
        *,
        adapter: AdapterInfo | None = None,
        quantization: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_lora_rank: int | None = None,
        progress: bool = True,
    ):
        kwargs = engine_kwargs(
            info,
            adapter=adapter,
            quantization=quantization,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_lora_rank=max_lora_rank,
        )
        import torch

        if not torch.cuda.is_available():
            raise EvalError("--backend vllm needs a CUDA GPU and none is visible here; use --backend hf (small models, CPU)")
        from vllm import LLM

        self.kwargs = kwargs
        self.info = info
        self.progress = progress
        self.lora = lora_request(adapter)
        self.llm = LLM(**kwargs)

    def describe(self) -> str:
        extra = f", max_lora_rank {self.kwargs['max_lora_rank']}" if self.lora else ""
        return f"vLLM, {kernels_line(self.info, self.kwargs)}{extra}"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        pad_id: int | None = None,
        seed: int = 0,
        desc: str = "generate",
    ) -> list[list[Completion]]:
        params = sampling_params(n, temperature, max_new_tokens, eos_ids)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, params, lora_request=self.lora, use_tqdm=self.progress)
        return [[to_completion(o) for o in out.outputs] for out in outputs]

    def close(self) -> None:
        self.llm = None
