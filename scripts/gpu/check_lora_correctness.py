#!/usr/bin/env python3
"""GPU check: vLLM ``--quantization nvfp4`` + LoRA computes what transformers + PEFT computes on the
dequantized base with the same adapter, from a BF16 checkpoint (quantized while loading) and from a
``qerl quantize`` checkpoint, and both hold the same Marlin bytes as vLLM's stock compressed-tensors path.

Run from the repository root on the GPU machine, with vLLM and the project installed (``/tmp/site``):

    python3 scripts/gpu/check_lora_correctness.py              # ~3-6 min on an H100 (3 engines, CUDA graphs)
    python3 scripts/gpu/check_lora_correctness.py --eager      # faster engine starts (correctness only)
    python3 scripts/gpu/check_lora_correctness.py --skip-stock --ranks 32
    python3 scripts/gpu/check_lora_correctness.py --skip-stock --ranks 32 --backend humming   # the opt-in backend

Steps (each survives the failure of another; results in $OUT, default ./.out):
  prepare     tiny Qwen2 (random weights, hidden 512 / inter 1536 / 8 heads / 2 kv heads / 2 layers, q/k/v
              biases, a peaky lm_head so greedy tokens have margins), random PEFT adapters r8 and r32 on all 7
              projections with non-zero B (PEFT's own get_peft_model/save_pretrained), `qerl quantize` output
  reference   transformers (fp32, sdpa) with every projection replaced by its NVFP4 dequantization
              (q/k/v and gate/up with a shared global scale) + the PEFT adapter: greedy 32 tokens per prompt,
              then teacher-forced log-probs of those sequences; the same without adapter
  engine:bf16   vLLM LLM(bf16 checkpoint, quantization="nvfp4", enable_lora) in a subprocess
  engine:ct     vLLM LLM(qerl quantize checkpoint, quantization="nvfp4", enable_lora)
  engine:stock  vLLM LLM(qerl quantize checkpoint) - vLLM's own compressed-tensors NVFP4A16 path
  compare     per engine and rank: greedy token match vs the fp32 reference (divergence allowed only at near-ties),
              teacher-forced |d logprob| (max, mean) within max(tolerance, 1.5 x the bf16 transformers+PEFT floor),
              adapter effect (with vs without adapter, must be large), Marlin tensors bf16 == ct == stock
              (with --backend humming: humming's tensors bf16 == ct, and each engine log names the backend)

Writes $OUT/check_lora_correctness.jsonl, $OUT/check_lora_correctness.json, engine logs under
$OUT/check_lora_correctness/, and prints a PASS/FAIL table last. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the installed project (entry points) wins; the checkout is a fallback

# what vllm_ext.nvfp4_backends reads; from qerl_plugin.options, which imports neither torch nor vLLM
from qerl_plugin.options import NVFP4_BACKEND_ENV as BACKEND_ENV  # noqa: E402

TINY = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6,
            rope_theta=10000.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}


class Recorder:
    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.jsonl = open(out / "check_lora_correctness.jsonl", "a")
        self.rows: list[dict] = []

    def add(self, step: str, ok: bool, detail: str, **data) -> None:
        row = {"step": step, "ok": ok, "detail": detail, **data, "time": time.strftime("%H:%M:%S")}
        self.rows.append(row)
        self.jsonl.write(json.dumps(row, default=str) + "\n")
        self.jsonl.flush()
        print(f"[{'PASS' if ok else 'FAIL'}] {step}: {detail}", flush=True)


# ---------------------------------------------------------------------------------------------------
# prepare


def prepare(work: Path, ranks: list[int], seed: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qerl_plugin.quantize import quantize_checkpoint

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, dtype="bfloat16"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 0.05)
        # logits with std ~8: greedy choices have margins far above bf16 noise
        model.lm_head.weight.normal_(0.0, 8.0 / TINY["hidden_size"] ** 0.5)
    model = model.to(torch.bfloat16)
    bf16 = work / "tiny-bf16"
    model.save_pretrained(bf16)
    ct = work / "tiny-nvfp4a16"
    if not (ct / "config.json").exists():
        quantize_checkpoint(bf16, ct, progress=False, log=lambda m: None)
    adapters = {}
    for r in ranks:
        peft_model = get_peft_model(
            Qwen2ForCausalLM.from_pretrained(bf16, dtype=torch.float32),
            LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"),
        )
        gen = torch.Generator().manual_seed(seed + r)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero; a zero adapter would prove nothing
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        path = work / f"adapter-r{r}"
        peft_model.save_pretrained(path)
        adapters[r] = str(path)
    return {"bf16": str(bf16), "ct": str(ct), "adapters": adapters}


# ---------------------------------------------------------------------------------------------------
# reference: transformers + PEFT on the dequantized base


def dequantized_reference(bf16_dir: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from qerl_plugin import nvfp4

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32, attn_implementation="sdpa")
    sd = {k: v for k, v in AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).state_dict().items()}
    modules = dict(model.named_modules())
    for layer in range(TINY["num_hidden_layers"]):
        for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
                             ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",))):
            prefix = f"model.layers.{layer}.{block}"
            qs = nvfp4.quantize_fused([sd[f"{prefix}.{n}.weight"] for n in names])  # bf16 source, shared scale
            for n, q in zip(names, qs):
                with torch.no_grad():
                    modules[f"{prefix}.{n}"].weight.copy_(q.dequantize(torch.float32))
    return model.to(device).eval()


def reference(paths: dict, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """fp32 transformers+PEFT: greedy sequences, their teacher-forced logprobs and top-1/top-2 margins, the same
    without adapter; then the identical model in bf16 on the same sequences (the precision floor vLLM is held to)."""
    import torch
    from peft import PeftModel

    base = dequantized_reference(paths["bf16"], device)
    out: dict = {"greedy": {}, "tf": {}, "tf_base": {}, "bf16": {}}

    def teacher_forced(model, seqs, margins=False):
        res, gaps = [], []
        for seq in seqs:
            ids = torch.tensor([seq], device=device)
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
            res.append([float(logp[i - 1, seq[i]]) for i in range(1, len(seq))])
            top2 = logp.topk(2, dim=-1).values
            gaps.append([float(top2[i - 1, 0] - top2[i - 1, 1]) for i in range(1, len(seq))])
        return (res, gaps) if margins else res

    for r, adapter in paths["adapters"].items():
        model = PeftModel.from_pretrained(base, adapter).eval()
        seqs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            seqs.append(gen[0].tolist())
        out["greedy"][r] = [s[len(p):] for s, p in zip(seqs, prompts)]
        logprobs, gaps = teacher_forced(model, seqs, margins=True)
        out["tf"][r] = {"seqs": seqs, "logprobs": logprobs, "margins": gaps}
        with model.disable_adapter():
            out["tf_base"][r] = teacher_forced(model, seqs)
        base = model.unload()  # the plain dequantized base again
    # the precision floor: the same dequantized weights and adapters, run by transformers+PEFT in bf16
    base = base.to(torch.bfloat16)
    for r, adapter in paths["adapters"].items():
        model = PeftModel.from_pretrained(base, adapter).eval()
        out["bf16"][r] = teacher_forced(model, out["tf"][r]["seqs"])
        base = model.unload()
    return out


# ---------------------------------------------------------------------------------------------------
# engines (each in its own process: GPU memory is freed, a crash or hang is contained)


def engine_main(spec_path: str, out_path: str) -> int:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(**spec["engine"])
    res: dict = {"greedy": {}, "tf": {}, "tf_nolora": {}, "kernel": {}}
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], min_tokens=spec["new_tokens"],
                            ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def tf(seqs, lora):
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], forced, lora_request=lora, use_tqdm=False)
        return [[float(pl[s[i]].logprob) for i, pl in enumerate(o.prompt_logprobs) if i > 0]
                for o, s in zip(outs, seqs)]

    for i, (r, adapter) in enumerate(sorted(spec["adapters"].items(), key=lambda kv: int(kv[0])), start=1):
        lora = LoRARequest(f"adapter-r{r}", i, adapter)
        batches = [[p] for p in spec["prompts"]] if spec.get("greedy_one_by_one") else [spec["prompts"]]
        outs = [o for batch in batches  # one prompt at a time: every decode step at batch 1 (one-row paths)
                for o in llm.generate([{"prompt_token_ids": p} for p in batch], greedy, lora_request=lora,
                                      use_tqdm=False)]
        # keys as the reference has them (int ranks; the JSON spec turned them into strings)
        res["greedy"][int(r)] = [list(o.outputs[0].token_ids) for o in outs]
        seqs = spec["tf_seqs"][str(r)]
        res["tf"][int(r)] = tf(seqs, lora)
        res["tf_nolora"][int(r)] = tf(seqs, None)  # the same sequences without adapter (adapter effect)

    def grab(worker):
        model = worker.model_runner.get_model()
        tensors = {}
        for name, mod in model.named_modules():
            if hasattr(mod, "weight_global_scale") and hasattr(mod, "weight_scale"):
                tensors[name.replace(".base_layer", "")] = {
                    n: getattr(mod, n).detach().cpu().clone()
                    for n in ("weight", "weight_scale", "weight_global_scale", "bias")
                    if getattr(mod, n, None) is not None
                }
        return tensors

    res["kernel"] = llm.collective_rpc(grab)[0]
    torch.save(res, out_path)
    return 0


def run_engine(name: str, paths: dict, prompts, tf_seqs, args, logdir: Path) -> dict:
    import torch

    model = paths["bf16"] if name == "bf16" else paths["ct"]
    engine = dict(model=model, dtype="bfloat16", skip_tokenizer_init=True, seed=0, max_model_len=256,
                  enable_lora=True, max_lora_rank=max(args.ranks), max_loras=1, max_cpu_loras=len(args.ranks),
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                  enforce_eager=args.eager, max_num_seqs=8)
    if not args.eager:
        engine["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    if name != "stock":
        engine["quantization"] = "nvfp4"
    spec = {"engine": engine, "adapters": {str(r): p for r, p in paths["adapters"].items()}, "prompts": prompts,
            "new_tokens": args.new_tokens, "tf_seqs": {str(r): s for r, s in tf_seqs.items()},
            "greedy_one_by_one": args.greedy_one_by_one}
    spec_path, out_path, log_path = logdir / f"{name}.spec.json", logdir / f"{name}.pt", logdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    if args.backend and name != "stock":  # qerl's nvfp4 engines on the asked backend (the stock engine is vLLM's own)
        env[BACKEND_ENV] = args.backend
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--engine", str(spec_path), str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"engine {name} timed out after {args.timeout:.0f} s; see {log_path}")
    if code != 0 or not out_path.exists():
        lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1] if lines else "(empty log)"
        raise RuntimeError(f"engine {name} failed (exit {code}): {last} - full log {log_path}")
    return torch.load(out_path, weights_only=False)


# ---------------------------------------------------------------------------------------------------
# comparisons


def _absdiff(a, b) -> list[float]:
    return [abs(x - y) for g, w in zip(a, b) for x, y in zip(g, w)]


def compare(rec: Recorder, name: str, res: dict, ref: dict, args) -> None:
    """vLLM vs the fp32 reference, held to max(fixed tolerance, 1.5 x what bf16 transformers+PEFT itself deviates
    from fp32 on the same sequences). Greedy: a prompt may diverge only where the fp32 reference's top-1/top-2
    margin is within twice that logprob tolerance (a near-tie any bf16 engine may break either way)."""
    for r in sorted(ref["greedy"]):
        floor = _absdiff(ref["bf16"][r], ref["tf"][r]["logprobs"])
        floor_max, floor_mean = max(floor), sum(floor) / len(floor)
        tol_max = max(args.tol_max, 1.5 * floor_max)
        tol_mean = max(args.tol_mean, 1.5 * floor_mean)
        got, want = res["greedy"][r], ref["greedy"][r]
        plen = [len(s) - len(w) for s, w in zip(ref["tf"][r]["seqs"], want)]
        match = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
        margins = [None if m == len(w) else ref["tf"][r]["margins"][k][plen[k] + m - 1]
                   for k, (m, w) in enumerate(zip(match, want))]
        near_tie = all(g is None or g <= 2 * tol_max for g in margins)
        rate = sum(match) / sum(len(w) for w in want)
        rec.add(f"{name} r{r} greedy", rate >= args.min_token_match or near_tie,
                f"{rate:.1%} of tokens before the first divergence (per prompt {match} of {len(want[0])}); "
                f"fp32 reference top-1/top-2 margin there {[None if g is None else round(g, 3) for g in margins]} "
                f"(near-tie if <= {2 * tol_max:.3f})",
                rate=rate, first_divergence=match, margins_at_divergence=margins)
        diffs = _absdiff(res["tf"][r], ref["tf"][r]["logprobs"])
        worst, mean = max(diffs), sum(diffs) / len(diffs)
        rec.add(f"{name} r{r} teacher-forced", worst <= tol_max and mean <= tol_mean,
                f"|d logprob| vs fp32 max {worst:.4f} (tol {tol_max:.4f}), mean {mean:.4f} (tol {tol_mean:.4f}) over "
                f"{len(diffs)} tokens; transformers+PEFT bf16 vs fp32: max {floor_max:.4f}, "
                f"mean {floor_mean:.4f}", max=worst, mean=mean, bf16_floor_max=floor_max,
                bf16_floor_mean=floor_mean, tol_max=tol_max, tol_mean=tol_mean)
        effect = _absdiff(res["tf"][r], res["tf_nolora"][r])
        ref_effect = _absdiff(ref["tf"][r]["logprobs"], ref["tf_base"][r])
        mean_effect, mean_ref = sum(effect) / len(effect), sum(ref_effect) / len(ref_effect)
        rec.add(f"{name} r{r} adapter effect", mean_effect > 10 * args.tol_mean and abs(mean_effect - mean_ref) <= 0.1 * mean_ref,
                f"mean |logprob(with r{r}) - logprob(without)| = {mean_effect:.3f} (reference {mean_ref:.3f}, "
                f"must agree within 10%)", effect=mean_effect, reference_effect=mean_ref)


def compare_kernels(rec: Recorder, a_name: str, a: dict, b_name: str, b: dict) -> None:
    import torch

    if sorted(a) != sorted(b) or not a:
        rec.add(f"marlin bytes {a_name} == {b_name}", False, f"different NVFP4 layers: {sorted(a)} vs {sorted(b)}")
        return
    bad = []
    for layer in a:
        for n in a[layer]:
            x, y = a[layer][n], b[layer].get(n)
            if y is None or x.shape != y.shape or x.dtype != y.dtype:
                bad.append(f"{layer}.{n}: {tuple(x.shape)} {x.dtype} vs {None if y is None else (tuple(y.shape), y.dtype)}")
            elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                bad.append(f"{layer}.{n}: bytes differ")
    rec.add(f"marlin bytes {a_name} == {b_name}", not bad,
            f"{len(a)} layers identical" if not bad else "; ".join(bad[:4]), mismatches=bad[:20])


# ---------------------------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--engine":
        return engine_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,32", help="adapter ranks (default 8,32)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--greedy-one-by-one", action="store_true",
                    help="decode the greedy prompts one at a time, so every step runs at batch 1 (decode_gemv's "
                         "one-row paths); the teacher-forced check is a prefill of all prompts either way")
    ap.add_argument("--eager", action="store_true", help="enforce_eager engines (faster start; correctness only)")
    ap.add_argument("--skip-stock", action="store_true", help="skip vLLM's stock compressed-tensors engine")
    ap.add_argument("--tol-max", type=float, default=0.25, help="max |d logprob| teacher-forced (default 0.25)")
    ap.add_argument("--tol-mean", type=float, default=0.03, help="mean |d logprob| teacher-forced (default 0.03)")
    ap.add_argument("--min-token-match", type=float, default=0.9, help="greedy tokens before divergence (0.9)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=("humming",), default=None,
                    help="run qerl's nvfp4 engines on this opt-in backend (QERL_NVFP4_BACKEND) and check that each "
                         "engine log names it (docs/benchmarks.md §4ae)")
    args = ap.parse_args()
    args.ranks = [int(x) for x in args.ranks.split(",") if x.strip()]

    out = Path(os.environ.get("OUT", ".out")).expanduser().resolve()
    work = out / "check_lora_correctness"
    work.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out)
    import random

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, TINY["vocab_size"] - 10) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    report: dict = {"args": vars(args), "prompts": prompts}

    try:
        paths = prepare(work, args.ranks, args.seed)
        rec.add("prepare", True, f"model {paths['bf16']}, NVFP4A16 {paths['ct']}, adapters r{args.ranks}")
    except Exception as exc:
        rec.add("prepare", False, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return finish(rec, report, out)
    try:
        ref = reference(paths, prompts, args.new_tokens, device)
        r0 = min(ref["greedy"])
        effect = _absdiff(ref["tf"][r0]["logprobs"], ref["tf_base"][r0])
        distinct = len({t for seq in ref["greedy"][r0] for t in seq})
        report["reference_greedy"] = ref["greedy"]
        rec.add("reference", distinct > 2, f"transformers+PEFT on the dequantized base ({device}, fp32): "
                f"{distinct} distinct greedy tokens, adapter r{r0} moves logprobs by {sum(effect) / len(effect):.3f} on average")
    except Exception as exc:
        rec.add("reference", False, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return finish(rec, report, out)
    tf_seqs = {r: ref["tf"][r]["seqs"] for r in ref["tf"]}

    kernels = {}
    for name in ("bf16", "ct") + (() if args.skip_stock else ("stock",)):
        try:
            res = run_engine(name, paths, prompts, tf_seqs, args, work)
            rec.add(f"engine:{name}", True, f"{len(res['kernel'])} NVFP4 layers; greedy and teacher-forced done")
            if args.backend and name != "stock":
                said = backend_logged(work / f"{name}.log", args.backend)
                rec.add(f"engine:{name} backend {args.backend}", said is not None,
                        said or f"the engine log does not name backend {args.backend}: it ran another one")
            kernels[name] = res["kernel"]
            compare(rec, name, res, ref, args)
        except Exception as exc:
            rec.add(f"engine:{name}", False, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    for a, b in (("bf16", "ct"), ("ct", "stock")):
        if a in kernels and b in kernels:
            try:
                compare_kernels(rec, a, kernels[a], b, kernels[b])
            except Exception as exc:
                rec.add(f"marlin bytes {a} == {b}", False, f"{type(exc).__name__}: {exc}")
    return finish(rec, report, out)


def backend_logged(log: Path, backend: str) -> str | None:
    """The line of an engine log where qerl's nvfp4 method names ``backend`` (its first-use warning), or None."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return next((line.strip() for line in text.splitlines() if f"nvfp4: backend {backend}" in line), None)


def finish(rec: Recorder, report: dict, out: Path) -> int:
    report["rows"] = rec.rows
    (out / "check_lora_correctness.json").write_text(json.dumps(report, indent=1, default=str))
    width = max((len(r["step"]) for r in rec.rows), default=10)
    print("\ncheck_lora_correctness summary")
    for r in rec.rows:
        print(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['step']:<{width}}  {r['detail'][:160]}")
    ok = bool(rec.rows) and all(r["ok"] for r in rec.rows)
    print(f"\n{'ALL PASSED' if ok else 'SOME CHECKS FAILED'} ({sum(r['ok'] for r in rec.rows)}/{len(rec.rows)}); "
          f"details in {out / 'check_lora_correctness.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
