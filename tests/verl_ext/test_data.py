"""verl_ext.data and scripts/data: verl RL rows from local GSM8K and from the synthetic generator, checked
with verl's own RLHFDataset / collate_fn and scored with our reward and verl's built-in GSM8K scorer."""

from __future__ import annotations

import ast
import json
import operator
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_ext import data
from verl_ext.reward import compute_score
from helpers import chat_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "data"

# GSM8K-format records (HF openai/gsm8k columns); the first is GSM8K's well-known first train example.
GSM8K_TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A factory makes 250 bolts an hour for 4 hours. How many bolts does it make?",
        "answer": "250 * 4 = <<250*4=1000>>1000\n#### 1,000",
    },
    {
        "question": "The temperature was 3 degrees and fell by 8 degrees. What is it now?",
        "answer": "3 - 8 = <<3-8=-5>>-5\n#### -5",
    },
    {
        "question": "Five friends share 12.5 liters of juice equally. How many liters does each get?",
        "answer": "12.5 / 5 = <<12.5/5=2.5>>2.5\n#### 2.5",
    },
]
GSM8K_TEST = [
    {"question": "Tim has 3 boxes of 6 eggs. How many eggs?", "answer": "3*6 = <<3*6=18>>18\n#### 18"},
    {"question": "Ann reads 20 pages a day for 7 days. How many pages?", "answer": "20*7=<<20*7=140>>140\n#### 140"},
]


def _write_parquet(records, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _write_jsonl(records, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _hf_layout(root: Path) -> Path:
    """openai/gsm8k snapshot layout: main/{train,test}-00000-of-00001.parquet."""
    _write_parquet(GSM8K_TRAIN, root / "main" / "train-00000-of-00001.parquet")
    _write_parquet(GSM8K_TEST, root / "main" / "test-00000-of-00001.parquet")
    return root


def _rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


# ----------------------------------------------------------------------------------------------------
# GSM8K


def test_gsm8k_rows_have_verls_format(tmp_path):
    out = data.prepare_gsm8k(_hf_layout(tmp_path / "gsm8k"), tmp_path / "out")
    assert (out["n_train"], out["n_test"]) == (4, 2)
    train, test = _rows(out["train"]), _rows(out["test"])
    first = train[0]
    # Exactly the row verl's examples/data_preprocess/gsm8k.py writes.
    assert first == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": GSM8K_TRAIN[0]["question"]
                + " Let's think step by step and output the final answer after \"####\".",
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": GSM8K_TRAIN[0]["answer"],
                       "question": GSM8K_TRAIN[0]["question"]},
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == ["72", "1000", "-5", "2.5"]
    assert [r["extra_info"]["index"] for r in train] == [0, 1, 2, 3]
    assert {r["extra_info"]["split"] for r in test} == {"test"}
    assert [r["reward_model"]["ground_truth"] for r in test] == ["18", "140"]


def test_gsm8k_ground_truth_matches_verls_own_extraction(tmp_path):
    """Same ground truth as verl's GSM8K preprocessing rule ('#### (-?[0-9.,]+)', commas removed)."""
    ref = re.compile("#### (\\-?[0-9\\.\\,]+)")
    for rec in GSM8K_TRAIN + GSM8K_TEST:
        expected = ref.search(rec["answer"]).group(0).split("#### ")[1].replace(",", "")
        assert data.extract_gsm8k_answer(rec["answer"]) == expected


def test_gsm8k_from_jsonl_folder_single_file_and_test_src(tmp_path):
    folder = tmp_path / "jsonl"
    _write_jsonl(GSM8K_TRAIN, folder / "train.jsonl")
    _write_jsonl(GSM8K_TEST, folder / "test.jsonl")
    out = data.prepare_gsm8k(folder, tmp_path / "a")
    assert (out["n_train"], out["n_test"]) == (4, 2)

    out = data.prepare_gsm8k(folder / "train.jsonl", tmp_path / "b", test_src=folder / "test.jsonl", max_train=2)
    assert (out["n_train"], out["n_test"]) == (2, 2)

    many = [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i}=<<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
            for i in range(40)]
    single = _write_parquet(many, tmp_path / "all.parquet")
    out = data.prepare_gsm8k(single, tmp_path / "c", test_fraction=0.25, seed=3)
    train, test = _rows(out["train"]), _rows(out["test"])
    assert (len(train), len(test)) == (30, 10)
    questions = {r["extra_info"]["question"] for r in train} | {r["extra_info"]["question"] for r in test}
    assert len(questions) == 40  # a partition: nothing lost, nothing duplicated
    again = data.prepare_gsm8k(single, tmp_path / "d", test_fraction=0.25, seed=3)
    assert _rows(again["test"]) == test  # deterministic hold-out


