"""Training data in verl's RL row format: GSM8K from a local file, and synthetic arithmetic word problems.

verl 0.9.1 (``verl.utils.dataset.rl_dataset.RLHFDataset``) reads parquet rows with these columns, the same
as verl's own ``examples/data_preprocess/gsm8k.py`` writes::

    data_source   str                       picks the reward function ("openai/gsm8k", ...)
    prompt        [{"role": "user", "content": question + " " + instruction}]   chat messages
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}
    extra_info    {"split": "train", "index": 0, "answer": <full solution>, "question": <raw question>}

Two producers, both offline (the GPU machine has no network):

* :func:`prepare_gsm8k` converts a local copy of GSM8K (``openai/gsm8k``: columns ``question`` and
  ``answer``, the answer ending in ``#### <number>``), from parquet or jsonl files, into
  ``train.parquet``/``test.parquet``. Script: ``scripts/data/prepare_gsm8k.py SRC OUT_DIR``.
* :func:`make_synthetic_arithmetic` writes deterministic multi-step word problems ("Tom has 3 apples...")
  with exact integer answers, data source ``qerl/synthetic_arithmetic``. Script:
  ``scripts/data/make_synthetic_arithmetic.py OUT_DIR --n-train 2000 --n-test 200 --seed 0 --difficulty 2``.

Both score with ``verl_ext.reward.compute_score``; ``openai/gsm8k`` rows also work with verl's built-in
GSM8K scorer. Existing output files are never overwritten unless ``overwrite=True`` (``--overwrite``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DataError",
    "GSM8K_DATA_SOURCE",
    "GSM8K_INSTRUCTION",
    "SYNTHETIC_DATA_SOURCE",
    "Problem",
    "extract_gsm8k_answer",
    "find_gsm8k_files",
    "gsm8k_rows",
    "make_row",
    "make_synthetic_arithmetic",
    "prepare_gsm8k",
    "read_records",
    "synthetic_problem",
    "synthetic_rows",
    "validate_rows",
    "write_parquet",
]

GSM8K_DATA_SOURCE = "openai/gsm8k"
SYNTHETIC_DATA_SOURCE = "qerl/synthetic_arithmetic"
# The instruction verl's examples/data_preprocess/gsm8k.py appends to every question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ROW_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
SPLITS = ("train", "test")
_SUFFIXES = (".parquet", ".jsonl", ".json")


class DataError(ValueError):
    """Bad input data: the message names the file/row and what to do."""


# ----------------------------------------------------------------------------------------------------
# Rows


def make_row(
    question: str,
    ground_truth: str,
    *,
    data_source: str,
    split: str,
    index: int,
    instruction: str = GSM8K_INSTRUCTION,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One verl RL row (see the module docstring)."""
    content = question.strip() + (" " + instruction if instruction else "")
    extra_info = {"split": split, "index": int(index)}
    extra_info.update(extra or {})
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
        "extra_info": extra_info,
    }


def validate_rows(rows: Sequence[dict[str, Any]], *, where: str = "rows") -> None:
    """Check that rows have exactly the columns and types verl's RLHFDataset and reward managers read."""
    if not rows:
        raise DataError(f"{where}: no rows")
    for i, row in enumerate(rows):
        at = f"{where}[{i}]"
        missing = [c for c in ROW_COLUMNS if c not in row]
        if missing:
            raise DataError(f"{at}: missing columns {missing}; a verl RL row needs {list(ROW_COLUMNS)}")
        if not isinstance(row["data_source"], str) or not row["data_source"]:
            raise DataError(f"{at}: data_source must be a non-empty string, got {row['data_source']!r}")
        prompt = row["prompt"]
        if not isinstance(prompt, list) or not prompt:
            raise DataError(f"{at}: prompt must be a non-empty list of chat messages, got {type(prompt).__name__}")
        for msg in prompt:
            if not isinstance(msg, dict) or set(msg) != {"role", "content"}:
                raise DataError(f"{at}: each prompt message must be {{'role', 'content'}}, got {msg!r}")
            if msg["role"] not in ("system", "user", "assistant") or not isinstance(msg["content"], str):
                raise DataError(f"{at}: bad prompt message {msg!r}")
        reward = row["reward_model"]
        is_rule = isinstance(reward, dict) and reward.get("style") == "rule"
        if not (is_rule and isinstance(reward.get("ground_truth"), str)):
            raise DataError(f"{at}: reward_model must be {{'style': 'rule', 'ground_truth': str}}, got {reward!r}")
        if not reward["ground_truth"].strip():
            raise DataError(f"{at}: empty ground_truth")
        info = row["extra_info"]
        if not isinstance(info, dict) or info.get("split") not in SPLITS or not isinstance(info.get("index"), int):
            raise DataError(f"{at}: extra_info must hold split ('train'/'test') and an int index, got {info!r}")


