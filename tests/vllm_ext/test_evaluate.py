"""``vllm_ext.evaluate`` (``qerl eval --backend vllm``) on CPU: the engine arguments, the LoRA request, the
sampling parameters and the refusals, checked against the installed vLLM without starting an engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import get_args

import pytest

pytest.importorskip("vllm")

from qerl_plugin.evaluate_inputs import AdapterInfo, EvalError, inspect_adapter, inspect_model  # noqa: E402
from vllm_ext import evaluate as ve  # noqa: E402
from vllm_ext.bench.shapes import write_adapter  # noqa: E402


@pytest.fixture
def bf16(tiny_qwen2_dir) -> Path:
    return tiny_qwen2_dir


@pytest.fixture
def nvfp4(tiny_qwen2_nvfp4_dir) -> Path:
    return tiny_qwen2_nvfp4_dir


def _adapter(base: Path, tmp: Path, rank: int) -> AdapterInfo:
    return inspect_adapter(write_adapter(base, rank, tmp / f"adapter_r{rank}"))


def test_allowed_ranks_are_vllms():
    from vllm.config.lora import LoRAConfig, MaxLoRARanks

    assert ve.allowed_lora_ranks() == tuple(sorted(get_args(MaxLoRARanks)))
    assert {8, 16, 32, 64, 512} <= set(ve.allowed_lora_ranks())
    assert LoRAConfig.__dataclass_fields__["max_lora_rank"].type in ("MaxLoRARanks", MaxLoRARanks)


def test_max_lora_rank_is_the_smallest_allowed_above_the_adapter_rank(bf16, tmp_path):
    info = _adapter(bf16, tmp_path, 8)
    assert ve.max_lora_rank_for(info) == 8
    assert ve.max_lora_rank_for(AdapterInfo(info.path, info.config, info.shapes, rank=12)) == 16
    assert ve.max_lora_rank_for(AdapterInfo(info.path, info.config, info.shapes, rank=300)) == 320
    with pytest.raises(EvalError) as e:
        ve.max_lora_rank_for(AdapterInfo(info.path, info.config, info.shapes, rank=1024))
    msg = str(e.value)
    assert str(info.path) in msg and "LoRA rank 1024 is above vLLM's largest max_lora_rank 512" in msg


def test_engine_kwargs_are_valid_vllm_engine_args(bf16, nvfp4, tmp_path):
    from vllm import EngineArgs

    adapter = _adapter(bf16, tmp_path, 16)
    online = ve.engine_kwargs(inspect_model(bf16), adapter=adapter, quantization="nvfp4", seed=3, max_model_len=128)
    assert online == {
        "model": str(bf16.resolve()), "dtype": "auto", "seed": 3, "quantization": "nvfp4", "max_model_len": 128,
        "enable_lora": True, "max_loras": 1, "max_lora_rank": 16,
    }  # fmt: skip
    from vllm_ext.quant import METHOD_NAME

    assert online["quantization"] == METHOD_NAME
    stored = ve.engine_kwargs(inspect_model(nvfp4), gpu_memory_utilization=0.5, max_num_seqs=1)
    assert "quantization" not in stored and "enable_lora" not in stored  # vLLM detects the NVFP4A16 checkpoint
    assert stored["gpu_memory_utilization"] == 0.5 and stored["max_num_seqs"] == 1
    for kwargs in (online, stored):
        args = EngineArgs(**kwargs)  # unknown names or bad types fail here, without an engine
        assert args.model == kwargs["model"]
    assert EngineArgs(**stored).max_num_seqs == 1
    padded = ve.engine_kwargs(inspect_model(bf16), adapter=adapter, max_lora_rank=32)  # the r16 adapter served at 32
    assert padded["max_lora_rank"] == 32 and EngineArgs(**padded).max_lora_rank == 32
    for bad in (8, 48):  # below the adapter's rank; not a rank vLLM allows
        with pytest.raises(EvalError, match=f"--max-lora-rank {bad}: expected one of vLLM's"):
            ve.engine_kwargs(inspect_model(bf16), adapter=adapter, max_lora_rank=bad)
    with pytest.raises(EvalError, match="--max-lora-rank 16 without --adapter"):
        ve.engine_kwargs(inspect_model(bf16), max_lora_rank=16)
    with pytest.raises(EvalError, match="--quantization 'fp8'"):
        ve.engine_kwargs(inspect_model(bf16), quantization="fp8")


def test_an_nvfp4a16_checkpoint_runs_qerls_method_only_when_asked(bf16, nvfp4):
    """vLLM's own ModelConfig, from the engine arguments qerl eval builds: the NVFP4A16 checkpoint stays on vLLM's
    compressed-tensors path unless --quantization nvfp4 is given (the method verl's rollout runs); the log says
    which, and names another checkpoint's own method."""
    from vllm import EngineArgs

    model = inspect_model(nvfp4)
    stock = ve.engine_kwargs(model, max_model_len=128)
    ours = ve.engine_kwargs(model, quantization="nvfp4", max_model_len=128)
    assert ours["quantization"] == "nvfp4" and "quantization" not in stock
    assert EngineArgs(**stock).create_model_config().quantization == "compressed-tensors"
    assert EngineArgs(**ours).create_model_config().quantization == "nvfp4"
    assert ve.kernels_line(model, stock).startswith("vLLM's stock compressed-tensors path")
    assert "--quantization nvfp4 runs qerl's nvfp4 method" in ve.kernels_line(model, stock)
    ours_line = "qerl's nvfp4 method on the NVFP4A16 checkpoint (the kernels verl's rollout runs)"
    assert ve.kernels_line(model, ours) == ours_line
    online = inspect_model(bf16)
    assert ve.kernels_line(online, ve.engine_kwargs(online, quantization="nvfp4")).endswith("quantized at load")
    assert ve.kernels_line(online, ve.engine_kwargs(online)) == "no quantization"
    awq = dataclasses.replace(online, quantization="awq")
    assert ve.kernels_line(awq, {"model": "m"}) == "vLLM's own awq method"


def test_vllm_refuses_what_it_cannot_serve_before_the_engine(bf16, tmp_path):
    """vLLM's own PEFTHelper checks run before start-up (here: a bias-trained adapter)."""
    adapter_dir = write_adapter(bf16, 8, tmp_path / "biased")
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    cfg["bias"] = "all"
    (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EvalError, match=r"biased: vLLM cannot serve it: Adapter bias is not supported"):
        ve.engine_kwargs(inspect_model(bf16), adapter=inspect_adapter(adapter_dir))


def test_lora_request_and_sampling_params(bf16, tmp_path):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    adapter = _adapter(bf16, tmp_path, 8)
    req = ve.lora_request(adapter)
    assert isinstance(req, LoRARequest)
    assert (req.lora_name, req.lora_int_id, req.lora_path) == (ve.ADAPTER_NAME, 1, str(adapter.path))
    assert ve.lora_request(None) is None

    greedy = ve.sampling_params(1, 0.0, 64, [2, 7])
    assert isinstance(greedy, SamplingParams)
    assert (greedy.n, greedy.temperature, greedy.max_tokens, greedy.top_p) == (1, 0.0, 64, 1.0)
    assert set(greedy.stop_token_ids) == {2, 7} and greedy.skip_special_tokens
    sampled = ve.sampling_params(8, 0.7, 32, [2])
    assert (sampled.n, sampled.temperature, sampled.max_tokens) == (8, 0.7, 32)


def test_completion_from_vllm_output():
    from vllm.outputs import CompletionOutput

    done = CompletionOutput(index=0, text="#### 4", token_ids=[1, 2, 3], cumulative_logprob=None, logprobs=None, finish_reason="stop")
    cut = CompletionOutput(index=1, text="so", token_ids=[1] * 8, cumulative_logprob=None, logprobs=None, finish_reason="length")
    assert ve.to_completion(done) == ve.Completion("#### 4", num_tokens=3, truncated=False)
    assert ve.to_completion(cut).truncated and ve.to_completion(cut).num_tokens == 8


def test_generate_passes_token_ids_params_and_the_adapter(bf16, tmp_path):
    """``VLLMBackend.generate`` around a stand-in for ``vllm.LLM`` (the engine itself needs a GPU)."""
    from types import SimpleNamespace

    from vllm.outputs import CompletionOutput

    calls = []

    class FakeLLM:
        def generate(self, prompts, params, *, lora_request=None, use_tqdm=True):
            calls.append(dict(prompts=prompts, params=params, lora=lora_request, use_tqdm=use_tqdm))
            return [
                SimpleNamespace(outputs=[
                    CompletionOutput(index=j, text=f"p{i}s{j}", token_ids=[5] * (j + 1), cumulative_logprob=None,
                                     logprobs=None, finish_reason="length" if j else "stop")
                    for j in range(params.n)
                ])
                for i in range(len(prompts))
            ]  # fmt: skip

    backend = object.__new__(ve.VLLMBackend)
    backend.llm, backend.progress, backend.lora = FakeLLM(), False, ve.lora_request(_adapter(bf16, tmp_path, 8))
    out = backend.generate([[1, 2], [3]], n=2, temperature=0.5, max_new_tokens=9, eos_ids=[0])
    (call,) = calls
    assert call["prompts"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert (call["params"].n, call["params"].temperature, call["params"].max_tokens) == (2, 0.5, 9)
    assert call["lora"] is backend.lora and call["use_tqdm"] is False
    assert out == [
        [ve.Completion("p0s0", 1, False), ve.Completion("p0s1", 2, True)],
        [ve.Completion("p1s0", 1, False), ve.Completion("p1s1", 2, True)],
    ]


def test_backend_needs_cuda(bf16, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EvalError, match="--backend vllm needs a CUDA GPU .* use --backend hf"):
        ve.VLLMBackend(inspect_model(bf16))
    # the adapter is checked first, so a bad one is reported even where the engine could start
    big = _adapter(bf16, tmp_path, 8)
    big = AdapterInfo(big.path, big.config, big.shapes, rank=2048)
    with pytest.raises(EvalError, match="above vLLM's largest max_lora_rank"):
        ve.VLLMBackend(inspect_model(bf16), adapter=big)


def test_cli_loads_the_vllm_backend_by_name(bf16, tmp_path, monkeypatch, capsys):
    """``qerl eval --backend vllm`` goes through vllm_ext.evaluate (here: its CUDA refusal, one line)."""
    import torch

    from qerl_plugin.cli import main
    from qerl_plugin.evaluate import BACKENDS

    assert BACKENDS["vllm"] == ("vllm_ext.evaluate", "VLLMBackend")
    tok = json.loads((bf16 / "tokenizer_config.json").read_text())
    model = tmp_path / "chat"
    import shutil

    shutil.copytree(bf16, model)
    tok["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(tok))
    data = tmp_path / "d.jsonl"
    row = {"data_source": "qerl/x", "prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
    data.write_text(json.dumps(row) + "\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert main(["eval", str(model), "--data", str(data), "--backend", "vllm", "--out", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "qerl eval: error: --backend vllm needs a CUDA GPU" in err
    assert not (tmp_path / "o.jsonl").exists()
