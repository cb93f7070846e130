#!/usr/bin/env python3
"""Does vLLM 0.24 load a ``qerl quantize`` checkpoint unmodified, and compute what our codec says it should?

Steps (each one logged; a failing step is recorded and the rest still run where they can):

1. build   a tiny random-weight Qwen2 (bf16; hidden 256, intermediate 1024, 4 heads of 64, 2 kv heads,
           vocab 2048: Marlin FP4 tiles without padding). lm_head gets a large init std so the logits are
           peaked and greedy decoding is stable against the ~1e-2 noise of bf16 GEMMs.
2. quantize ``qerl quantize SRC DST`` through the CLI entry point.
3. reference transformers (sdpa) with the *dequantized* NVFP4 weights (our ``nvfp4.dequantize``, bf16) in
           place of every decoder Linear: greedy continuations of a few token-id prompts.
4. vllm    ``LLM(model=DST, dtype=bfloat16)`` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), stock vLLM
           (no plugins, unless --with-plugins), which scheme and kernel each Linear got, then greedy 48 new
           tokens per prompt with logprobs (raw logprobs, vLLM's default logprobs_mode).
5. compare per prompt: how many leading tokens vLLM and transformers agree on (free-running); then
           transformers teacher-forced on vLLM's tokens: max |logprob(vLLM) - logprob(HF)| of the chosen
           tokens, and whether every argmax disagreement sits at a near-tie of HF's top two logits.

Pass criteria (written into the JSON): max |d logprob| <= --tol (default 0.25 nats) over all chosen tokens,
and every teacher-forced argmax disagreement has an HF top-1/top-2 logit margin below --tie-margin (0.25).
Two scales are reported next to it: the numeric noise floor (HF bf16 vs HF fp32 with the same dequantized
weights; ~0.06 nats on CPU for this model) and the quantization error itself (dequantized NVFP4 vs the
original bf16 weights; ~1.1-1.5 nats on CPU). A decoding mistake (wrong scale, nibble order, fused global scale)
lands in the second range, bf16 kernel differences in the first; the tolerance sits between them.

GPU machine (the lead's), from the repo root, after installing vllm into /tmp/site and this project:

    PYTHONPATH=/tmp/site OUT=/tmp/out python3 scripts/gpu/check_vllm_load.py

~1-2 min (engine start with enforce_eager; add --cuda-graphs to exercise graphs). Writes
$OUT/check_vllm_load.json (all results), $OUT/check_vllm_load.log, and the checkpoints under $OUT/work.
On a CPU machine ``--cpu-only`` runs steps 1-3 (and the quantization-error comparison) without vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends a function
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LOG = logging.getLogger("check_vllm_load")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "./.out"), help="output folder (default $OUT or ./.out)")
    p.add_argument("--cpu-only", action="store_true", help="skip vLLM: build, quantize and the HF reference on CPU")
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--intermediate", type=int, default=1024)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--vocab", type=int, default=2048)
    g.add_argument("--init-std", type=float, default=0.04, help="std of the decoder Linear weights (~1/sqrt(hidden))")
    g.add_argument("--embed-std", type=float, default=0.5, help="std of the token embeddings")
    g.add_argument("--lm-head-std", type=float, default=0.3, help="std of lm_head: larger = peakier logits")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("generation")
    g.add_argument("--num-prompts", type=int, default=4)
    g.add_argument("--prompt-len", type=int, default=16)
    g.add_argument("--new-tokens", type=int, default=48)
    g.add_argument("--logprobs", type=int, default=5, help="top-k logprobs vLLM returns per step")
    g = p.add_argument_group("vllm")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    g.add_argument("--cuda-graphs", action="store_true", help="do not pass enforce_eager=True")
    g.add_argument("--max-model-len", type=int, default=256)
    g.add_argument(
        "--with-plugins",
        action="store_true",
        help="load vLLM's general plugins (ours included); default is stock vLLM (VLLM_PLUGINS='')",
    )
    g = p.add_argument_group("tolerances")
    g.add_argument("--tol", type=float, default=0.25, help="max |logprob difference| of chosen tokens (nats)")
    g.add_argument("--tie-margin", type=float, default=0.25, help="HF top-2 margin under which an argmax flip is a near-tie")
    return p.parse_args(argv)


class Results:
    """Collects step outcomes; every step runs in ``step()`` so a failure is logged and recorded, not fatal."""

    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"steps": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def step(self, name: str, fn, *args, **kwargs):
        LOG.info("=== %s", name)
        t0 = time.time()
        try:
            value = fn(*args, **kwargs)
            self.data["steps"][name] = {"ok": True, "seconds": round(time.time() - t0, 2)}
            return value
        except BaseException as exc:  # keep going; KeyboardInterrupt still ends the run after saving
            LOG.error("%s failed: %s\n%s", name, exc, traceback.format_exc())
            self.data["steps"][name] = {"ok": False, "seconds": round(time.time() - t0, 2), "error": f"{type(exc).__name__}: {exc}"}
            if isinstance(exc, KeyboardInterrupt):
                self.save()
                raise
            return None

    def save(self) -> Path:
        path = self.out / "check_vllm_load.json"
        path.write_text(json.dumps(self.data, indent=2, default=str))
        return path


# ---------------------------------------------------------------------------------------------------------
# steps


def build_model(args, path: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(512, args.max_model_len),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=args.vocab - 1,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                p.normal_(0.0, args.lm_head_std)
            elif "embed_tokens" in name:
                p.normal_(0.0, args.embed_std)
            elif p.dim() == 2:
                p.normal_(0.0, args.init_std)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(path)
    try:  # a tokenizer is optional (vLLM runs with skip_tokenizer_init), but makes DST a complete model dir
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        byte_char = bytes_to_unicode()
        vocab = {byte_char[b]: i for i, b in enumerate(range(32, 127))}
        Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None).save_pretrained(path)
    except Exception as exc:
        LOG.warning("no tokenizer written: %s", exc)
    LOG.info("built %s: %s", path, {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")})
    return path


def quantize(src: Path, dst: Path) -> dict:
    from qerl_plugin.cli import main

    rc = main(["quantize", str(src), str(dst), "--overwrite", "--quiet"])
    if rc != 0:
        raise RuntimeError(f"qerl quantize exited with {rc}")
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    files = sorted(p.name for p in dst.iterdir())
    LOG.info("quantized -> %s: %s", dst, files)
    return {"files": files, "ignore": qc["ignore"], "format": qc["format"]}


def prompts(args) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(0, args.vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]


def load_hf(src: Path, dst: Path | None, device: str):
    """transformers' Qwen2 from SRC; with ``dst``, every decoder Linear gets our dequantized NVFP4 weight."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from qerl_plugin import nvfp4

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()
    if dst is None:
        return model
    tensors = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k)
    n = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if f"{name}.weight_packed" in tensors:
                w = nvfp4.dequantize(tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_global_scale"], torch.bfloat16)
                assert module.weight.shape == w.shape, name
                module.weight.copy_(w.to(device))
                n += 1
    LOG.info("HF model with %d dequantized NVFP4 Linears", n)
    return model


def hf_greedy(model, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    out = []
    dev = next(model.parameters()).device
    with torch.no_grad():
        for ids in prompt_ids:
            seq = torch.tensor([ids], device=dev)
            for _ in range(new_tokens):  # explicit loop: no generation-config surprises
                logits = model(seq).logits[0, -1].float()
                seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
            out.append(seq[0, len(ids) :].tolist())
    return out


def hf_teacher_forced(model, prompt_ids: list[int], gen: list[int]) -> dict:
    """HF log-probs of ``gen`` given ``prompt_ids`` (one forward pass), its argmax and top-2 margins."""
    import torch

    dev = next(model.parameters()).device
    seq = torch.tensor([prompt_ids + gen], device=dev)
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    logits = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(gen)]
    logp = torch.log_softmax(logits, dim=-1)
    top2 = logits.topk(2, dim=-1).values
    chosen = torch.tensor(gen, device=dev)
    return {
        "logprob": logp.gather(1, chosen.view(-1, 1)).squeeze(1).cpu().tolist(),
        "argmax": logits.argmax(-1).cpu().tolist(),
        "margin": (top2[:, 0] - top2[:, 1]).cpu().tolist(),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_models(ref, other, prompt_ids: list[list[int]], gens: list[list[int]]) -> dict:
    """Teacher-forced on ``gens``: max |logprob difference| between two HF models (quantization error scale)."""
    diffs = []
    for p, g in zip(prompt_ids, gens):
        a, b = hf_teacher_forced(ref, p, g), hf_teacher_forced(other, p, g)
        diffs.append(max(abs(x - y) for x, y in zip(a["logprob"], b["logprob"])))
    return {"max_abs_logprob_diff_per_prompt": diffs}


def run_vllm(args, dst: Path, prompt_ids: list[list[int]]) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(dst),
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not args.cuda_graphs,
        max_model_len=args.max_model_len,
        skip_tokenizer_init=True,
        seed=args.seed,
    )
    info: dict = {"quantization": getattr(llm.llm_engine.model_config, "quantization", None)}

    def describe(model):
        rows = {}
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if qm is None or not name.startswith("model.layers.0."):
                continue
            scheme = getattr(module, "scheme", None)
            kernel = getattr(scheme, "kernel", None)
            rows[name] = {
                "layer": type(module).__name__,
                "quant_method": type(qm).__name__,
                "scheme": type(scheme).__name__ if scheme is not None else None,
                "kernel": type(kernel).__name__ if kernel is not None else None,
                "weight": [str(getattr(module, "weight", torch.empty(0)).dtype), list(getattr(module, "weight", torch.empty(0)).shape)],
            }
        lm = getattr(model, "lm_head", None)
        if lm is not None:
            rows["lm_head"] = {"layer": type(lm).__name__, "quant_method": type(getattr(lm, "quant_method", None)).__name__}
        return rows

    try:
        info["layers"] = llm.apply_model(describe)[0]
        LOG.info("vLLM layers: %s", json.dumps(info["layers"], indent=1))
    except Exception as exc:
        info["layers_error"] = f"{type(exc).__name__}: {exc}"
        LOG.warning("could not inspect the model: %s", exc)

    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, logprobs=args.logprobs, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp, use_tqdm=False)
    gens, chosen_lp, top = [], [], []
    for o in outs:
        c = o.outputs[0]
        toks = list(c.token_ids)
        gens.append(toks)
        chosen_lp.append([step[t].logprob for t, step in zip(toks, c.logprobs)])
        top.append([sorted(((tid, lp.logprob) for tid, lp in step.items()), key=lambda kv: -kv[1])[:2] for step in c.logprobs])
    info.update(tokens=gens, chosen_logprob=chosen_lp, top2=top)
    del llm
    return info


