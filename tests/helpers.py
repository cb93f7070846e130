"""Shared test helpers: tiny Hugging Face models built offline from a config, with random weights.

    from helpers import make_tiny_qwen2, file_hashes   # tests/conftest.py puts tests/ on sys.path
    src = make_tiny_qwen2(tmp_path / "tiny")            # bf16 Qwen2, 2 layers, tokenizer included
    src = make_tiny_qwen2(tmp_path / "s", max_shard_size="20KB", num_hidden_layers=3)
    model, cfg = tiny_qwen2_model(layers=1)            # in memory, bf16 values held in fp32

Every dimension is a multiple of 16 so every Linear can be stored as NVFP4.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

TINY_QWEN2 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` over the 95 printable ASCII characters plus <|endoftext|> (96 ids).

    Built offline; ``AutoTokenizer`` (and vLLM) load it back from ``save_pretrained``. Needs vocab >= 96.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    byte_char = bytes_to_unicode()
    vocab = {byte_char[b]: i for i, b in enumerate(range(32, 127))}
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def make_tiny_model(
    path: str | Path,
    config,
    model_cls,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    tokenizer: bool = True,
    init_std: float | None = None,
) -> Path:
    """Save ``model_cls(config)`` with seeded random weights (``init_std`` overrides the init scale)."""
    path = Path(path)
    torch.manual_seed(seed)
    model = model_cls(config)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, init_std)
    model = model.to(dtype)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


def make_tiny_qwen2(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """A random-weight ``Qwen2ForCausalLM`` saved with ``save_pretrained`` at ``path`` (returned).

    Defaults: hidden 64, intermediate 128, 2 layers, 4 heads / 2 kv heads, vocab 128, untied lm_head;
    ``overrides`` go to ``Qwen2Config``. ``max_shard_size`` (e.g. "20KB") splits the safetensors.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**TINY_QWEN2, **overrides})
    return make_tiny_model(
        path, cfg, Qwen2ForCausalLM, dtype=dtype, seed=seed, max_shard_size=max_shard_size, tokenizer=tokenizer
    )


def tiny_qwen2_model(layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32):
    """``(model, config)``: an in-memory random ``Qwen2ForCausalLM`` (hidden 64, intermediate 96, 4 heads / 2 kv
    heads, vocab 64, untied lm_head) whose values are those of a bf16 checkpoint, held in ``dtype``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.to(torch.bfloat16).to(dtype), cfg


# A ground truth whose comparison with a small answer runs far past any test's time limit (sympy evaluates it).
SLOW_GOLD = "10^{10^{10}}"


def file_hashes(root: str | Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> digest), to prove a tree was not touched."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of all ``*.safetensors`` files in ``path``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def chat_tokenizer():
    """Byte-level tokenizer with a chat template, built offline (exact decode of any text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    )
