#!/usr/bin/env python3
"""GPU: policy entropy of SmolLM2-135M-Instruct in the rollout engine, BF16 vs NVFP4 and versus the AQN sigma.

Two vLLM engines on the prepared model (examples/smollm2/prepare.py), both built with AQN norms
(``additional_config={"qerl_aqn": True}``; cleared noise is the stock norm): BF16, and NVFP4 (qerl's ``nvfp4``
method quantizes the BF16 checkpoint while loading, as the training rollout does). On the test prompts (chat
template, the demo's instruction):

* own-sample entropy: each engine samples one response per prompt (temperature 1, <= --max-tokens) and the
  entropy of every sampled position is read from its top-20 logprobs plus a uniform tail for the remaining
  mass (exact when the top 20 hold all of it; otherwise a bound that is tight for small tails);
* for the NVFP4 engine, the same at each sigma in --sigmas (--draws noise draws each, stage 1) and the
  teacher-forced entropy over one fixed set of sequences (the NVFP4 engine's own sigma-0 samples), which
  isolates the noise's effect from the sampling's.

    python scripts/gpu/entropy_sigma.py --model /tmp/qerl_smollm2/bf16 --data /tmp/qerl_smollm2/data/test.parquet

Writes --out/entropy_sigma.json (every number) and prints a table. Runs beside other GPU work
(--gpu-memory-utilization, default 0.08).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc with a callable needs in-process

from qerl_plugin import options  # noqa: E402

TOP_K = 20


def log(msg: str) -> None:
    print(f"[entropy_sigma {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_prompts(data: Path, tokenizer_dir: Path, limit: int) -> list[list[int]]:
    import pandas as pd
    from transformers import AutoTokenizer

    from qerl_plugin.evaluate import encode_chat

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = pd.read_parquet(data).head(limit)
    return [encode_chat(tok, p) for p in rows["prompt"]]


def position_entropy(top: dict, vocab: int) -> float:
    """Entropy (nats) of one position from its top-k logprobs {token: Logprob} plus a uniform tail."""
    lps = [float(lp.logprob) for lp in top.values()]
    ps = [math.exp(x) for x in lps]
    h = -sum(p * x for p, x in zip(ps, lps))
    tail = max(0.0, 1.0 - sum(ps))
    if tail > 0:
        h -= tail * math.log(tail / max(vocab - len(ps), 1))
    return h


def own_samples(llm, prompts, max_tokens: int, seed: int, vocab: int) -> tuple[float, list[list[int]]]:
    """Mean entropy over every sampled position, and the sampled token ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=TOP_K, seed=seed, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    ent, seqs = [], []
    for out in outs:
        c = out.outputs[0]
        seqs.append(list(c.token_ids))
        ent += [position_entropy(top, vocab) for top in (c.logprobs or [])]
    return statistics.fmean(ent), seqs