def write_parquet(rows: Sequence[dict[str, Any]], path: str | Path, *, overwrite: bool = False) -> Path:
    """Validate ``rows`` and write them as one parquet file (refuses to replace a file unless ``overwrite``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    validate_rows(rows, where=str(path))
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --overwrite (overwrite=True) to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------------------------------
# GSM8K


_GSM8K_ANSWER_RE = re.compile(r"####\s*(-?[0-9][0-9.,]*)")


def extract_gsm8k_answer(answer: str, *, where: str = "answer") -> str:
    """The number after ``####`` in a GSM8K solution, without thousands separators (``"1,000"`` -> ``"1000"``)."""
    if not isinstance(answer, str):
        raise DataError(f"{where}: the answer must be a string, got {type(answer).__name__}")
    found = _GSM8K_ANSWER_RE.findall(answer)
    if not found:
        raise DataError(f"{where}: no final '#### <number>' in {answer[-80:]!r}; is this the GSM8K 'answer' column?")
    return found[-1].replace(",", "").rstrip(".")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.parquet``, ``.jsonl`` or ``.json`` (lines or one list) file as dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file; give the local GSM8K file (parquet or jsonl) or its folder")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        stripped = text.lstrip()
        try:
            if suffix == ".json" and stripped.startswith("["):
                records = json.loads(stripped)
            else:
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON lines ({exc})") from exc
        if not all(isinstance(r, dict) for r in records):
            raise DataError(f"{path}: every JSON record must be an object with 'question' and 'answer'")
        return records
    raise DataError(f"{path}: unsupported file type {suffix!r}; use .parquet, .jsonl or .json")