def test_gsm8k_bad_inputs_have_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        data.prepare_gsm8k(tmp_path / "missing.parquet", tmp_path / "out")
    bad_cols = _write_parquet([{"problem": "1+1?", "solution": "2"}], tmp_path / "bad" / "train.parquet")
    with pytest.raises(data.DataError, match=r"lacks column\(s\) \['question', 'answer'\].*'problem', 'solution'"):
        data.prepare_gsm8k(bad_cols, tmp_path / "out")
    no_hash = _write_jsonl([{"question": "1+1?", "answer": "It is 2."}] * 3, tmp_path / "nohash.jsonl")
    with pytest.raises(data.DataError, match="row 0.*no final '#### <number>'"):
        data.prepare_gsm8k(no_hash, tmp_path / "out", test_fraction=0.5)
    csv = tmp_path / "train.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(data.DataError, match="unsupported file type '.csv'"):
        data.prepare_gsm8k(csv, tmp_path / "out")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(data.DataError, match="not a readable parquet"):
        data.prepare_gsm8k(broken, tmp_path / "out")
    only_train = tmp_path / "only_train"
    _write_parquet(GSM8K_TRAIN, only_train / "train.parquet")
    with pytest.raises(data.DataError, match="no test file"):
        data.prepare_gsm8k(only_train, tmp_path / "out")
    both = _hf_layout(tmp_path / "both")
    _write_parquet(GSM8K_TRAIN, both / "socratic" / "train-00000-of-00001.parquet")
    with pytest.raises(data.DataError, match="several folders.*pass the folder you mean"):
        data.prepare_gsm8k(both, tmp_path / "out")
    assert data.prepare_gsm8k(both / "main", tmp_path / "out")["n_train"] == 4
    assert not (tmp_path / "out2").exists()


def test_existing_outputs_are_not_overwritten(tmp_path):
    src = _hf_layout(tmp_path / "gsm8k")
    out = data.prepare_gsm8k(src, tmp_path / "out")
    before = Path(out["train"]).read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        data.prepare_gsm8k(src, tmp_path / "out", max_train=1)
    assert Path(out["train"]).read_bytes() == before
    assert data.prepare_gsm8k(src, tmp_path / "out", max_train=1, overwrite=True)["n_train"] == 1


def test_gsm8k_rows_score_with_our_reward_and_verls_builtin(tmp_path):
    from verl.utils.reward_score import default_compute_score

    out = data.prepare_gsm8k(_hf_layout(tmp_path / "gsm8k"), tmp_path / "out")
    for row in _rows(out["train"]) + _rows(out["test"]):
        gt = row["reward_model"]["ground_truth"]
        src = row["data_source"]
        answer = f"Let me work it out step by step.\n#### {gt}"
        assert compute_score(src, answer, gt, row["extra_info"])["score"] == 1.0
        assert compute_score(src, f"So the total is \\boxed{{{gt}}}.", gt)["score"] == 1.0
        assert compute_score(src, f"#### {float(gt) + 1:g}", gt)["score"] == 0.0
        assert default_compute_score(src, answer, gt) == 1.0  # verl's own scorer accepts the same rows


# ----------------------------------------------------------------------------------------------------
# Synthetic arithmetic

_WORD_NUMBERS = {"twice": 2, "three times": 3}


