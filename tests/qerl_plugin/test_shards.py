"""qerl_plugin.shards: --max-shard-size parsing, huggingface_hub's split of the output into files, and
the index of a sharded output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from qerl_plugin.plan import format_plan, plan_quantization
from qerl_plugin.shards import parse_size, shard_layout
from qerl_plugin.source import QuantizeError
from helpers import read_safetensors_dir


# 3kB: the embeddings, lm_head and MLP weights are each larger than a file, so they get files of their own
@pytest.mark.parametrize("limit", ["20kB", "3kB"])
def test_sharded_output_has_a_consistent_index(tiny_qwen2_dir, quantized, tmp_path, run_qerl, limit):
    dst = tmp_path / "sharded_out"
    assert run_qerl(tiny_qwen2_dir, dst, "--max-shard-size", limit) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for f in files:
        with safe_open(str(dst / f), "pt") as h:
            keys = set(h.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == f}
            total += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in keys)
        for k in keys:  # a module's packed/scale/global scale stay together
            if k.endswith("weight_packed"):
                assert {k.replace("packed", "scale"), k.replace("packed", "global_scale")} <= keys
    assert index["metadata"]["total_size"] == total
    a, b = read_safetensors_dir(dst), read_safetensors_dir(quantized)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_max_shard_size_parsing():
    assert parse_size("5GB") == 5_000_000_000 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("20kB") == 20_000 and parse_size("1000") == 1000 and parse_size(7) == 7
    for bad in ("five", "0", "-3MB"):
        with pytest.raises(QuantizeError, match="size"):
            parse_size(bad)


@pytest.mark.parametrize("limit", [3_000, 20_000, 10**9])
def test_layout_names_sizes_and_each_tensor_once(tiny_qwen2_dir, limit):
    plan = plan_quantization(tiny_qwen2_dir)
    layout = plan.shard_layout(limit)
    names, n = list(layout), len(layout)
    if n == 1:
        assert names == ["model.safetensors"]
    else:
        assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    placed = [e.name for entries in layout.values() for e in entries]
    assert sorted(placed) == sorted(t.name for t in plan.tensors)
    sizes = [sum(plan.output_bytes(e) for e in entries) for entries in layout.values()]
    assert all(size <= limit or len(entries) == 1 for size, entries in zip(sizes, layout.values()))
    assert sum(sizes) == plan.dst_bytes
    oversized = [size for size in sizes if size > limit]
    assert bool(oversized) == (limit == 3_000)  # 3 kB is smaller than the embeddings and the MLP weights
    assert (n == 1) == (limit == 10**9)
    assert f" in {n} file{'s' if n > 1 else ''} (" in format_plan(plan, limit)


def test_layout_of_no_tensors_is_one_empty_file():
    assert shard_layout([], lambda entry: 0, 1000) == {"model.safetensors": []}