def forced(llm, prompts, responses, vocab: int) -> float:
    """Mean entropy over the response positions of fixed (prompt, response) sequences."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K, detokenize=False)
    full = [TokensPrompt(prompt_token_ids=p + r) for p, r in zip(prompts, responses) if r]
    outs = llm.generate(full, sp, use_tqdm=False)
    ent = []
    for out, p in zip(outs, [p for p, r in zip(prompts, responses) if r]):
        pl = out.prompt_logprobs
        ent += [position_entropy(pl[i], vocab) for i in range(len(p), len(pl)) if pl[i]]
    return statistics.fmean(ent)


def mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/qerl_smollm2/bf16"))
    p.add_argument("--data", type=Path, default=Path("/tmp/qerl_smollm2/data/test.parquet"))
    p.add_argument("--sigmas", default="0,1e-3,5e-3,1e-2,2e-2")
    p.add_argument("--draws", type=int, default=4, help="noise draws per sigma > 0")
    p.add_argument("--limit", type=int, default=200, help="test prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.08)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out")) / "entropy_sigma")
    p.add_argument("--engine", choices=("bf16", "nvfp4"), help=argparse.SUPPRESS)  # one engine per child process
    p.add_argument("--plot", type=Path, metavar="JSON", help="draw an entropy_sigma.json (no GPU) into --png")
    p.add_argument("--png", type=Path, default=Path("entropy_sigma.png"))
    args = p.parse_args()
    if args.plot:
        return plot(json.loads(args.plot.read_text()), args.png)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine is None:
        import subprocess

        for engine in ("bf16", "nvfp4"):
            rc = subprocess.call([sys.executable, __file__, *sys.argv[1:], "--engine", engine])
            if rc:
                log(f"the {engine} engine's process failed (exit {rc})")
                return rc
        return report(args)
    from vllm import LLM

    prompts = load_prompts(args.data, args.model, args.limit)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    result: dict = {"model": str(args.model), "prompts": len(prompts), "sigmas": sigmas, "draws": args.draws,
                    "max_tokens": args.max_tokens, "top_k": TOP_K}
    for name, quant in (("bf16", None), ("nvfp4", "nvfp4")):
        if name != args.engine:
            continue
        t0 = time.time()
        llm = LLM(model=str(args.model), quantization=quant, dtype="bfloat16", seed=0, max_model_len=512,
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                  worker_extension_cls=options.WORKER_EXTENSION, additional_config=options.engine_config(aqn=True))
        vocab = llm.llm_engine.model_config.get_vocab_size()
        log(f"{name} engine up in {time.time() - t0:.0f} s (vocab {vocab})")
        llm.collective_rpc("qerl_clear_noise")
        own0 = [own_samples(llm, prompts, args.max_tokens, seed, vocab)[0] for seed in range(args.draws)]
        result[f"{name}_own_sigma0"] = {"values": own0, "mean_se": mean_se(own0)}
        log(f"{name} sigma 0 own-sample entropy {mean_se(own0)}")
        if name == "nvfp4":
            _, fixed = own_samples(llm, prompts, args.max_tokens, 1234, vocab)
            sweep = []
            for sigma in sigmas:
                own, frc = [], []
                for d in range(args.draws if sigma > 0 else 1):
                    if sigma > 0:
                        llm.collective_rpc("qerl_set_noise", args=(sigma, d, 1))
                    else:
                        llm.collective_rpc("qerl_clear_noise")
                    own.append(own_samples(llm, prompts, args.max_tokens, 100 + d, vocab)[0])
                    frc.append(forced(llm, prompts, fixed, vocab))
                row = {"sigma": sigma, "own": own, "forced": frc, "own_mean_se": mean_se(own), "forced_mean_se": mean_se(frc)}
                sweep.append(row)
                log(f"sigma {sigma:g}: own {row['own_mean_se'][0]:.4f} +- {row['own_mean_se'][1]:.4f}, "
                    f"forced {row['forced_mean_se'][0]:.5f} +- {row['forced_mean_se'][1]:.5f}")
            result["nvfp4_sweep"] = sweep
    (args.out / f"entropy_sigma_{args.engine}.json").write_text(json.dumps(result, indent=1))
    return 0


def plot(result: dict, png: Path) -> int:
    """Entropy per token against sigma (mean and standard error over the noise draws), both measures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["nvfp4_sweep"]
    xs = [r["sigma"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in (("own_mean_se", "own samples (T=1)"), ("forced_mean_se", "fixed sequences (teacher-forced)")):
        ax.errorbar(range(len(xs)), [r[key][0] for r in rows], yerr=[r[key][1] for r in rows], marker="o", capsize=3,
                    label=label)
    for name, style in (("bf16", ":"), ("nvfp4", "--")):
        m = result.get(f"{name}_own_sigma0", {}).get("mean_se")
        if m:
            ax.axhline(m[0], linestyle=style, color="gray", linewidth=1)
            ax.text(len(xs) - 1, m[0], f" {name.upper()} own, sigma 0", va="bottom", ha="right", fontsize=8, color="gray")
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
    ax.set_xlabel("AQN sigma (NVFP4 engine)")
    ax.set_ylabel("entropy, nats per token")
    ax.set_title(f"SmolLM2-135M rollout entropy vs AQN sigma ({result['prompts']} test prompts, {result['draws']} draws)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=150)
    print(f"wrote {png}")
    return 0


def report(args) -> int:
    result = {}
    for engine in ("bf16", "nvfp4"):
        result.update(json.loads((args.out / f"entropy_sigma_{engine}.json").read_text()))
    (args.out / "entropy_sigma.json").write_text(json.dumps(result, indent=1))
    print(f"\nown-sample entropy at sigma 0 (nats/token, mean +- SE over {args.draws} sampling seeds): "
          f"BF16 {result['bf16_own_sigma0']['mean_se'][0]:.4f} +- {result['bf16_own_sigma0']['mean_se'][1]:.4f}, "
          f"NVFP4 {result['nvfp4_own_sigma0']['mean_se'][0]:.4f} +- {result['nvfp4_own_sigma0']['mean_se'][1]:.4f}")
    print(f"{'sigma':>8} {'own':>16} {'forced':>20}")
    for row in result["nvfp4_sweep"]:
        o, f = row["own_mean_se"], row["forced_mean_se"]
        print(f"{row['sigma']:>8g} {o[0]:>9.4f} +- {o[1]:.4f} {f[0]:>11.5f} +- {f[1]:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
