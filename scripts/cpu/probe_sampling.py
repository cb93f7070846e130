#!/usr/bin/env python3
"""CPU: how much GRPO signal a model's samples carry before training, per sampling temperature and length.

For the first PROMPTS training prompts, N samples each (transformers on CPU; ``--nvfp4`` puts the NVFP4
round-trip of every Linear weight in place, as the rollout sees it), scored with the project's reward:
mean reward, prompts whose group has both right and wrong answers (the only ones with a non-zero GRPO
advantage), responses cut at the limit, mean length, and the samples right within --short tokens (what a
shorter response limit would keep). One JSON line per (temperature, max tokens).

    python scripts/cpu/probe_sampling.py /tmp/qerl_smollm2 --nvfp4 --temperatures 1.0,0.7 --max-new-tokens 64

Used for the SmolLM2 demo's temperature (docs/learning.md, 2026-11-24); 48 prompts x 8 samples take ~2 min per
setting on 2 cores at 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prepared", type=Path, help="examples/smollm2/prepare.py's OUT (bf16/, data/train.parquet)")
    p.add_argument("--nvfp4", action="store_true", help="NVFP4 round-trip of the Linear weights (the rollout's model)")
    p.add_argument("--temperatures", default="1.0,0.7", help="comma-separated sampling temperatures")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--batch-prompts", type=int, default=16)
    p.add_argument("--short", type=int, default=32, help="also count the samples that are right within this many tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from qerl_plugin.evaluate_hf import load_model
    from qerl_plugin.evaluate_inputs import inspect_model, read_examples
    from verl_ext.reward import compute_score

    torch.manual_seed(args.seed)
    info = inspect_model(args.prepared / "bf16")
    model = load_model(info, quantization="nvfp4" if args.nvfp4 else None)
    tok = AutoTokenizer.from_pretrained(args.prepared / "bf16")
    tok.padding_side = "left"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    examples = read_examples(args.prepared / "data" / "train.parquet", limit=args.prompts)
    texts = [tok.apply_chat_template(e.messages, tokenize=False, add_generation_prompt=True) for e in examples]
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        t0 = time.time()
        rows = []  # (prompt index, length, reward, cut at the limit)
        for i in range(0, len(texts), args.batch_prompts):
            batch = [t for t in texts[i:i + args.batch_prompts] for _ in range(args.n)]
            enc = tok(batch, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=temperature,
                                     top_p=1.0, eos_token_id=eos, pad_token_id=eos)
            for j, seq in enumerate(out[:, enc["input_ids"].shape[1]:].tolist()):
                ex = examples[i + j // args.n]
                length = seq.index(eos) + 1 if eos in seq else len(seq)
                text = tok.decode(seq[:length], skip_special_tokens=True)
                reward = compute_score(ex.data_source, text, ex.ground_truth)["score"]
                rows.append((i + j // args.n, length, reward, eos not in seq))
        groups: dict[int, list[float]] = {}
        for k, _, r, _ in rows:
            groups.setdefault(k, []).append(r)
        print(json.dumps({
            "model": "nvfp4" if args.nvfp4 else "bf16", "temperature": temperature, "max_new_tokens": args.max_new_tokens,
            "prompts": len(texts), "n": args.n, "reward": round(statistics.mean(r for _, _, r, _ in rows), 4),
            "mixed_groups": sum(1 for g in groups.values() if 0 < sum(g) < len(g)),
            "cut_at_limit": round(statistics.mean(c for *_, c in rows), 3),
            "mean_length": round(statistics.mean(n for _, n, _, _ in rows), 1),
            f"right_within_{args.short}": round(statistics.mean(r > 0 and n <= args.short for _, n, r, _ in rows), 4),
            "seconds": round(time.time() - t0),
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
