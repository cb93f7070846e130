"""``qerl eval MODEL --data FILE``: greedy pass@1 and sampled pass@k of a model (and LoRA adapter) with the project's reward.

    qerl eval /tmp/qerl_smollm2/nvfp4 --adapter docs/learning/smollm2-nvfp4-lora-aqn --data /tmp/qerl_smollm2/data/test.parquet --n 8
    qerl eval out/smollm2-bf16 --quantization nvfp4 --data test.jsonl --backend hf --limit 50

FILE is a verl RL parquet (data_source, prompt chat messages, reward_model.ground_truth) or the same rows
as JSON lines; prompts go through MODEL's chat template as verl's dataset does. Each response is scored
by ``--reward MODULE:FN`` (default ``verl_ext.reward:compute_score``, its ``acc`` deciding correctness).
Greedy decoding gives pass@1; ``--n K`` (> 1) also samples K responses per prompt at ``--temperature``
and reports the unbiased pass@k (Chen et al. 2021) for k = 1, 2, 4, ... and K.

Backends: ``vllm`` (a CUDA GPU; the adapter unmerged as a LoRA request) and ``hf`` (transformers, for
small models on CPU; NVFP4 weights replaced by their dequantization); ``auto`` picks vLLM when it imports
and CUDA is available. Writes one JSON line per example to ``--out`` and the summary beside it
(``results.summary.json``), then prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from qerl_plugin.evaluate_inputs import (
    DEFAULT_REWARD,
    AdapterInfo,
    EvalError,
    Example,
    ModelInfo,
    check_adapter_fits,
    inspect_adapter,
    inspect_model,
    load_reward,
    read_examples,
)
from qerl_plugin.evaluate_metrics import Completion, Scored, pass_at_k, report_ks, summarize

__all__ = [
    "BACKENDS", "EvalConfig", "add_arguments", "choose_backend", "encode_chat", "encode_prompts", "run", "run_eval",
    "summary_path",
]  # fmt: skip

HELP = "greedy pass@1 and sampled pass@k of a model (+ LoRA adapter) on verl RL data (vLLM or transformers)"
# backend -> (module, class); imported only when chosen, so this module never imports vLLM
BACKENDS = {"hf": ("qerl_plugin.evaluate_hf", "HFBackend"), "vllm": ("vllm_ext.evaluate", "VLLMBackend")}


@dataclass
class EvalConfig:
    """Everything one evaluation needs (the CLI's options)."""

    model: str
    data: str
    adapter: str | None = None
    backend: str = "auto"
    quantization: str | None = None
    n: int = 1
    temperature: float | None = None  # sampling temperature; None: 1.0 when n > 1, else no sampling
    max_new_tokens: int = 512
    limit: int | None = None
    out: str = "results.jsonl"
    reward: str = DEFAULT_REWARD
    seed: int = 0
    dtype: str = "auto"
    batch_size: int = 8
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # vllm backend: sequences decoded at once (1: one-row decode steps)
    max_lora_rank: int | None = None  # vllm backend: max_lora_rank (default: the adapter's rank, rounded up)
    overwrite: bool = False
    progress: bool = True

    def sample_temperature(self) -> float | None:
        """The temperature of the sampled run, or None when there is none (greedy only)."""
        if self.n < 1:
            raise EvalError(f"--n {self.n}: the number of samples per prompt must be at least 1")
        if self.n == 1:
            return self.temperature if self.temperature else None
        if self.temperature is None:
            return 1.0
        if self.temperature <= 0:
            raise EvalError(
                f"--n {self.n} with --temperature {self.temperature}: sampling at temperature 0 repeats the greedy "
                "answer; give --temperature > 0 (e.g. 1.0) for pass@k"
            )
        return self.temperature


def summary_path(out: str | Path) -> Path:
    """``results.jsonl`` -> ``results.summary.json``."""
    out = Path(out)
    return out.with_name(out.stem + ".summary.json")


# ----------------------------------------------------------------------------------------------------
# Prompts and backends


def load_tokenizer(info: ModelInfo):
    """MODEL's tokenizer; it must have a chat template (prompts are chat messages)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(info.path)
    except Exception as exc:
        raise EvalError(
            f"MODEL {info.path}: cannot load its tokenizer ({type(exc).__name__}: {exc}); copy the tokenizer "
            "files (tokenizer.json, tokenizer_config.json) of the original model into it"
        ) from None
    if not getattr(tok, "chat_template", None):
        raise EvalError(
            f"MODEL {info.path}: its tokenizer has no chat template; add the model's template "
            "(chat_template in tokenizer_config.json, or chat_template.jinja) so prompts are formatted as in training"
        )
    return tok


def encode_chat(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of one chat prompt, formatted as verl's RLHFDataset does (template text, no extra special tokens)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(tokenizer, examples: Sequence[Example]) -> list[list[int]]:
    """Token ids of each example's prompt (:func:`encode_chat`)."""
    return [encode_chat(tokenizer, ex.messages) for ex in examples]


def stop_ids(tokenizer, info: ModelInfo) -> tuple[list[int], int]:
    """End-of-sequence ids (tokenizer's and generation_config.json's) and the padding id."""
    ids: list[int] = []
    cands: list[Any] = [tokenizer.eos_token_id]
    gen_file = info.path / "generation_config.json"
    if gen_file.is_file():
        try:
            cands.append(json.loads(gen_file.read_text()).get("eos_token_id"))
        except ValueError:
            pass
    for c in cands:
        for i in c if isinstance(c, list) else [c]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    if not ids:
        raise EvalError(f"MODEL {info.path}: its tokenizer has no eos_token; set eos_token in tokenizer_config.json")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[0]
    return ids, pad


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _vllm_imports() -> bool:
    try:
        importlib.import_module("vllm")
        return True
    except Exception:
        return False


def choose_backend(name: str) -> str:
    """``auto``: vLLM when CUDA is available and vLLM imports, else hf."""
    if name in BACKENDS:
        return name
    if name != "auto":
        raise EvalError(f"--backend {name!r}: choose auto, vllm or hf")
    return "vllm" if _cuda_available() and _vllm_imports() else "hf"


def make_backend(name: str, info: ModelInfo, tokenizer, adapter: AdapterInfo | None, cfg: EvalConfig):
    module_name, cls_name = BACKENDS[name]
    cls = getattr(importlib.import_module(module_name), cls_name)
    common = dict(adapter=adapter, quantization=cfg.quantization, dtype=cfg.dtype, progress=cfg.progress)
    if name == "hf":
        return cls(info, tokenizer, batch_size=cfg.batch_size, **common)
    return cls(
        info,
        tokenizer,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_lora_rank=cfg.max_lora_rank,
        **common,
    )


# ----------------------------------------------------------------------------------------------------
# Scoring and output


def _score(reward: Callable[..., Any], spec: str, ex: Example, completion: Completion) -> Scored:
    try:
        result = reward(ex.data_source, completion.text, ex.ground_truth, ex.extra_info)
    except Exception as exc:
        raise EvalError(
            f"--reward {spec} failed on data row {ex.row} (data_source {ex.data_source!r}): {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(result, dict):
        score = float(result.get("score", 0.0))
        correct = float(result.get("acc", score)) > 0
        pred = result.get("pred")
    else:
        score = float(result)
        correct, pred = score > 0, None
    return Scored(completion, score=score, correct=correct, pred="" if pred is None else str(pred))


def _record(ex: Example, greedy: Scored | None, samples: list[Scored] | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "row": ex.row,
        "data_source": ex.data_source,
        "prompt": ex.messages,
        "ground_truth": ex.ground_truth,
        "greedy": greedy.record() if greedy else None,
    }
    if samples is not None:
        n, c = len(samples), sum(s.correct for s in samples)
        rec["samples"] = [s.record() for s in samples]
        rec["num_correct"] = c
        rec["pass@k"] = {str(k): pass_at_k(n, c, k) for k in report_ks(n)}
    return rec


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def format_table(summary: dict[str, Any]) -> str:
    """The metrics as a text table: one column for all examples, one per data source when there are several."""
    blocks = {"all": summary, **summary.get("by_data_source", {})}
    rows: list[tuple[str, list[str]]] = [("examples", [str(b["num_examples"]) for b in blocks.values()])]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    if "greedy" in summary:
        rows.append(("greedy pass@1", [fmt(b["greedy"]["pass@1"]) for b in blocks.values()]))
        rows.append(("greedy truncated", [fmt(b["greedy"]["truncated"]) for b in blocks.values()]))
    if "sampled" in summary:
        s = summary["sampled"]
        temp = summary.get("config", {}).get("sample_temperature")
        for k in s["pass@k"]:
            label = f"pass@{k} (n={s['n']}" + (f", T={temp:g})" if temp is not None else ")")
            rows.append((label, [fmt(b["sampled"]["pass@k"][k]) for b in blocks.values()]))
        rows.append(("sampled truncated", [fmt(b["sampled"]["truncated"]) for b in blocks.values()]))
    width = max(len(r[0]) for r in rows)
    cols = [max(len(name), 6) for name in blocks]
    cols = [max(c, *(len(r[1][i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [" " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(blocks, cols))]
    lines += [label.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)) for label, vals in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The run


def run_eval(cfg: EvalConfig, *, log: Callable[[str], None] | None = None, backend=None) -> dict[str, Any]:
    """Evaluate, write ``cfg.out`` and its summary, and return the summary.

    All inputs are checked before a model is loaded. ``backend`` replaces the chosen backend (tests).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    temperature = cfg.sample_temperature()
    for name, value in (("--max-new-tokens", cfg.max_new_tokens), ("--limit", cfg.limit), ("--batch-size", cfg.batch_size)):
        if value is not None and value < 1:
            raise EvalError(f"{name} {value}: must be at least 1")
    if cfg.quantization not in (None, "nvfp4"):
        raise EvalError(f"--quantization {cfg.quantization!r}: qerl eval knows 'nvfp4' (or none)")
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise EvalError(f"--out {out} exists; pass --overwrite to replace it, or choose another --out")
    examples = read_examples(cfg.data, cfg.limit)
    reward = load_reward(cfg.reward)
    info = inspect_model(cfg.model)
    if cfg.quantization == "nvfp4" and info.quantization not in (None, "nvfp4a16"):
        raise EvalError(f"--quantization nvfp4: MODEL {info.path} is already quantized ({info.quantization}); give the BF16 checkpoint")
    adapter = inspect_adapter(cfg.adapter) if cfg.adapter else None
    if adapter is not None:
        check_adapter_fits(adapter, info)
    tokenizer = load_tokenizer(info)
    prompts = encode_prompts(tokenizer, examples)
    eos_ids, pad_id = stop_ids(tokenizer, info)

    name = backend.name if backend is not None else choose_backend(cfg.backend)
    quant = info.quantization or ("nvfp4 (quantized at load)" if cfg.quantization else "none")
    log(f"qerl eval: {len(examples)} examples, MODEL {info.path} ({quant})" + (f" + adapter {adapter.path}" if adapter else ""))
    start = time.perf_counter()
    if backend is None:
        backend = make_backend(name, info, tokenizer, adapter, cfg)
    log(f"qerl eval: backend {name}: {backend.describe()}")
    gen = dict(max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, seed=cfg.seed)
    try:
        greedy_out = backend.generate(prompts, n=1, temperature=0.0, desc="greedy", **gen)
        sampled_out = None
        if temperature is not None:
            sampled_out = backend.generate(prompts, n=cfg.n, temperature=temperature, desc=f"sample n={cfg.n}", **gen)
    finally:
        backend.close()

    from tqdm.auto import tqdm

    greedy: list[Scored] = []
    samples: list[list[Scored]] | None = [] if sampled_out is not None else None
    records = []
    for i, ex in enumerate(tqdm(examples, desc="score", unit="example", file=sys.stderr, disable=not cfg.progress)):
        g = _score(reward, cfg.reward, ex, greedy_out[i][0])
        greedy.append(g)
        row_samples = None
        if samples is not None:
            if len(sampled_out[i]) != cfg.n:
                raise RuntimeError(f"backend {name} returned {len(sampled_out[i])} samples for row {ex.row}, expected {cfg.n}")
            row_samples = [_score(reward, cfg.reward, ex, c) for c in sampled_out[i]]
            samples.append(row_samples)
        records.append(_record(ex, g, row_samples))

    summary = summarize([ex.data_source for ex in examples], greedy, samples)
    summary["config"] = {
        **{k: v for k, v in asdict(cfg).items() if k not in ("progress", "overwrite")},
        "model": str(info.path),
        "adapter": str(adapter.path) if adapter else None,
        "backend": name,
        "model_quantization": info.quantization,
        "sample_temperature": temperature,
        "eos_ids": eos_ids,
    }
    summary["elapsed_s"] = round(time.perf_counter() - start, 2)
    _write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    _write(summary_path(out), json.dumps(summary, indent=2) + "\n")
    return summary


# ----------------------------------------------------------------------------------------------------
# CLI


def _at_least(lo: float, kind: type = int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory: BF16, or NVFP4A16 from `qerl quantize`")
    parser.add_argument("--data", required=True, metavar="FILE", help="verl RL rows: .parquet or .jsonl")
    parser.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter directory, applied unmerged")
    parser.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto", help="auto (default): vllm with CUDA, else hf")
    parser.add_argument(
        "--quantization",
        choices=("nvfp4",),
        help="quantize a BF16 MODEL to NVFP4 at load, as `qerl quantize` would; with an NVFP4A16 MODEL and --backend "
        "vllm: run it on qerl's nvfp4 method, as verl's rollout does (without it vLLM runs its stock path)",
    )
    parser.add_argument("--n", type=_at_least(1), default=1, metavar="K", help="samples per prompt for pass@k (default 1: greedy only)")
    parser.add_argument(
        "--temperature",
        type=_at_least(0.0, float),
        default=None,
        metavar="T",
        help="sampling temperature (default 1.0 with --n > 1); with --n 1 and T > 0, also a sampled pass@1",
    )
    parser.add_argument("--max-new-tokens", type=_at_least(1), default=512, metavar="N", help="response length limit (default 512)")
    parser.add_argument("--limit", type=_at_least(1), default=None, metavar="N", help="evaluate the first N rows only")
    parser.add_argument("--out", default="results.jsonl", metavar="FILE", help="per-example JSON lines (default results.jsonl); summary beside it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--reward", default=DEFAULT_REWARD, metavar="MODULE:FN", help=f"reward function (default {DEFAULT_REWARD})")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto", help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=_at_least(1), default=8, metavar="B", help="hf backend: prompts per generate call (default 8)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F", help="vllm backend: fraction of GPU memory")
    parser.add_argument("--max-model-len", type=_at_least(1), default=None, metavar="N", help="vllm backend: context length")
    parser.add_argument("--max-num-seqs", type=_at_least(1), default=None, metavar="N",
                        help="vllm backend: sequences decoded at once (default vLLM's; 1: every decode step one row)")
    parser.add_argument("--max-lora-rank", type=_at_least(1), default=None, metavar="R",
                        help="vllm backend: the engine's max_lora_rank (default: the adapter's rank rounded up to one "
                        "vLLM allows; qerl's fused LoRA kernels need 16 or more)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    cfg = EvalConfig(
        model=args.model,
        data=args.data,
        adapter=args.adapter,
        backend=args.backend,
        quantization=args.quantization,
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        out=args.out,
        reward=args.reward,
        seed=args.seed,
        dtype=args.dtype,
        batch_size=args.batch_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_lora_rank=args.max_lora_rank,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    summary = run_eval(cfg)
    print(format_table(summary))
    print(f"wrote {cfg.out} and {summary_path(cfg.out)}")
    return 0