def gsm8k_rows(
    records: Iterable[dict[str, Any]],
    split: str,
    *,
    source: str = "records",
    data_source: str = GSM8K_DATA_SOURCE,
    instruction: str = GSM8K_INSTRUCTION,
) -> list[dict[str, Any]]:
    """GSM8K records (``question``, ``answer`` with ``#### N``) -> verl rows, indexed in order."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {SPLITS}, got {split!r}")
    rows = []
    for index, record in enumerate(records):
        _check_columns(record, index, source)
        question, answer = record["question"], record["answer"]
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{source}: row {index} has an empty or non-string question")
        truth = extract_gsm8k_answer(answer, where=f"{source}: row {index}")
        rows.append(
            make_row(
                question,
                truth,
                data_source=data_source,
                split=split,
                index=index,
                instruction=instruction,
                extra={"answer": answer, "question": question},
            )
        )
    return rows


def _check_columns(record: dict[str, Any], index: int, source: str) -> None:
    missing = [c for c in ("question", "answer") if c not in record]
    if missing:
        raise DataError(
            f"{source}: row {index} lacks column(s) {missing} (has {sorted(record)}); GSM8K files "
            "(HF openai/gsm8k) have 'question' and 'answer'"
        )


def _split_of(path: Path) -> str | None:
    stem = path.name.lower()
    for split in SPLITS:
        if stem.startswith(split) and (len(stem) == len(split) or not stem[len(split)].isalpha()):
            return split
    return None


def find_gsm8k_files(folder: str | Path) -> dict[str, list[Path]]:
    """Train/test files under ``folder`` (HF layout ``main/train-00000-of-00001.parquet`` or
    ``train.jsonl``/``test.jsonl``); shards of one split must sit in one folder."""
    folder = Path(folder)
    found: dict[str, list[Path]] = {s: [] for s in SPLITS}
    for path in sorted(folder.rglob("*")):
        hidden = any(p.startswith(".") for p in path.parts[len(folder.parts) :])
        if path.is_file() and path.suffix.lower() in _SUFFIXES and not hidden:
            split = _split_of(path)
            if split is not None:
                found[split].append(path)
    for split, paths in found.items():
        parents = sorted({str(p.parent) for p in paths})
        if len(parents) > 1:
            raise DataError(
                f"{folder}: {split} files in several folders {parents} (e.g. GSM8K's 'main' and 'socratic'); "
                "pass the folder you mean, e.g. SRC/main"
            )
        suffixes = {p.suffix.lower() for p in paths}
        if len(suffixes) > 1:
            raise DataError(f"{folder}: {split} files in several formats {sorted(suffixes)}; keep one")
    if not found["train"]:
        raise DataError(f"{folder}: no train file (train*.parquet / train*.jsonl) found")
    return found


def prepare_gsm8k(
    src: str | Path,
    out_dir: str | Path,
    *,
    test_src: str | Path | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
    max_train: int | None = None,
    max_test: int | None = None,
    instruction: str = GSM8K_INSTRUCTION,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert local GSM8K into ``out_dir/train.parquet`` and ``out_dir/test.parquet``.

    ``src`` is a folder holding train and test files, or one file. With one file the test rows come from
    ``test_src`` if given, else a ``test_fraction`` hold-out drawn with ``seed``. ``max_train``/``max_test``
    keep the first N rows of each split. Returns paths and row counts."""
    src = Path(src)
    out_dir = Path(out_dir)
    if not src.exists():
        raise FileNotFoundError(
            f"{src}: no such file or folder; give the local GSM8K file (parquet or jsonl) or its folder"
        )
    records: dict[str, list[dict[str, Any]]] = {}
    sources: dict[str, str] = {}
    if src.is_dir():
        if test_src is not None:
            raise DataError("--test-src goes with a single SRC file; SRC is a folder that must hold both splits")
        files = find_gsm8k_files(src)
        for split, paths in files.items():
            records[split] = [r for p in paths for r in read_records(p)]
            sources[split] = ", ".join(str(p) for p in paths)
        if not records["test"]:
            raise DataError(f"{src}: no test file (test*.parquet / test*.jsonl) found next to the train file")
    else:
        records["train"] = read_records(src)
        sources["train"] = str(src)
        for index, record in enumerate(records["train"]):
            _check_columns(record, index, str(src))
        if test_src is not None:
            records["test"] = read_records(test_src)
            sources["test"] = str(test_src)
        else:
            if not 0.0 < test_fraction < 1.0:
                raise DataError(
                    f"test_fraction must be in (0, 1) when SRC is one file without --test-src, got {test_fraction}"
                )
            if len(records["train"]) < 2:
                raise DataError(f"{src}: {len(records['train'])} row(s); a train/test hold-out needs at least 2")
            order = list(range(len(records["train"])))
            random.Random(seed).shuffle(order)
            n_test = max(1, round(len(order) * test_fraction))
            held = set(order[:n_test])
            all_records = records["train"]
            records["test"] = [r for i, r in enumerate(all_records) if i in held]
            records["train"] = [r for i, r in enumerate(all_records) if i not in held]
            sources["test"] = f"{src} (hold-out {test_fraction:g}, seed {seed})"
    limits = {"train": max_train, "test": max_test}
    targets = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    if not overwrite:
        existing = [str(p) for p in targets.values() if p.exists()]
        if existing:
            raise FileExistsError(f"{existing} exist; pass --overwrite to replace them")
    rows = {}
    for split in SPLITS:
        split_records = records[split]
        if limits[split] is not None:
            if limits[split] < 1:
                raise DataError(f"max_{split} must be >= 1, got {limits[split]}")
            split_records = split_records[: limits[split]]
        rows[split] = gsm8k_rows(split_records, split, source=sources[split], instruction=instruction)
        if not rows[split]:
            raise DataError(f"{sources[split]}: no rows for the {split} split")
    for split in SPLITS:
        write_parquet(rows[split], targets[split], overwrite=overwrite)
    return {
        "train": str(targets["train"]),
        "test": str(targets["test"]),
        "n_train": len(rows["train"]),
        "n_test": len(rows["test"]),
        "sources": sources,
    }


