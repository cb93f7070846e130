"""Tensor parallelism: two real vLLM ranks (gloo, CPU) quantizing while loading hold exactly their slices of
the unsharded ``quantize_fused`` bytes - the per-part amax is all-reduced, so the global scale is the same as
``qerl quantize``'s and the trainer's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from nvfp4_layers import free_port  # noqa: E402

from qerl_plugin import nvfp4  # noqa: E402

RANK_CODE = textwrap.dedent(
    """
    import sys, torch
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm_ext import quant
    quant.register()
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(world, 1)
        from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
        qc = quant.NVFP4Config()
        qc.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        qkv = QKVParallelLinear(64, 16, 4, 2, bias=False, params_dtype=torch.bfloat16, quant_config=qc,
                                prefix="m.qkv_proj")
        o = RowParallelLinear(64, 32, bias=False, params_dtype=torch.bfloat16, quant_config=qc, prefix="m.o_proj")
        w = torch.load(sys.argv[5])
        for shard in "qkv":
            qkv.weight.weight_loader(qkv.weight, w[shard], shard)
        o.weight.weight_loader(o.weight, w["o"])
        torch.save({"qkv": {n: p.data for n, p in qkv.named_parameters()},
                    "o": {n: p.data for n, p in o.named_parameters()}}, out)
    """
)


def test_two_ranks_hold_slices_of_the_unsharded_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = {
        "q": torch.randn(64, 64, generator=g).bfloat16(),
        "k": (3 * torch.randn(32, 64, generator=g)).bfloat16(),
        "v": torch.randn(32, 64, generator=g).bfloat16(),
        "o": torch.randn(32, 64, generator=g).bfloat16(),
    }
    w["q"][40, 3] = 40.0  # the fused layer's max sits in rank 1's rows of q: rank 0 must learn it
    w["o"][0, 50] = -30.0  # o_proj's max sits in rank 1's input columns
    torch.save(w, tmp_path / "w.pt")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_CODE, str(r), "2", str(port), str(tmp_path / f"r{r}.pt"), str(tmp_path / "w.pt")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ},
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    fused = nvfp4.quantize_fused([w["q"], w["k"], w["v"]])
    full_o = nvfp4.quantize(w["o"])
    for r in (0, 1):
        got = torch.load(tmp_path / f"r{r}.pt")
        q_rows, kv_rows = slice(32 * r, 32 * (r + 1)), slice(16 * r, 16 * (r + 1))  # 2 q heads, 1 kv head per rank
        packed = torch.cat([fused[0].packed[q_rows], fused[1].packed[kv_rows], fused[2].packed[kv_rows]])
        scale = torch.cat([fused[0].scale[q_rows], fused[1].scale[kv_rows], fused[2].scale[kv_rows]])
        assert torch.equal(got["qkv"]["weight"], packed), r
        assert torch.equal(got["qkv"]["weight_scale"].view(torch.uint8), scale.view(torch.uint8)), r
        assert torch.equal(got["qkv"]["weight_global_scale"], fused[0].global_scale), r
        cols = slice(32 * r, 32 * (r + 1))
        assert torch.equal(got["o"]["weight"], full_o.packed[:, 16 * r:16 * (r + 1)]), r
        assert torch.equal(got["o"]["weight_scale"].view(torch.uint8), full_o.scale[:, 2 * r:2 * (r + 1)].view(torch.uint8)), r
        assert torch.equal(got["o"]["weight_global_scale"], full_o.global_scale), (r, cols)
