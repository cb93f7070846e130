"""The NVFP4 + LoRA actor under FSDP2 on two ranks (gloo, CPU) against one process computing the whole batch.

Each rank is a subprocess that builds the actor the way verl 0.9.1's ``FSDPEngine`` does at world size 2:

- ``from_pretrained`` in fp32 inside verl's ``get_init_weight_context_manager`` (the tiny Qwen2 has untied
  embeddings, as Qwen2.5-7B/32B: rank 0 loads real weights, rank 1 builds a meta-device model);
- ``replace_linears_with_nvfp4`` (qerl's ``_build_lora_module`` wrapper; on rank 1 it makes empty meta
  ``NVFP4Linear`` layers), then PEFT LoRA (r=8, all-linear); rank 0 writes seeded, non-zero lora_A and lora_B;
- ``full_state = module.state_dict()``, verl's ``apply_fsdp2`` (decoder layers, then the root) and verl's
  ``fsdp2_load_full_state_dict``, which broadcasts rank 0's state (LoRA, NVFP4 bytes, frozen parameters) and
  then every buffer to the meta-built rank.

Two stand-ins, because these ranks are CPUs on gloo: verl's ``get_device_id`` (it asks CUDA) returns "cpu", and
``torch.distributed.broadcast`` sends float8_e4m3fn tensors (``weight_scale`` in the state dict) as their uint8
bytes (gloo has no FP8 type). ``test_two_gpus_over_nccl`` (marked gpu, needs 2 GPUs; passed on two H200s,
benchmarks §6a) runs the same code on CUDA over NCCL without either stand-in. ``MixedPrecisionPolicy`` is fp32
for parameters and reductions (verl's default is bf16 parameters): that makes the comparison a test of the
sharding, not of bf16 rounding.

The batch: 4 sequences with different lengths (right-padded) and per-sequence weights of both signs (a
policy-gradient-like loss ``sum(w_i * nll_it) / global_tokens``, as verl's token-mean over the global batch);
rank r takes rows 2r, 2r+1 and scales its part by the world size, because FSDP2 averages gradients. Measured
(2 ranks vs 1 process, fp32, 2026-11-24): the loss equal to the last bit, the LoRA gradients within
max |diff| / max |grad| = 3.1e-7 for the worst of the 28 tensors (asserted below 1e-5 for both). A second
build under verl's default bf16 parameter policy runs too (loss rel 5e-6, gradient cosine >= 0.9993 against
the fp32 single process).

What happens to the base under ``fully_shard``: the NVFP4 tensors are buffers and are not sharded. Every rank
holds the whole packed base (here 41,528 bytes: 2 layers x 7 projections of codes, FP8 scales and global
scales, the same bytes on both ranks and equal to the single process's), while each LoRA parameter (and its
gradient) is a DTensor sharded on dim 0: 32,768 of the 65,536 LoRA bytes per rank. The frozen dense
parameters (embeddings, norms, lm_head, the q/k/v biases) are parameters and so are sharded too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import make_tiny_qwen2

pytest.importorskip("verl")
pytest.importorskip("peft")

WORLD = 2
R = 8
ROWS, SEQ = 4, 12
LENGTHS = (12, 7, 10, 5)  # unequal: rank 0 gets 19 tokens to predict, rank 1 gets 13
WEIGHTS = (1.0, -0.5, 0.75, -1.25)  # advantages of both signs

# One copy of the model build, the LoRA values and the loss, run both by the ranks and by the reference.
COMMON = textwrap.dedent(
    """
    import torch

    R, ROWS, SEQ, LENGTHS, WEIGHTS = {R}, {ROWS}, {SEQ}, {LENGTHS}, {WEIGHTS}

    def lora_config():
        from peft import LoraConfig, TaskType
        return LoraConfig(task_type=TaskType.CAUSAL_LM, r=R, lora_alpha=2 * R, target_modules="all-linear", bias="none")

    def set_lora(model):
        # seeded, non-zero lora_A and lora_B (verl starts lora_B at zero: its gradient would hide lora_A's)
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if ".lora_A." in name or ".lora_B." in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))

    def batch():
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, 96, (ROWS, SEQ), generator=g)
        mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
        for i, n in enumerate(LENGTHS):
            mask[i, :n] = 1
        ids = ids * mask + 95 * (1 - mask)  # right padding with the pad id
        return ids, mask, torch.tensor(WEIGHTS, dtype=torch.float32)

    def weighted_nll_sum(model, ids, mask, w):
        # sum over the rows' predicted tokens of w_row * nll (fp32), and the number of those tokens
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        valid = mask[:, 1:].float()
        return -(w[:, None] * logp * valid).sum(), valid.sum()

    def nvfp4_buffers(model):
        from verl_ext.nvfp4_linear import NVFP4Linear
        out = {{}}
        for name, mod in model.named_modules():
            if isinstance(mod, NVFP4Linear):
                for key in ("weight_packed", "weight_scale", "weight_global_scale"):
                    out[name.replace("._fsdp_wrapped_module", "") + "." + key] = mod._buffers[key]
        return out
    """
).format(R=R, ROWS=ROWS, SEQ=SEQ, LENGTHS=LENGTHS, WEIGHTS=WEIGHTS)

RANK_CODE = COMMON + textwrap.dedent(
    """
    import hashlib, json, sys, time
    import torch.distributed as dist

    t0 = time.time()
    rank, world, init, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    device = sys.argv[6]  # "cpu": gloo with the two stand-ins below; "cuda": NCCL and verl's code as it is
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world,
                            init_method="file://" + init)

    if device == "cpu":
        _broadcast = dist.broadcast
        def broadcast(tensor, *args, **kwargs):  # gloo has no FP8 type: move the scales as their bytes
            if tensor.dtype == torch.float8_e4m3fn:
                return _broadcast(tensor.view(torch.uint8), *args, **kwargs)
            return _broadcast(tensor, *args, **kwargs)
        dist.broadcast = broadcast
        import verl.utils.fsdp_utils as fsdp_utils
        fsdp_utils.get_device_id = lambda: "cpu"  # verl asks CUDA for the device; these ranks are CPUs
    from peft import get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2, fsdp2_load_full_state_dict, get_init_weight_context_manager
    from verl_ext.nvfp4_replace import replace_linears_with_nvfp4

    mesh = init_device_mesh(device, (world,), mesh_dim_names=("fsdp",))

    def build(param_dtype):
        # verl's _build_module: meta tensors on every rank but the first (untied embeddings), then fp32
        with get_init_weight_context_manager(use_meta_tensor=True, mesh=mesh)():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.to(torch.float32)
        meta_before = sum(p.is_meta for p in model.parameters())
        # qerl's _build_lora_module wrapper, then verl's PEFT step
        replace_linears_with_nvfp4(model)
        model.enable_input_require_grads()
        model = get_peft_model(model, lora_config())
        if rank == 0:
            set_lora(model)
        meta_nvfp4 = sum(t.is_meta for t in nvfp4_buffers(model).values())
        # verl's _build_fsdp_module (fsdp2): full state of rank 0, fully_shard, broadcast into the shards
        full_state = model.state_dict()
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
        apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True}, {})
        fsdp2_load_full_state_dict(model, full_state, mesh, None)
        return model, meta_before, meta_nvfp4

    def step(model):
        ids, mask, w = (t.to(device) for t in batch())
        rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        nll, tokens = weighted_nll_sum(model, ids[rows], mask[rows], w[rows])
        total = tokens.clone()
        dist.all_reduce(total)
        (nll / total * world).backward()  # FSDP2 averages gradients over ranks: undo it, as verl's loss scale does
        loss = nll.detach().clone()
        dist.all_reduce(loss)
        return (loss / total).item(), int(tokens.item())

    model, meta_before, meta_nvfp4 = build(torch.float32)
    t_build = time.time() - t0
    loss, tokens = step(model)
    lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    grads = {n: p.grad.full_tensor().cpu() for n, p in lora.items()}
    placements = sorted({str(p.placements) for p in lora.values()} | {str(p.grad.placements) for p in lora.values()})
    buffers = nvfp4_buffers(model)
    frozen = {n: p for n, p in model.named_parameters() if ".lora_" not in n}
    report = {
        "rank": rank,
        "meta_params_before": meta_before,
        "meta_nvfp4_buffers_before_fsdp": meta_nvfp4,
        "loss": loss,
        "tokens": tokens,
        "lora_placements": placements,
        "lora_all_dtensor": all(isinstance(p, DTensor) for p in lora.values()),
        "lora_full_bytes": sum(p.numel() * p.element_size() for p in lora.values()),
        "lora_local_bytes": sum(p.to_local().numel() * p.element_size() for p in lora.values()),
        "lora_grad_local_bytes": sum(p.grad.to_local().numel() * p.grad.element_size() for p in lora.values()),
        "nvfp4_buffers": len(buffers),
        "nvfp4_any_dtensor": any(isinstance(b, DTensor) for b in buffers.values()),
        "nvfp4_local_bytes": sum(b.numel() * b.element_size() for b in buffers.values()),
        "nvfp4_shapes": {k: list(b.shape) for k, b in buffers.items()},
        "nvfp4_sha256": hashlib.sha256(b"".join(b.contiguous().view(torch.uint8).cpu().numpy().tobytes()
                                              for _, b in sorted(buffers.items()))).hexdigest(),
        "frozen_all_dtensor": all(isinstance(p, DTensor) for p in frozen.values()),
        "frozen_full_bytes": sum(p.numel() * p.element_size() for p in frozen.values()),
        "frozen_local_bytes": sum(p.to_local().numel() * p.element_size() for p in frozen.values()),
        "seconds_build": t_build,
    }
    del model, lora
    # verl's default policy: bf16 parameters in the forward (buffers untouched), fp32 reductions
    model, _, _ = build(torch.bfloat16)
    report["loss_bf16"], _ = step(model)
    bf16_grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if ".lora_" in n}
    report["bf16_global_scales"] = sorted({str(b.dtype) for k, b in nvfp4_buffers(model).items()
                                          if k.endswith("weight_global_scale")})
    report["seconds"] = time.time() - t0
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    if rank == 0:
        torch.save(grads, f"{out}/grads.pt")
        torch.save(bf16_grads, f"{out}/grads_bf16.pt")
    dist.destroy_process_group()
    """
)


def _reference(model_dir: Path) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, no FSDP, the whole batch: loss, LoRA gradients, NVFP4 buffers."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from verl_ext.nvfp4_replace import replace_linears_with_nvfp4

    ns: dict = {}
    exec(COMMON, ns)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    replace_linears_with_nvfp4(model)
    model.enable_input_require_grads()
    model = get_peft_model(model, ns["lora_config"]())
    ns["set_lora"](model)
    ids, mask, w = ns["batch"]()
    nll, tokens = ns["weighted_nll_sum"](model, ids, mask, w)
    loss = nll / tokens
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    return loss.item(), grads, ns["nvfp4_buffers"](model)


def _run_ranks(root: Path, device: str) -> tuple[list[dict], dict[str, dict[str, torch.Tensor]], float, Path]:
    model_dir = make_tiny_qwen2(root / "bf16")
    start = time.time()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "" if device == "cpu" else os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_CODE, str(rank), str(WORLD), str(root / "pg_init"), str(model_dir), str(root),
             device],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for rank in range(WORLD)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    reports = [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]
    grads = {"fp32": torch.load(root / "grads.pt"), "bf16": torch.load(root / "grads_bf16.pt")}
    return reports, grads, time.time() - start, model_dir


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run_ranks(tmp_path_factory.mktemp("fsdp_nvfp4"), "cpu")


@pytest.fixture(scope="module")
def reference(ranks):
    return _reference(ranks[3])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_rank1_was_built_on_meta_and_filled_from_rank0(ranks):
    reports = ranks[0]
    assert reports[0]["meta_params_before"] == 0 and reports[1]["meta_params_before"] > 0
    assert reports[0]["meta_nvfp4_buffers_before_fsdp"] == 0
    assert reports[1]["meta_nvfp4_buffers_before_fsdp"] == 2 * 7 * 3  # every NVFP4 buffer of rank 1 was meta
    assert reports[0]["tokens"] + reports[1]["tokens"] == sum(n - 1 for n in LENGTHS)
    assert reports[0]["tokens"] != reports[1]["tokens"]  # the global token normalisation matters


def test_loss_and_lora_gradients_equal_one_process(ranks, reference):
    reports, all_grads, _, _ = ranks
    grads = all_grads["fp32"]
    ref_loss, ref_grads, _ = reference
    assert reports[0]["loss"] == reports[1]["loss"]  # all-reduced: one number on both ranks
    loss_rel = abs(reports[0]["loss"] - ref_loss) / abs(ref_loss)
    assert loss_rel < 1e-5, (reports[0]["loss"], ref_loss)
    assert sorted(grads) == sorted(ref_grads) and len(grads) == 2 * 7 * 2
    rels = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(rels, key=rels.get)
    print(f"\nloss 2 ranks {reports[0]['loss']:.9g} vs 1 process {ref_loss:.9g}: rel {loss_rel:.2e}; "
          f"LoRA grads: worst max|diff|/max|grad| {rels[worst]:.2e} ({worst})")
    assert rels[worst] < 1e-5, (worst, rels[worst])
    # the gradients are real: lora_A's depends on the non-zero lora_B, and every tensor got one
    assert all(ref_grads[n].abs().max() > 0 for n in ref_grads)


def test_verls_bf16_policy_runs_on_the_nvfp4_base(ranks, reference):
    """verl's default ``param_dtype: bf16``: FSDP2 casts the parameters (LoRA, norms, embeddings) for the
    forward and leaves the NVFP4 buffers alone, so the global scales stay fp32 and the layer runs; the result
    differs from the fp32 one by bf16 rounding only (measured: loss rel 5e-6, worst gradient cosine 0.99935)."""
    reports, all_grads, _, _ = ranks
    ref_loss, ref_grads, _ = reference
    for rep in reports:
        assert rep["bf16_global_scales"] == ["torch.float32"]
    loss_rel = abs(reports[0]["loss_bf16"] - ref_loss) / abs(ref_loss)
    cos = {n: torch.cosine_similarity(all_grads["bf16"][n].flatten(), ref_grads[n].flatten(), dim=0).item()
           for n in ref_grads}
    worst = min(cos, key=cos.get)
    print(f"\nbf16 parameters, 2 ranks vs fp32 one process: loss rel {loss_rel:.2e}, worst gradient cosine "
          f"{cos[worst]:.6f} ({worst})")
    assert reports[0]["loss_bf16"] == reports[1]["loss_bf16"]
    assert loss_rel < 2e-2 and cos[worst] > 0.99


def test_nvfp4_base_is_replicated_and_lora_is_sharded(ranks, reference):
    reports = ranks[0]
    _, _, ref_buffers = reference
    ref_bytes = sum(b.numel() * b.element_size() for b in ref_buffers.values())
    for rep in reports:
        # buffers: plain tensors, the whole base on every rank
        assert rep["nvfp4_buffers"] == 2 * 7 * 3 and not rep["nvfp4_any_dtensor"]
        assert rep["nvfp4_local_bytes"] == ref_bytes == 41_528
        assert rep["nvfp4_shapes"] == {k: list(b.shape) for k, b in ref_buffers.items()}
        # LoRA: DTensors sharded on dim 0, half the bytes per rank (r=8 rows of lora_A split 4 + 4)
        assert rep["lora_all_dtensor"] and rep["lora_placements"] == ["(Shard(dim=0),)"]
        assert rep["lora_full_bytes"] == 65_536 and rep["lora_local_bytes"] == rep["lora_grad_local_bytes"] == 32_768
        # the frozen dense parameters are parameters: sharded as well
        assert rep["frozen_all_dtensor"] and rep["frozen_local_bytes"] * 2 == rep["frozen_full_bytes"]
    # the same bytes on both ranks (rank 1's came through verl's broadcast), equal to the single process's
    import hashlib

    ref_sha = hashlib.sha256(b"".join(b.contiguous().view(torch.uint8).numpy().tobytes()
                                      for _, b in sorted(ref_buffers.items()))).hexdigest()
    assert reports[0]["nvfp4_sha256"] == reports[1]["nvfp4_sha256"] == ref_sha
    print(f"\nper rank: NVFP4 buffers {reports[0]['nvfp4_local_bytes']} B (replicated), LoRA "
          f"{reports[0]['lora_local_bytes']} of {reports[0]['lora_full_bytes']} B (sharded), frozen dense params "
          f"{reports[0]['frozen_local_bytes']} of {reports[0]['frozen_full_bytes']} B; ranks took "
          f"{ranks[2]:.1f} s (build {reports[0]['seconds_build']:.1f} s)")


@pytest.mark.gpu
def test_two_gpus_over_nccl(tmp_path):
    """The same build and step on two CUDA GPUs over NCCL, without the CPU stand-ins: verl's own
    ``get_device_id`` and NCCL's own FP8 broadcast of the scales. Tolerance 1e-4 (fp32 GPU kernels against the CPU
    reference). First run 2026-11-28 on two H200s (benchmarks §6a): the same loss, worst gradient 3.58e-06."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    reports, grads, seconds, model_dir = _run_ranks(tmp_path, "cuda")
    ref_loss, ref_grads, ref_buffers = _reference(model_dir)
    assert reports[0]["loss"] == reports[1]["loss"]
    assert abs(reports[0]["loss"] - ref_loss) / abs(ref_loss) < 1e-4
    rels = {n: _rel(grads["fp32"][n], ref_grads[n]) for n in ref_grads}
    assert max(rels.values()) < 1e-4, max(rels.items(), key=lambda kv: kv[1])
    for rep in reports:
        assert not rep["nvfp4_any_dtensor"] and rep["nvfp4_local_bytes"] == 41_528
        assert rep["lora_local_bytes"] == 32_768 and rep["bf16_global_scales"] == ["torch.float32"]
    assert reports[0]["nvfp4_sha256"] == reports[1]["nvfp4_sha256"]
    print(f"\n2 GPUs: loss {reports[0]['loss']:.9g} vs {ref_loss:.9g}, worst gradient rel {max(rels.values()):.2e}, "
          f"{seconds:.1f} s")