# ----------------------------------------------------------------------------------------------------
# Synthetic arithmetic word problems


@dataclass(frozen=True)
class Problem:
    """A word problem: ``expression`` is the same computation as Python integer arithmetic."""

    question: str
    answer: int
    solution: str
    expression: str
    steps: int


_NAMES = (
    ("Tom", "he", "him", "his"), ("Mia", "she", "her", "her"), ("Liam", "he", "him", "his"),
    ("Ava", "she", "her", "her"), ("Noah", "he", "him", "his"), ("Emma", "she", "her", "her"),
    ("Lucas", "he", "him", "his"), ("Sofia", "she", "her", "her"), ("Omar", "he", "him", "his"),
    ("Yuki", "she", "her", "her"), ("Ravi", "he", "him", "his"), ("Lena", "she", "her", "her"),
    ("Diego", "he", "him", "his"), ("Chloe", "she", "her", "her"), ("Kofi", "he", "him", "his"),
    ("Ines", "she", "her", "her"),
)
_FRIENDS = ("Sam", "Alex", "Jordan", "Priya", "Ben", "Zoe", "Max", "Nina", "Leo", "Maya")
_ITEMS = (
    "apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards",
    "stamps", "coins", "oranges", "crayons", "balloons", "toy cars", "buttons", "beads",
)
# difficulty -> (number of operations after the start, largest number, allowed operations)
_LEVELS = {
    1: ((1, 1), 20, ("add", "sub")),
    2: ((2, 2), 50, ("add", "sub", "groups", "mul")),
    3: ((3, 4), 100, ("add", "sub", "groups", "mul", "share")),
}
_LEVEL_NAMES = {"easy": 1, "medium": 2, "hard": 3}
MAX_ANSWER = 1_000_000


def _noun(n: int, items: str) -> str:
    return items if n != 1 else items[:-1]  # all _ITEMS are plurals in -s


def _count(n: int, items: str) -> str:
    return f"{n} {_noun(n, items)}"


def _difficulty(difficulty: int | str) -> int:
    if isinstance(difficulty, str):
        key = difficulty.strip().lower()
        if key in _LEVEL_NAMES:
            return _LEVEL_NAMES[key]
        if key.isdigit():
            difficulty = int(key)
    if isinstance(difficulty, bool) or difficulty not in _LEVELS:
        raise DataError(f"difficulty must be 1, 2, 3 (or easy, medium, hard), got {difficulty!r}")
    return int(difficulty)


