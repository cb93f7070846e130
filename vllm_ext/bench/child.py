"""One ``qerl bench rollout`` engine, run in its own process by :mod:`vllm_ext.bench.runner`
(``python -m vllm_ext.bench _child SPEC RESULT``): start vLLM, time decode per batch size, probe memory, and
write the result JSON after every step so that a crash or a timeout still leaves what was measured."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from vllm_ext.bench.lora_configs import write_lora_kernel_configs

__all__ = ["main"]


def _worker_memory(worker: Any) -> dict[str, Any]:
    """Runs on each vLLM worker (collective_rpc): weight, LoRA-buffer and KV-cache bytes."""
    import torch

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model

    def storage_bytes(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    def flat(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from flat(y)
        elif isinstance(x, dict):
            for y in x.values():
                yield from flat(y)

    lora = []
    for m in model.modules():
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            lora.extend(flat(getattr(m, attr, None)))
    free, total = torch.cuda.mem_get_info()
    return {
        "weights_bytes": storage_bytes(list(model.parameters()) + list(model.buffers())),
        "lora_buffers_bytes": storage_bytes(lora),
        "kv_cache_bytes": storage_bytes(flat(getattr(runner, "kv_caches", []))),
        "model_memory_usage": getattr(runner, "model_memory_usage", None),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "free": free,
        "total": total,
        "device": torch.cuda.get_device_name(),
    }


def decode_stats(batch: int, new_tokens: int, prefill_s: list[float], total_s: list[float]) -> dict[str, Any]:
    """Decode tokens/s of each timed run (the fastest 1-token run removed as prefill), their median and spread.

    ``decode_tok_s`` is the median; ``decode_runs_tok_s`` every run's rate; ``decode_spread`` (max - min) / median.
    """
    t1 = min(prefill_s)
    runs = [batch * (new_tokens - 1) / (t - t1) for t in total_s if t > t1]
    median = statistics.median(runs) if runs else None
    return {
        "decode_tok_s": round(median, 2) if runs else None,
        "decode_runs_tok_s": [round(r, 2) for r in runs],
        "decode_spread": round((max(runs) - min(runs)) / median, 4) if runs else None,
        "e2e_tok_s": round(batch * new_tokens / statistics.median(total_s), 2),
        "prefill_s": round(t1, 4),
        "total_s": [round(t, 4) for t in total_s],
        "prefill_runs_s": [round(t, 4) for t in prefill_s],
    }


def greedy_fingerprint(llm, spec: dict, lora, sampling_params_cls) -> dict[str, Any]:
    """Greedy tokens and their chosen-token logprobs for a few fixed prompts: two engines (e.g. the same config
    with another LoRA kernel) that compute the same function agree on them (compared in the report)."""
    import random

    n, length = spec["greedy_prompts"], spec.get("greedy_tokens", 32)
    rng = random.Random(1234)
    vocab = spec["dims"]["vocab"]
    batch = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(64)]} for _ in range(n)]
    params = sampling_params_cls(max_tokens=length, temperature=0.0, logprobs=0)
    outs = llm.generate(batch, params, lora_request=lora, use_tqdm=False)
    tokens, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append([round(float(step[t].logprob), 5) for t, step in zip(c.token_ids, c.logprobs or [])])
    return {"tokens": tokens, "chosen_logprobs": logprobs}


def main(spec_path: str, result_path: str) -> int:
    """Run the engine described by the JSON at ``spec_path``; 0 when every batch size was measured."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"config": spec["config"], "variant": spec["variant"], "ok": False,
                              "engine_args": spec["engine"], "batches": {}}

    def save() -> None:
        Path(result_path).write_text(json.dumps(result, indent=1, default=str))

    try:
        import random

        import torch

        if spec.get("tuned_dir"):
            result["tuned_configs"] = write_lora_kernel_configs(
                Path(spec["tuned_dir"]), torch.cuda.get_device_name(), spec["dims"], spec["lora_rank"],
                spec["batches"], spec["engine"].get("max_loras", 1))
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        llm = LLM(**spec["engine"])
        result["startup_s"] = round(time.perf_counter() - t0, 1)
        save()
        if spec.get("aqn_sigma") is not None:
            try:
                result["aqn"] = llm.collective_rpc("qerl_set_noise", args=(float(spec["aqn_sigma"]), 0, 0))
            except Exception as exc:
                raise RuntimeError(
                    f"AQN hook unavailable: collective_rpc('qerl_set_noise') failed ({type(exc).__name__}: {exc}); "
                    "it needs vllm_ext.worker_extension.QerlWorkerExtension and vllm_ext.noisy_norm"
                ) from exc
        lora = LoRARequest("bench-adapter", 1, spec["lora_path"]) if spec.get("lora_path") else None
        vocab = spec["dims"]["vocab"]
        rng = random.Random(0)

        def prompts(n: int) -> list[dict[str, list[int]]]:
            return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(spec["prompt_len"])]}
                    for _ in range(n)]

        def timed(n: int, max_tokens: int) -> float:
            # RL-style sampling (temperature 1); no per-request seed: seeded requests take a slower sampler path
            params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0)
            batch = prompts(n)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(batch, params, lora_request=lora, use_tqdm=False)
            elapsed = time.perf_counter() - start
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != [max_tokens] * n:
                raise RuntimeError(f"expected {max_tokens} tokens per request, got {sorted(set(got))}")
            return elapsed

        new = spec["new_tokens"]
        for b in spec["batches"]:
            timed(b, 16)  # warm-up: this batch size's graphs, allocator, LoRA slot
            prefill = [timed(b, 1) for _ in range(spec["repeats"])]
            total = [timed(b, new) for _ in range(spec["repeats"])]
            result["batches"][str(b)] = decode_stats(b, new, prefill, total)
            save()
        if spec.get("profile_tokens"):
            from vllm_ext.bench.profile import profile_call

            profiles = result.setdefault("profile", {})
            stem = Path(result_path).name.removesuffix(".result.json")
            for b in spec["batches"]:
                trace = Path(result_path).with_name(f"{stem}.b{b}.trace.json.gz")
                profiles[str(b)] = profile_call(lambda: timed(b, spec["profile_tokens"]), trace)  # noqa: B023
                profiles[str(b)]["trace"] = trace.name
                save()
        if spec.get("greedy_prompts"):
            result["greedy"] = greedy_fingerprint(llm, spec, lora, SamplingParams)
            save()
        try:
            result["memory"] = llm.collective_rpc(_worker_memory)[0]
        except Exception as exc:  # memory is a nice-to-have; keep the timings
            result["memory_error"] = f"{type(exc).__name__}: {exc}"
        try:
            cache = llm.llm_engine.vllm_config.cache_config
            result["kv_blocks"] = cache.num_gpu_blocks
            if cache.num_gpu_blocks:
                fits = cache.num_gpu_blocks * cache.block_size // (spec["prompt_len"] + new)
                result["kv_max_concurrency"] = fits
                result["kv_fits_batches"] = fits >= max(spec["batches"])
        except Exception:
            pass
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        save()
        traceback.print_exc()
        return 1
    save()
    return 0