def compare(args, prompt_ids, hf_gens, vllm_info, hf_model) -> dict:
    rows = []
    worst = 0.0
    flips_ok = True
    for i, (p, hg) in enumerate(zip(prompt_ids, hf_gens)):
        vg = vllm_info["tokens"][i]
        tf = hf_teacher_forced(hf_model, p, vg)
        diffs = [abs(a - b) for a, b in zip(vllm_info["chosen_logprob"][i], tf["logprob"])]
        flips = [j for j, (a, t) in enumerate(zip(tf["argmax"], vg)) if a != t]
        bad_flips = [j for j in flips if tf["margin"][j] >= args.tie_margin]
        flips_ok &= not bad_flips
        worst = max(worst, max(diffs))
        rows.append(
            {
                "prompt": i,
                "match_len": common_prefix(hg, vg),
                "new_tokens": len(vg),
                "max_abs_logprob_diff": max(diffs),
                "mean_abs_logprob_diff": sum(diffs) / len(diffs),
                "teacher_forced_argmax_flips": flips,
                "flip_margins": [tf["margin"][j] for j in flips],
                "min_hf_margin": min(tf["margin"]),
            }
        )
    return {
        "per_prompt": rows,
        "max_abs_logprob_diff": worst,
        "tol": args.tol,
        "tie_margin": args.tie_margin,
        "pass": worst <= args.tol and flips_ok,
    }