def synthetic_problem(rng: random.Random, difficulty: int | str = 2) -> Problem:
    """One multi-step word problem with an exact non-negative integer answer."""
    level = _difficulty(difficulty)
    (lo_ops, hi_ops), top, kinds = _LEVELS[level]
    name, he, him, his = rng.choice(_NAMES)
    He = he.capitalize()
    friend = rng.choice(_FRIENDS)
    items = rng.choice(_ITEMS)
    value = rng.randint(2, top)
    sentences = [f"{name} has {value} {items}."]
    lines = []
    expression = str(value)
    n_ops = rng.randint(lo_ops, hi_ops)
    for step in range(n_ops):
        options = [k for k in kinds if k != "sub" or value >= 2]
        if "share" in options and not any(value % k == 0 for k in (2, 3, 4, 5)):
            options.remove("share")
        if "mul" in options and value * 3 > MAX_ANSWER:
            options.remove("mul")
        kind = rng.choice(options)
        then = "Then " if step else ""
        subject = He if not then else he
        if kind == "add":
            b = rng.randint(1, top)
            sentences.append(
                rng.choice(
                    (
                        f"{then}{subject} buys {b} more {_noun(b, items)}.",
                        f"{then}{friend} gives {him} {_count(b, items)}.",
                        f"{then}{subject} finds {b} more {_noun(b, items)}.",
                    )
                )
            )
            new, line, expression = value + b, f"{value} + {b} = {value + b}", f"({expression} + {b})"
        elif kind == "sub":
            b = rng.randint(1, min(value - 1, top))
            sentences.append(
                rng.choice(
                    (
                        f"{then}{subject} gives {_count(b, items)} to {friend}.",
                        f"{then}{subject} loses {_count(b, items)}.",
                        f"{then}{subject} sells {_count(b, items)} at the market.",
                    )
                )
            )
            new, line, expression = value - b, f"{value} - {b} = {value - b}", f"({expression} - {b})"
        elif kind == "groups":
            k, m = rng.randint(2, 6), rng.randint(2, max(2, top // 5))
            sentences.append(f"{then}{subject} buys {k} bags of {items} with {m} {items} in each bag.")
            new = value + k * m
            line = f"{k} * {m} = {k * m}, {value} + {k * m} = {new}"
            expression = f"({expression} + {k} * {m})"
        elif kind == "mul":
            k = rng.choice((2, 3))
            word = {2: "twice", 3: "three times"}[k]
            sentences.append(f"{then}{subject} gets more {items} until {he} has {word} as many as before.")
            new, line, expression = value * k, f"{value} * {k} = {value * k}", f"({expression} * {k})"
        else:  # share: split equally and keep one part
            k = rng.choice([d for d in (2, 3, 4, 5) if value % d == 0])
            sentences.append(f"{then}{subject} splits {his} {items} into {k} equal piles and keeps one pile.")
            new, line, expression = value // k, f"{value} / {k} = {value // k}", f"({expression} // {k})"
        lines.append(line)
        value = new
    sentences.append(f"How many {items} does {name} have now?")
    solution = "\n".join(lines) + f"\n#### {value}"
    return Problem(" ".join(sentences), value, solution, expression, n_ops)


def synthetic_rows(
    n: int,
    *,
    seed: int = 0,
    difficulty: int | str = 2,
    split: str = "train",
    exclude: Iterable[str] = (),
    instruction: str = GSM8K_INSTRUCTION,
) -> list[dict[str, Any]]:
    """``n`` distinct problems as verl rows; same (n, seed, difficulty, split) -> same rows on any machine.
    Questions in ``exclude`` (e.g. the train questions when making test) are skipped."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DataError(f"the number of problems must be an integer >= 1, got {n!r}")
    if split not in SPLITS:
        raise DataError(f"split must be one of {SPLITS}, got {split!r}")
    level = _difficulty(difficulty)
    rng = random.Random(f"qerl-synthetic-arithmetic/{seed}/{level}/{split}")  # str seeds hash the same everywhere
    seen = set(exclude)
    rows: list[dict[str, Any]] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise DataError(f"could not make {n} distinct difficulty-{level} problems; ask for fewer")
        problem = synthetic_problem(rng, level)
        if problem.question in seen:
            continue
        seen.add(problem.question)
        rows.append(
            make_row(
                problem.question,
                str(problem.answer),
                data_source=SYNTHETIC_DATA_SOURCE,
                split=split,
                index=len(rows),
                instruction=instruction,
                extra={
                    "answer": problem.solution,
                    "question": problem.question,
                    "expression": problem.expression,
                    "difficulty": level,
                    "steps": problem.steps,
                },
            )
        )
    return rows


def make_synthetic_arithmetic(
    out_dir: str | Path,
    *,
    n_train: int = 2000,
    n_test: int = 200,
    seed: int = 0,
    difficulty: int | str = 2,
    overwrite: bool = False,
    instruction: str = GSM8K_INSTRUCTION,
) -> dict[str, Any]:
    """Write ``out_dir/train.parquet`` and ``out_dir/test.parquet`` of synthetic problems (test questions
    never repeat train questions); ``instruction`` follows each question in the prompt."""
    out_dir = Path(out_dir)
    targets = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    if not overwrite:
        existing = [str(p) for p in targets.values() if p.exists()]
        if existing:
            raise FileExistsError(f"{existing} exist; pass --overwrite to replace them")
    train = synthetic_rows(n_train, seed=seed, difficulty=difficulty, split="train", instruction=instruction)
    test = synthetic_rows(
        n_test, seed=seed, difficulty=difficulty, split="test", instruction=instruction,
        exclude=(r["extra_info"]["question"] for r in train),
    )
    write_parquet(train, targets["train"], overwrite=overwrite)
    write_parquet(test, targets["test"], overwrite=overwrite)
    return {"train": str(targets["train"]), "test": str(targets["test"]), "n_train": len(train), "n_test": len(test)}
