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


class HostClock:
    """The host's side of timed runs: Python's garbage collections (count, total and longest pause per
    generation, from ``gc.callbacks``) and the process's CPU time against the wall clock. A decode step whose GPU
    waits for the host (the profile's ``idle_ms``) shows up here as collections or as CPU time per step."""

    def __init__(self) -> None:
        import gc

        self._gc = gc
        self._start: float | None = None
        self.pauses: dict[int, list[float]] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pauses.setdefault(int(info.get("generation", -1)), []).append(time.perf_counter() - self._start)
            self._start = None

    def reset(self) -> None:
        self.pauses = {}

    def summary(self, wall_s: float, cpu_s: float, steps: int) -> dict[str, Any]:
        """The collections since :meth:`reset` and the CPU time of ``wall_s`` seconds of ``steps`` decode steps."""
        gcs = {f"gen{g}": {"count": len(p), "total_ms": round(1e3 * sum(p), 3), "max_ms": round(1e3 * max(p), 3)}
               for g, p in sorted(self.pauses.items())}
        total = sum(sum(p) for p in self.pauses.values())
        return {"gc": gcs, "gc_ms_per_step": round(1e3 * total / max(steps, 1), 4), "wall_s": round(wall_s, 4),
                "cpu_s": round(cpu_s, 4), "cpu_ms_per_step": round(1e3 * cpu_s / max(steps, 1), 4)}

    def close(self) -> None:
        if self._callback in self._gc.callbacks:
            self._gc.callbacks.remove(self._callback)


class StackSampler:
    """A statistical profile of the host's Python: a thread that reads every other thread's stack every
    ``interval_s`` (``sys._current_frames``) while it runs. Per thread, the innermost frames (``leaf``) and every
    frame on a stack (``inclusive``) by share of samples; ``file:function``, the file by its last two parts. The
    sampler needs the GIL to read, so a thread that holds it long (a C call, a collection) delays the sample,
    which then counts that thread's frame once: shares, not durations."""

    def __init__(self, interval_s: float = 0.0005, top: int = 12) -> None:
        import threading

        self.interval_s, self.top = interval_s, top
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qerl-stack-sampler", daemon=True)
        self._leaf: dict[str, dict[str, int]] = {}
        self._inclusive: dict[str, dict[str, int]] = {}
        self._samples: dict[str, int] = {}

    @staticmethod
    def _where(frame: Any) -> str:
        parts = frame.f_code.co_filename.replace("\\", "/").split("/")
        return f"{'/'.join(parts[-2:])}:{frame.f_code.co_name}"

    def _run(self) -> None:
        import sys
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                self._samples[name] = self._samples.get(name, 0) + 1
                leaf = self._leaf.setdefault(name, {})
                where = self._where(frame)
                leaf[where] = leaf.get(where, 0) + 1
                seen, inc = set(), self._inclusive.setdefault(name, {})
                while frame is not None:
                    where = self._where(frame)
                    if where not in seen:
                        seen.add(where)
                        inc[where] = inc.get(where, 0) + 1
                    frame = frame.f_back

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        def shares(counts: dict[str, int], n: int) -> list[list[Any]]:
            ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:self.top]
            return [[where, round(c / n, 4)] for where, c in ranked]

        return {"interval_s": self.interval_s, "threads": {
            name: {"samples": n, "leaf": shares(self._leaf[name], n), "inclusive": shares(self._inclusive[name], n)}
            for name, n in sorted(self._samples.items(), key=lambda kv: -kv[1])}}


def greedy_fingerprint(llm, spec: dict, lora, sampling_params_cls) -> dict[str, Any]:
    """Greedy tokens and their chosen-token logprobs for a few fixed prompts: two engines (e.g. the same config
    with another LoRA kernel) that compute the same function agree on them (compared in the report).

    Four passes over the same prompts: decoded together (one batch, as before §4an: four rows per decode step, so a
    ``decode_gemv`` engine's one-row kernel never runs), that again (``repeat``), each prompt alone
    (``alone``: every decode step is a one-row call) and that again (``alone.repeat``). The repeats measure the
    engine's own run-to-run variation: with LoRA, vLLM's punica shrink (more than 64 tokens) and qerl's LoRA kernel
    sum float32 partials with atomics, in an order that varies from launch to launch (§4an), so an engine need not
    repeat its own bits, and a divergence between engines is evidence of a different function only where each
    engine repeats itself."""
    import random

    n, length = spec["greedy_prompts"], spec.get("greedy_tokens", 32)
    rng = random.Random(1234)
    vocab = spec["dims"]["vocab"]
    batch = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(64)]} for _ in range(n)]
    params = sampling_params_cls(max_tokens=length, temperature=0.0, logprobs=0)

    def decode(groups: list[list[dict]]) -> dict[str, list]:
        tokens, logprobs = [], []
        for group in groups:
            for o in llm.generate(group, params, lora_request=lora, use_tqdm=False):
                c = o.outputs[0]
                tokens.append(list(c.token_ids))
                logprobs.append([round(float(step[t].logprob), 5) for t, step in zip(c.token_ids, c.logprobs or [])])
        return {"tokens": tokens, "chosen_logprobs": logprobs}

    together, alone = [batch], [[p] for p in batch]
    out = decode(together)
    out["repeat"] = decode(together)
    out["alone"] = decode(alone)
    out["alone"]["repeat"] = decode(alone)
    return out


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

        host = HostClock()
        host_runs: list[dict[str, Any]] = []

        def timed(n: int, max_tokens: int) -> float:
            # RL-style sampling (temperature 1); no per-request seed: seeded requests take a slower sampler path
            params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0)
            batch = prompts(n)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            host.reset()
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(batch, params, lora_request=lora, use_tqdm=False)
            elapsed = time.perf_counter() - start
            host_runs.append(host.summary(elapsed, time.process_time() - cpu, max_tokens))
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != [max_tokens] * n:
                raise RuntimeError(f"expected {max_tokens} tokens per request, got {sorted(set(got))}")
            return elapsed

        new = spec["new_tokens"]
        for b in spec["batches"]:
            timed(b, 16)  # warm-up: this batch size's graphs, allocator, LoRA slot
            prefill = [timed(b, 1) for _ in range(spec["repeats"])]
            host_runs.clear()
            total = [timed(b, new) for _ in range(spec["repeats"])]
            result["batches"][str(b)] = decode_stats(b, new, prefill, total)
            result["batches"][str(b)]["host"] = list(host_runs)  # per timed run: GC pauses, CPU time per step
            save()
        if spec.get("profile_tokens"):
            from vllm_ext.bench.profile import profile_call

            profiles = result.setdefault("profile", {})
            stem = Path(result_path).name.removesuffix(".result.json")
            for b in spec["batches"]:
                trace = Path(result_path).with_name(f"{stem}.b{b}.trace.json.gz")
                host_runs.clear()
                profiles[str(b)] = profile_call(lambda: timed(b, spec["profile_tokens"]), trace)  # noqa: B023
                profiles[str(b)]["host"] = host_runs[-1] if host_runs else None
                save()
                with StackSampler() as sampler:  # the same tokens again, outside torch.profiler
                    timed(b, spec["profile_tokens"])
                profiles[str(b)]["host_sampled"] = {**sampler.summary(), "clock": host_runs[-1]}
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
