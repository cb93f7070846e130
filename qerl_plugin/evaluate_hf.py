"""``qerl eval --backend hf``: transformers generation for small models, on CPU or one GPU.

The base model's Linear weights are what the NVFP4 rollout computes with, decoded by
:mod:`qerl_plugin.nvfp4`:

* an NVFP4A16 checkpoint (``qerl quantize`` output): each module's ``weight_packed`` / ``weight_scale`` /
  ``weight_global_scale`` become ``weight = dequantize(...)`` in a model built from its config;
* a BF16 checkpoint with ``--quantization nvfp4``: the decoder ``*_proj`` weights that ``qerl quantize``
  would quantize (its plan: same modules, q/k/v and gate/up sharing one global scale) are replaced by
  their quantize-dequantize round trip, bit-identical to loading that checkpoint.

A LoRA adapter is applied unmerged with PEFT (``PeftModel.from_pretrained``). Generation is batched with
left padding; sampling is plain temperature sampling (no top-k/top-p, and none of the model's
``generation_config.json`` defaults), as the vLLM backend does.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

from qerl_plugin import nvfp4
from qerl_plugin.evaluate_inputs import AdapterInfo, EvalError, ModelInfo
from qerl_plugin.evaluate_metrics import Completion

__all__ = ["HFBackend", "generate_left_padded", "load_model", "nvfp4_checkpoint_weights", "nvfp4_round_trip_weights"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _checkpoint_dtype(info: ModelInfo, dtype: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    name = info.config.get("dtype") or info.config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def _read_tensors(info: ModelInfo, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of MODEL's safetensors files (all, or those in ``names``)."""
    from qerl_plugin.source import open_safetensors, weight_files

    files, weight_map = weight_files(info.path)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with open_safetensors(info.path / file) as f:
            for key in f.keys():
                if (names is None or key in names) and (weight_map is None or weight_map.get(key, file) == file):
                    out[key] = f.get_tensor(key)
    return out


def nvfp4_checkpoint_weights(info: ModelInfo, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict of an NVFP4A16 checkpoint with every quantized module's ``weight`` decoded to ``dtype``."""
    tensors = _read_tensors(info)
    state: dict[str, torch.Tensor] = {}
    quantized = set(info.nvfp4_modules)
    for module in quantized:
        try:
            state[f"{module}.weight"] = nvfp4.dequantize(
                tensors.pop(f"{module}.weight_packed"),
                tensors.pop(f"{module}.weight_scale"),
                tensors.pop(f"{module}.weight_global_scale"),
                dtype=dtype,
            )
        except KeyError as exc:
            raise EvalError(
                f"{info.path}: module {module} has weight_packed but no {exc.args[0].rpartition('.')[2]}; "
                "the checkpoint is incomplete: write it again with `qerl quantize`"
            ) from None
        except nvfp4.NVFP4Error as exc:
            raise EvalError(f"{info.path}: module {module}: {exc}") from None
    state.update(tensors)
    return state


def nvfp4_round_trip_weights(info: ModelInfo, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{module.weight: dequantize(quantize(weight))}`` for the modules ``qerl quantize`` would quantize."""
    from qerl_plugin.plan import plan_quantization

    plan = plan_quantization(info.path)
    groups = sorted(set(plan.fused.values()))
    names = {f"{m}.weight" for group in groups for m in group}
    source = _read_tensors(info, names)
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        parts = [f"{m}.weight" for m in group]
        for name, q in zip(parts, nvfp4.quantize_fused([source[p] for p in parts], names=parts)):
            out[name] = q.dequantize(dtype)
    return out


def load_model(info: ModelInfo, quantization: str | None = None, dtype: str = "auto", device: str = "cpu"):
    """MODEL as a transformers causal LM whose NVFP4 Linears hold their dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = _checkpoint_dtype(info, dtype)
    if info.quantization == "nvfp4a16":
        config = AutoConfig.from_pretrained(info.path)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are decoded here, not by a transformers quantizer
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        state = nvfp4_checkpoint_weights(info, torch_dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if info.tied_embeddings else set()
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise EvalError(
                f"{info.path}: the checkpoint does not match its config.json's model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}); write it again with `qerl quantize` from the BF16 model"
            )
        if info.tied_embeddings:
            model.tie_weights()
    elif info.quantization is not None:
        raise EvalError(
            f"MODEL {info.path} is quantized ({info.quantization}, not NVFP4A16); the hf backend runs BF16 and "
            "NVFP4A16 checkpoints: use --backend vllm on a GPU, or the BF16 checkpoint"
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch_dtype)
        if quantization == "nvfp4":
            with torch.no_grad():
                for name, weight in nvfp4_round_trip_weights(info, torch_dtype).items():
                    model.get_parameter(name).copy_(weight)
    return model.to(device).eval()


@torch.no_grad()
def generate_left_padded(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    pad_id: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    desc: str = "generate",
    **generate_kwargs,
) -> list[list[int]]:
    """``model.generate(**generate_kwargs)`` over token-id ``prompts`` in left-padded batches of ``batch_size``:
    the new tokens of every returned sequence, prompt by prompt (``num_return_sequences`` each)."""
    from tqdm.auto import tqdm

    out: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr, disable=not progress)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out += model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs)[:, width:].tolist()
        bar.update(len(batch))
    bar.close()
    return out


class HFBackend:
    """Generation with transformers; ``generate`` takes token ids and returns completions per prompt."""

    name = "hf"

    def __init__(
        self,
        info: ModelInfo,
        tokenizer,
        *,
        adapter: AdapterInfo | None = None,
        quantization: str | None = None,
        dtype: str = "auto",
        batch_size: int = 8,
        device: str | None = None,
        progress: bool = True,
    ):
        self.tokenizer = tokenizer
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self.progress = progress
        self.model = load_model(info, quantization, dtype, self.device)
        # only the options given to generate() apply, as in vLLM with explicit SamplingParams: the model's
        # generation_config.json (top_k, top_p, repetition_penalty, ...) would otherwise fill the rest
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, str(adapter.path)).eval()

    def describe(self) -> str:
        return f"transformers on {self.device}"

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        pad_id: int,
        seed: int = 0,
        desc: str = "generate",
    ) -> list[list[Completion]]:
        sample = temperature > 0
        if sample:
            torch.manual_seed(seed)
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            num_return_sequences=n,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_id,
        )
        if sample:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        generated = generate_left_padded(
            self.model, prompts, batch_size=self.batch_size, pad_id=pad_id, device=self.device,
            progress=self.progress, desc=desc, **kwargs,
        )  # fmt: skip
        eos = set(eos_ids)
        return [
            [self._completion(seq, eos, max_new_tokens) for seq in generated[i * n : (i + 1) * n]] for i in range(len(prompts))
        ]

    def _completion(self, tokens: list[int], eos: set[int], max_new_tokens: int) -> Completion:
        end = next((j for j, t in enumerate(tokens) if t in eos), None)
        if end is None:
            return Completion(self.decode(tokens), num_tokens=len(tokens), truncated=len(tokens) >= max_new_tokens)
        return Completion(self.decode(tokens[:end]), num_tokens=end + 1, truncated=False)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.model = None

