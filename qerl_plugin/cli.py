"""The ``qerl`` command.

Each subcommand lives in its own module, listed in :data:`SUBCOMMANDS`; a module exposes
``add_arguments(parser)`` and ``run(args) -> int`` (and optionally ``HELP``, a one-line summary).
Only the module of the chosen subcommand is imported, so ``qerl --help`` stays fast and a subcommand
whose module is missing or broken fails alone, with a message saying so.

Errors raised by a subcommand are printed as one line (``qerl quantize: error: ...``) and give exit
status 1; ``--debug`` shows the traceback instead. Usage errors give 2, Ctrl-C 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import Sequence

# name -> (module, one-line help, what the module needs)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "quantize": ("qerl_plugin.quantize_cli", "quantize a Hugging Face checkpoint to NVFP4A16 (runs on CPU)", "torch, safetensors, compressed-tensors, huggingface-hub, tqdm"),
    "doctor": ("qerl_plugin.doctor", "report what this environment has and lacks for each job", "nothing beyond qerl-plugin"),
    "bench": ("vllm_ext.bench", "benchmark NVFP4 + LoRA rollouts in vLLM", "vLLM and a CUDA GPU"),
    "train": ("verl_ext.train", "run QeRL training (verl GRPO/DAPO with NVFP4 + LoRA + AQN)", "verl, vLLM and a CUDA GPU"),
    "export": ("verl_ext.export", "turn a verl FSDP checkpoint of the NVFP4 + LoRA actor into a PEFT adapter directory", "verl, peft"),
    "eval": ("qerl_plugin.evaluate", "greedy pass@1 and sampled pass@k of a model (+ LoRA adapter) with the project's reward", "transformers (CPU) or vLLM and a CUDA GPU"),
    "plot": ("qerl_plugin.plot", "plot reward, accuracy, entropy, AQN sigma, KL and step time from verl metrics.jsonl files", "matplotlib"),
}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("qerl-plugin")
    except Exception:
        from qerl_plugin import __version__

        return __version__


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first token that is one), if any."""
    for token in argv:
        if token == "--":
            return None
        if token in SUBCOMMANDS:
            return token
        if not token.startswith("-"):
            return None
    return None


class _Unavailable:
    """Stands in for a subcommand whose module cannot be imported."""

    def __init__(self, name: str, module: str, needs: str, exc: BaseException):
        self.name, self.module, self.needs = name, module, needs
        self.reason = f"{type(exc).__name__}: {exc}"
        self.exc = exc

    def message(self) -> str:
        return (
            f"qerl {self.name} is unavailable: module {self.module} could not be imported ({self.reason}). "
            f"It needs {self.needs}; run 'qerl doctor' to see what is missing"
        )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.description = self.message()

    def run(self, args: argparse.Namespace) -> int:
        if getattr(args, "debug", False):
            raise self.exc
        print(self.message(), file=sys.stderr)
        return 1


def _load(name: str):
    module_name, _, needs = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        if not (callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None))):
            raise AttributeError(f"{module_name} lacks add_arguments(parser) / run(args)")
        return module
    except Exception as exc:  # a broken subcommand must not take the others down
        return _Unavailable(name, module_name, needs, exc)


def build_parser(chosen: str | None = None) -> tuple[argparse.ArgumentParser, object | None]:
    """The full parser; only ``chosen``'s module is imported and given its arguments."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser = argparse.ArgumentParser(
        prog="qerl",
        description="QeRL for verl and vLLM: NVFP4 base model + LoRA reinforcement learning with adaptive quantization noise.",
        epilog="Run 'qerl <command> --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"qerl-plugin {_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    loaded = None
    for name, (_, help_text, _) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text, parents=[debug])
        if name == chosen:
            loaded = _load(name)
            doc = getattr(loaded, "__doc__", None) if not isinstance(loaded, _Unavailable) else None
            if doc:
                sub.description = doc.strip()
                sub.formatter_class = argparse.RawDescriptionHelpFormatter
            loaded.add_arguments(sub)
    return parser, loaded


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen(argv)
    parser, module = build_parser(chosen)
    if isinstance(module, _Unavailable):
        args, _ = parser.parse_known_args(argv)  # its real options are unknown: say why it is unavailable
    else:
        args = parser.parse_args(argv)
    if args.command is None or module is None:
        parser.print_help()
        return 2
    try:
        code = module.run(args)
    except KeyboardInterrupt:
        print(f"qerl {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        else:
            text = str(exc).strip() or type(exc).__name__
            if not isinstance(exc, (ValueError, OSError)):
                text = f"{type(exc).__name__}: {text}"
            first = text.splitlines()[0]
            print(f"qerl {args.command}: error: {first}", file=sys.stderr)
            if not isinstance(exc, ValueError):
                print("(run with --debug for the traceback)", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
