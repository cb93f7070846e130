#!/usr/bin/env python3
"""GPU check: ``vllm serve <NVFP4A16 checkpoint> --enable-lora --lora-modules name=<adapter>`` answers an
OpenAI completion through the adapter, on localhost; then the server is stopped.

    python3 scripts/gpu/serve_adapter.py                                  # tiny model + adapter built here, ~2 min
    python3 scripts/gpu/serve_adapter.py --model CKPT --adapter ADAPTER   # your NVFP4A16 checkpoint and PEFT adapter
    python3 scripts/gpu/serve_adapter.py --quantization none              # vLLM's stock compressed-tensors path

Without --model: a tiny Qwen2 (random weights, byte-level tokenizer) is saved, quantized with `qerl quantize`
and given a random PEFT adapter (r16, all projections, non-zero B). The server runs
``python -m vllm.entrypoints.cli.main serve`` (the `vllm serve` command) with ``--quantization nvfp4`` by
default; the script waits for /health, lists /v1/models, sends one completion for the adapter and one for the
base model (temperature 0), prints them, and kills the server (also on errors / Ctrl-C).

With --eval-data (verl RL rows, e.g. examples/smollm2/prepare.py's data/test.parquet) it also scores greedy chat
completions of every row through the adapter and through the base with the project's reward (the last step of
train -> export -> serve -> eval).

Writes $OUT/serve_adapter.json (requests, responses, timings) and $OUT/serve_adapter/server.log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

ADAPTER_NAME = "qerl-adapter"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def byte_tokenizer():
    """A byte-level BPE Qwen2 tokenizer over printable ASCII (ids 0-94) plus <|endoftext|> (id 95)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    table = bytes_to_unicode()
    vocab = {table[b]: i for i, b in enumerate(range(32, 127))}
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_tiny(work: Path, rank: int) -> tuple[Path, Path]:
    """bf16 tiny Qwen2 -> `qerl quantize` NVFP4A16 checkpoint, plus a random PEFT adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qerl_plugin.quantize import quantize_checkpoint

    tok = byte_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                      dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    bf16 = work / "tiny-bf16"
    model.to(torch.bfloat16).save_pretrained(bf16)
    tok.save_pretrained(bf16)
    ckpt = work / "tiny-nvfp4a16"
    if not (ckpt / "config.json").exists():
        quantize_checkpoint(bf16, ckpt, progress=False, log=lambda m: None)
    peft_model = get_peft_model(
        Qwen2ForCausalLM.from_pretrained(bf16, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    adapter = work / f"adapter-r{rank}"
    peft_model.save_pretrained(adapter)
    return ckpt, adapter


def _http(method: str, url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(errors="replace"), exc.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def served_accuracy(base: str, model_name: str, data: Path, max_tokens: int) -> dict:
    """Greedy chat completions of every row through ``model_name`` on the server, scored with the project's reward."""
    from concurrent.futures import ThreadPoolExecutor

    import pandas as pd

    from verl_ext.reward import compute_score

    rows = pd.read_parquet(data)

    def one(row) -> tuple[float, str | None]:
        body = {"model": model_name, "messages": [dict(m) for m in row["prompt"]], "max_tokens": max_tokens,
                "temperature": 0.0}
        status, resp = _http("POST", f"{base}/v1/chat/completions", body, timeout=120)
        if status != 200 or not isinstance(resp, dict):
            return 0.0, None
        text = resp["choices"][0]["message"]["content"]
        return compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])["score"], text

    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, [r for _, r in rows.iterrows()]))
    correct = sum(score for score, _ in results)
    return {"rows": len(results), "answered": sum(t is not None for _, t in results), "correct": correct,
            "accuracy": correct / max(len(results), 1), "seconds": round(time.time() - t0, 1),
            "examples": [t for _, t in results[:5]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="NVFP4A16 checkpoint (default: build a tiny one)")
    ap.add_argument("--adapter", help="PEFT LoRA adapter folder (default: build a random one)")
    ap.add_argument("--quantization", default="nvfp4", help="'nvfp4' (qerl-plugin, default) or 'none' (stock path)")
    ap.add_argument("--rank", type=int, default=16, help="rank of the built adapter; --max-lora-rank at least this")
    ap.add_argument("--max-lora-rank", type=int, default=None)
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server to be healthy")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (faster start)")
    ap.add_argument("--extra", default="", help="extra `vllm serve` arguments (one string)")
    ap.add_argument("--eval-data", help="verl RL rows (parquet): greedy accuracy through the adapter and the base")
    ap.add_argument("--eval-max-tokens", type=int, default=64)
    args = ap.parse_args()

    out = Path(os.environ.get("OUT", ".out")).expanduser().resolve()
    work = out / "serve_adapter"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"ok": False, "steps": []}

    def step(name: str, ok: bool, detail: str, **data) -> None:
        report["steps"].append({"step": name, "ok": ok, "detail": detail, **data})
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)

    proc = None
    try:
        if (args.model is None) != (args.adapter is None):
            raise SystemExit("pass both --model and --adapter, or neither (a tiny model and adapter are built)")
        if args.model is None:
            model, adapter = build_tiny(work, args.rank)
            step("prepare", True, f"tiny NVFP4A16 {model}, adapter {adapter}")
        else:
            model, adapter = Path(args.model).resolve(), Path(args.adapter).resolve()
            cfg = json.loads((adapter / "adapter_config.json").read_text())
            args.rank = max(args.rank, int(cfg.get("r", args.rank)))
        port = args.port or _free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16", "--enable-lora", "--max-loras", "1",
               "--max-lora-rank", str(args.max_lora_rank or max(args.rank, 8)),
               "--lora-modules", f"{ADAPTER_NAME}={adapter}", "--max-model-len", "512", "--max-num-seqs", "32" if args.eval_data else "4",
               "--gpu-memory-utilization", "0.3"]
        if args.quantization and args.quantization != "none":
            cmd += ["--quantization", args.quantization]
        cmd += ["--enforce-eager"] if args.eager else [
            "--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32] if args.eval_data else [1, 2, 4]})]
        cmd += args.extra.split()
        report["command"] = cmd
        log_path = work / "server.log"
        print("$ " + " ".join(cmd), flush=True)
        log = open(log_path, "w")
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while True:
            if proc.poll() is not None:
                tail = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()][-5:]
                raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was healthy: {' | '.join(tail)}")
            if time.time() - started > args.timeout:
                raise RuntimeError(f"vllm serve not healthy after {args.timeout:.0f} s; see {log_path}")
            try:
                status, _ = _http("GET", f"{base}/health", timeout=5)
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(2)
        step("server healthy", True, f"{time.time() - started:.0f} s (log {log_path})", startup_s=time.time() - started)

        status, models = _http("GET", f"{base}/v1/models")
        ids = [m.get("id") for m in models.get("data", [])] if isinstance(models, dict) else []
        step("models listed", status == 200 and ADAPTER_NAME in ids, f"HTTP {status}: {ids}", models=models)

        answers = {}
        for name in (ADAPTER_NAME, str(model)):
            body = {"model": name, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
            t0 = time.time()
            status, resp = _http("POST", f"{base}/v1/completions", body, timeout=120)
            text = resp["choices"][0]["text"] if status == 200 and isinstance(resp, dict) else None
            answers[name] = text
            label = "adapter" if name == ADAPTER_NAME else "base model"
            step(f"completion ({label})", text is not None,
                 f"HTTP {status} in {time.time() - t0:.2f} s: {text!r}" if text is not None else f"HTTP {status}: {resp}",
                 request=body, response=resp)
        if all(v is not None for v in answers.values()):
            differ = answers[ADAPTER_NAME] != answers[str(model)]
            step("adapter changes the answer", differ, "adapter and base completions differ" if differ else
                 "adapter and base gave the same text (a zero or inactive adapter?)")
        if args.eval_data:
            for name, label in ((ADAPTER_NAME, "adapter"), (str(model), "base model")):
                acc = served_accuracy(base, name, Path(args.eval_data), args.eval_max_tokens)
                report.setdefault("eval", {})[label] = acc
                step(f"accuracy ({label})", acc["answered"] == acc["rows"],
                     f"{acc['correct']}/{acc['rows']} = {acc['accuracy']:.3f} greedy through the server", eval=acc)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - report, then stop the server in finally
        step("error", False, f"{type(exc).__name__}: {exc}")
    finally:
        if proc is not None:
            _stop(proc)
            step("server stopped", proc.poll() is not None, f"exit status {proc.poll()}")
    report["ok"] = bool(report["steps"]) and all(s["ok"] for s in report["steps"])
    (out / "serve_adapter.json").write_text(json.dumps(report, indent=1, default=str))
    print("\nserve_adapter summary")
    for s in report["steps"]:
        print(f"  {'PASS' if s['ok'] else 'FAIL'}  {s['step']:<28} {s['detail'][:150]}")
    print("ALL PASSED" if report["ok"] else "SOME CHECKS FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