def _read_question(question: str) -> int:
    """Independent reading of a synthetic question: what the English says, step by step."""
    sentences = [s.strip() for s in re.split(r"(?<=[.?])\s+", question) if s.strip()]
    assert sentences[-1].startswith("How many ") and sentences[-1].endswith(" have now?")
    value = int(re.fullmatch(r"\w+ has (\d+) [\w ]+\.", sentences[0]).group(1))
    for s in sentences[1:-1]:
        if m := re.search(r"buys (\d+) bags of [\w ]+ with (\d+) [\w ]+ in each bag\.$", s):
            value += int(m.group(1)) * int(m.group(2))
        elif m := re.search(r"(?:buys|finds) (\d+) more ", s) or re.search(r"gives (?:him|her) (\d+) ", s):
            value += int(m.group(1))
        elif m := re.search(r"(?:gives|loses|sells) (\d+) ", s):
            value -= int(m.group(1))
        elif m := re.search(r"has (twice|three times) as many as before\.$", s):
            value *= _WORD_NUMBERS[m.group(1)]
        elif m := re.search(r"into (\d+) equal piles and keeps one pile\.$", s):
            k = int(m.group(1))
            assert value % k == 0, f"unequal split in {question!r}"
            value //= k
        else:
            raise AssertionError(f"unreadable sentence {s!r}")
        assert value >= 0, f"negative count in {question!r}"
    return value


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _eval_int(expr: str) -> int:
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv):
                assert left % right == 0, expr
            return _OPS[type(node.op)](left, right)
        raise AssertionError(f"unexpected node in {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


@pytest.mark.parametrize("difficulty,steps", [(1, {1}), (2, {2}), (3, {3, 4}), ("hard", {3, 4})])
def test_synthetic_answers_are_exact(difficulty, steps):
    rows = data.synthetic_rows(300, seed=11, difficulty=difficulty)
    data.validate_rows(rows)
    for row in rows:
        info = row["extra_info"]
        truth = int(row["reward_model"]["ground_truth"])
        assert _read_question(info["question"]) == truth  # what the question says
        assert _eval_int(info["expression"]) == truth  # the stored computation
        assert info["answer"].endswith(f"#### {truth}") and info["steps"] in steps
        assert 0 <= truth <= data.MAX_ANSWER
        assert row["prompt"][0]["content"] == info["question"] + " " + data.GSM8K_INSTRUCTION
    assert len({r["extra_info"]["question"] for r in rows}) == 300


def test_synthetic_is_deterministic_and_seeded(tmp_path):
    a = data.synthetic_rows(50, seed=1, difficulty=2)
    assert a == data.synthetic_rows(50, seed=1, difficulty=2)
    assert a != data.synthetic_rows(50, seed=2, difficulty=2)
    assert data.synthetic_rows(20, seed=1, difficulty=2) == a[:20]  # a prefix, whatever n is
    # Same files from a fresh interpreter with another hash seed (the GPU machine runs Python 3.12).
    code = (
        "import json, sys; from verl_ext import data; "
        "print(json.dumps(data.synthetic_rows(50, seed=1, difficulty=2)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == a


def test_synthetic_train_and_test_do_not_overlap(tmp_path):
    out = data.make_synthetic_arithmetic(tmp_path, n_train=400, n_test=100, seed=0, difficulty=1)
    train, test = _rows(out["train"]), _rows(out["test"])
    assert (len(train), len(test)) == (400, 100)
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    assert [r["extra_info"]["index"] for r in test] == list(range(100))
    assert {r["data_source"] for r in train + test} == {"qerl/synthetic_arithmetic"}


def test_synthetic_instruction_follows_each_question(tmp_path):
    out = data.make_synthetic_arithmetic(tmp_path, n_train=20, n_test=5, difficulty=1, instruction="Reply with only the final number.")
    default = data.synthetic_rows(20, difficulty=1)
    for row, ref in zip(_rows(out["train"]), default):
        question = ref["extra_info"]["question"]
        assert row["extra_info"]["question"] == question
        assert row["prompt"][0]["content"] == question + " Reply with only the final number."
        assert ref["prompt"][0]["content"] == question + " " + data.GSM8K_INSTRUCTION


def test_synthetic_bad_arguments(tmp_path):
    with pytest.raises(data.DataError, match="difficulty must be 1, 2, 3"):
        data.synthetic_rows(5, difficulty=4)
    with pytest.raises(data.DataError, match="integer >= 1"):
        data.synthetic_rows(0)
    with pytest.raises(data.DataError, match="split must be one of"):
        data.synthetic_rows(5, split="validation")


def test_synthetic_rows_score_as_a_model_would_answer():
    rng = random.Random(0)
    for row in data.synthetic_rows(100, seed=5, difficulty=3):
        gt = row["reward_model"]["ground_truth"]
        src = row["data_source"]
        worked = row["extra_info"]["answer"]  # "a + b = c ... #### N", as the instruction asks
        assert compute_score(src, worked, gt)["score"] == 1.0
        style = rng.choice([f"The answer is {gt}.", f"\\boxed{{{gt}}}", f"so {int(gt):,} in total"])
        assert compute_score(src, style, gt)["score"] == 1.0, style
        assert compute_score(src, f"#### {int(gt) + 1}", gt)["score"] == 0.0


# ----------------------------------------------------------------------------------------------------
# verl's own dataset class reads the files


def test_verl_rlhf_dataset_reads_our_files(tmp_path):
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    gsm = data.prepare_gsm8k(_hf_layout(tmp_path / "gsm8k"), tmp_path / "gsm8k_rl")
    syn = data.make_synthetic_arithmetic(tmp_path / "syn", n_train=12, n_test=4, seed=0, difficulty=2)
    tokenizer = chat_tokenizer()
    config = OmegaConf.create(
        {"max_prompt_length": 1024, "filter_overlong_prompts": True, "filter_overlong_prompts_workers": 1,
         "cache_dir": str(tmp_path / "cache"), "prompt_key": "prompt"}
    )
    ds = RLHFDataset([gsm["train"], syn["train"]], tokenizer, config)
    assert len(ds) == 4 + 12
    item = ds[0]
    content = GSM8K_TRAIN[0]["question"] + " " + data.GSM8K_INSTRUCTION
    assert item["raw_prompt"] == [{"role": "user", "content": content}]
    assert item["data_source"] == "openai/gsm8k"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert item["index"] == 0 and item["extra_info"]["split"] == "train"
    last = ds[len(ds) - 1]
    assert last["data_source"] == "qerl/synthetic_arithmetic" and last["index"] == 11

    batch = next(iter(DataLoader(ds, batch_size=8, collate_fn=collate_fn)))
    assert batch["dummy_tensor"].shape == (8, 1)
    assert batch["reward_model"][1]["ground_truth"] == "1000"
    assert list(batch["data_source"][:4]) == ["openai/gsm8k"] * 4

    # Its prompt-length filter tokenizes our chat prompts with the chat template.
    lengths = sorted(_n_prompt_tokens(tokenizer, r["prompt"]) for r in _rows(syn["test"]))
    limit = lengths[1]
    short = RLHFDataset(syn["test"], tokenizer, OmegaConf.merge(config, {"max_prompt_length": limit}))
    assert len(short) == sum(n <= limit for n in lengths)
    assert 2 <= len(short) < 4 or lengths[1] == lengths[-1]


def _n_prompt_tokens(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_validate_rows_rejects_what_verl_cannot_read():
    good = data.make_row("1+1?", "2", data_source="x", split="train", index=0)
    data.validate_rows([good])
    for broken, match in [
        ({k: v for k, v in good.items() if k != "reward_model"}, "missing columns"),
        ({**good, "prompt": "1+1?"}, "prompt must be a non-empty list"),
        ({**good, "prompt": [{"role": "user", "text": "1+1?"}]}, "'role', 'content'"),
        ({**good, "reward_model": {"style": "rule", "ground_truth": 2}}, "reward_model must be"),
        ({**good, "extra_info": {"split": "val", "index": 0}}, "extra_info must hold split"),
    ]:
        with pytest.raises(data.DataError, match=match):
            data.validate_rows([broken])


# ----------------------------------------------------------------------------------------------------
# The scripts


def _script(name, *args):
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_scripts_run_and_report(tmp_path):
    res = _script("make_synthetic_arithmetic.py", tmp_path / "syn", "--n-train", 30, "--n-test", 5, "--seed", 7,
                  "--difficulty", "easy")
    assert res.returncode == 0, res.stderr
    assert "train: 30 rows" in res.stdout and "test:  5 rows" in res.stdout
    assert _rows(tmp_path / "syn" / "train.parquet") == data.synthetic_rows(30, seed=7, difficulty=1)
    res = _script("make_synthetic_arithmetic.py", tmp_path / "syn")
    assert res.returncode == 2 and "--overwrite" in res.stderr
    res = _script("make_synthetic_arithmetic.py", tmp_path / "syn2", "--n-train", 3, "--n-test", 1, "--instruction", "Just the number.")
    assert res.returncode == 0, res.stderr
    assert all(r["prompt"][0]["content"].endswith("? Just the number.") for r in _rows(tmp_path / "syn2" / "train.parquet"))

    src = _hf_layout(tmp_path / "gsm8k")
    res = _script("prepare_gsm8k.py", src, tmp_path / "rl")
    assert res.returncode == 0, res.stderr
    assert "train: 4 rows" in res.stdout and "test:  2 rows" in res.stdout
    res = _script("prepare_gsm8k.py", tmp_path / "nope", tmp_path / "rl2")
    assert res.returncode == 2 and "no such file or folder" in res.stderr
    for name in ("prepare_gsm8k.py", "make_synthetic_arithmetic.py"):
        res = _script(name, "--help")
        assert res.returncode == 0 and "usage:" in res.stdout
