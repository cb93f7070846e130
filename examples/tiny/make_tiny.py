"""Build the tiny run's inputs offline: a Qwen2-architecture model with random weights, a byte-level tokenizer
with a chat template, and synthetic arithmetic data in verl's row format.

    python examples/tiny/make_tiny.py /tmp/qerl_tiny           # -> /tmp/qerl_tiny/{model,data}
    python examples/tiny/make_tiny.py OUT --layers 4 --hidden 512 --overwrite

Every projection dimension is a multiple of 128, so vLLM's NVFP4 Marlin kernel and LoRA kernels take it.
Nothing is downloaded; nothing existing is overwritten without --overwrite.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer():
    """A byte-level BPE tokenizer without merges: 256 byte tokens + 3 specials, encodes any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(out: Path, layers: int = 2, hidden: int = 256, intermediate: int = 512, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    tok = byte_level_tokenizer()
    # Exactly the tokenizer's 259 ids. A padded vocabulary (e.g. 320) is harmless for trained models, whose
    # padding rows get ~0 probability, but a random model spreads mass over them; vLLM samples only ids the
    # tokenizer knows while the actor's softmax covers the whole lm_head, so rollout and actor log-probs
    # would differ by ln(320/259) = 0.21 per token at sigma 0 (seen on the H100, 2026-11-22).
    vocab = len(tok)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output folder (gets model/ and data/)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--n-test", type=int, default=64)
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)

    model_dir, data_dir = args.out / "model", args.out / "data"
    for d in (model_dir, data_dir):
        if d.exists() and any(d.iterdir()):
            if not args.overwrite:
                print(f"{d} exists; keeping it (pass --overwrite to rebuild)")
                continue
            shutil.rmtree(d)
        if d is model_dir:
            build_model(d, args.layers, args.hidden, args.intermediate, seed=args.seed)
        else:
            from verl_ext.data import make_synthetic_arithmetic

            make_synthetic_arithmetic(d, n_train=args.n_train, n_test=args.n_test, seed=args.seed, difficulty=args.difficulty)
    print(json.dumps({"model": str(model_dir), "data": str(data_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