# ---------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(out / "check_vllm_load.log", mode="w")],
    )
    res = Results(out)
    res.data["args"] = vars(args)
    if not args.with_plugins:
        os.environ["VLLM_PLUGINS"] = ""  # stock vLLM: the checkpoint must load without qerl's plugin
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.cpu_only else "cpu"
    res.data["env"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "device": device,
    }
    for dist in ("vllm", "transformers", "compressed-tensors", "qerl-plugin"):
        try:
            from importlib.metadata import version

            res.data["env"][dist] = version(dist)
        except Exception:
            res.data["env"][dist] = None
    LOG.info("env: %s", res.data["env"])

    src = res.step("build", build_model, args, work / "src")
    dst = work / "nvfp4"
    if src is not None:
        res.data["quantize"] = res.step("quantize", quantize, src, dst)
    prompt_ids = prompts(args)
    res.data["prompts"] = prompt_ids

    hf = hf_gens = None
    if res.data.get("quantize"):
        hf = res.step("hf_load_dequantized", load_hf, src, dst, device)
    if hf is not None:
        hf_gens = res.step("hf_greedy", hf_greedy, hf, prompt_ids, args.new_tokens)
        res.data["hf_tokens"] = hf_gens

    def quant_error():
        orig = load_hf(src, None, device)
        r = compare_models(hf, orig, prompt_ids, hf_gens)
        r["greedy_match_len_vs_bf16"] = [common_prefix(a, b) for a, b in zip(hf_gens, hf_greedy(orig, prompt_ids, args.new_tokens))]
        del orig
        return r

    def noise_floor():
        hf32 = load_hf(src, dst, device).float()
        r = compare_models(hf, hf32, prompt_ids, hf_gens)
        flips = []
        for p, g in zip(prompt_ids, hf_gens):
            a, b = hf_teacher_forced(hf, p, g), hf_teacher_forced(hf32, p, g)
            flips += [round(a["margin"][j], 4) for j in range(len(g)) if b["argmax"][j] != g[j]]
        r["fp32_argmax_flip_margins"] = flips
        del hf32
        return r

    if hf_gens is not None:
        res.data["quantization_error_vs_bf16"] = res.step("quantization_error_vs_bf16", quant_error)
        res.data["noise_floor_bf16_vs_fp32"] = res.step("noise_floor_bf16_vs_fp32", noise_floor)

    def fp32_standin():
        """What ``compare`` does with vLLM's output, fed by HF fp32 instead (exercises the code on CPU)."""
        hf32 = load_hf(src, dst, device).float()
        gens = hf_greedy(hf32, prompt_ids, args.new_tokens)
        info = {"tokens": gens, "chosen_logprob": [hf_teacher_forced(hf32, p, g)["logprob"] for p, g in zip(prompt_ids, gens)]}
        return compare(args, prompt_ids, hf_gens, info, hf)

    if args.cpu_only:
        LOG.info("--cpu-only: skipping vLLM; comparing against HF fp32 as a stand-in")
        if hf_gens is not None:
            res.data["compare_fp32_standin"] = res.step("compare_fp32_standin", fp32_standin)
    elif not torch.cuda.is_available():
        res.data["steps"]["vllm"] = {"ok": False, "error": "no CUDA device (use --cpu-only on CPU machines)"}
    elif res.data.get("quantize"):
        if hf is not None and device == "cuda":  # free the HF copy's memory for vLLM; reload for teacher forcing
            hf.cpu()
            torch.cuda.empty_cache()
        vinfo = res.step("vllm", run_vllm, args, dst, prompt_ids)
        res.data["vllm"] = vinfo
        if vinfo is not None and hf is not None and hf_gens is not None:
            hf.to(device)
            res.data["compare"] = res.step("compare", compare, args, prompt_ids, hf_gens, vinfo, hf)

    ok = all(s["ok"] for s in res.data["steps"].values()) and (args.cpu_only or bool((res.data.get("compare") or {}).get("pass")))
    res.data["pass"] = ok
    path = res.save()
    print_summary(res.data, path)
    return 0 if ok else 1


