"""``python -m vllm_ext.bench``: the bench CLI, or ``_child SPEC RESULT`` (one engine, started by the runner)."""

from __future__ import annotations

import argparse
import sys

import vllm_ext.bench as bench


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "_child":
        from vllm_ext.bench import child

        return child.main(argv[1], argv[2])
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.bench", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