def print_summary(data: dict, path: Path) -> None:
    print("\n=== check_vllm_load summary ===")
    print(f"{'step':<28} {'ok':<5} {'s':>7}  error")
    for name, s in data["steps"].items():
        print(f"{name:<28} {str(s['ok']):<5} {s.get('seconds', 0):>7.1f}  {s.get('error', '')[:100]}")
    qe = data.get("quantization_error_vs_bf16")
    if qe:
        print(f"NVFP4 vs bf16 (HF, teacher-forced): max |d logprob| per prompt {[round(x, 4) for x in qe['max_abs_logprob_diff_per_prompt']]}, greedy match {qe['greedy_match_len_vs_bf16']}")
    nf = data.get("noise_floor_bf16_vs_fp32")
    if nf:
        print(f"noise floor, HF bf16 vs fp32 (same weights): max |d logprob| per prompt {[round(x, 4) for x in nf['max_abs_logprob_diff_per_prompt']]}, flips at margins {nf['fp32_argmax_flip_margins']}")
    v = data.get("vllm") or {}
    layers = v.get("layers") or {}
    for name, row in list(layers.items())[:4]:
        print(f"vLLM {name}: {row}")
    c = data.get("compare") or data.get("compare_fp32_standin")
    if c:
        if "compare" not in data:
            print("(--cpu-only: the table compares HF fp32 with HF bf16, standing in for vLLM)")
        print(f"{'prompt':<7} {'match':>6} {'max|dlp|':>9} {'mean|dlp|':>10} {'flips':>6} {'min margin':>10}")
        for r in c["per_prompt"]:
            print(f"{r['prompt']:<7} {r['match_len']:>3}/{r['new_tokens']:<2} {r['max_abs_logprob_diff']:>9.4f} {r['mean_abs_logprob_diff']:>10.5f} {len(r['teacher_forced_argmax_flips']):>6} {r['min_hf_margin']:>10.3f}")
        print(f"vLLM vs HF(dequantized NVFP4): max |d logprob| = {c['max_abs_logprob_diff']:.4f} (tol {c['tol']}), PASS = {c['pass']}")
    print(f"overall: {'PASS' if data.get('pass') else 'FAIL'}; results: {path}")


if __name__ == "__main__":
    sys.exit(main())
