"""``qerl export`` on real verl checkpoints of the NVFP4 + LoRA actor, written on CPU by verl's own code.

Each rank is a subprocess (gloo): the tiny Qwen2 in fp32, its decoder projections in NVFP4Linear
(``replace_linears_with_nvfp4``), PEFT LoRA as verl's ``FSDPEngine._build_lora_module`` adds it
(``LoraConfig(task_type=CAUSAL_LM, r, lora_alpha, target_modules="all-linear", bias="none")``), then FSDP2 via
verl's ``apply_fsdp2`` (decoder layers, then the root; bf16 ``MixedPrecisionPolicy``) or FSDP1 with verl's LoRA
wrap policy, two AdamW steps (lora_B non-zero), and verl's ``FSDPCheckpointManager.save_checkpoint``. Unlike a
GPU run, no rank broadcasts its weights (verl's ``fsdp2_load_full_state_dict`` needs CUDA, gloo cannot
broadcast the FP8 scales, FSDP1's ``sync_module_states`` needs a GPU): every rank builds the same model from
the same seed. At 2 ranks with r=5 the LoRA tensors are split unevenly across the rank files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import make_tiny_qwen2

pytest.importorskip("verl")
pytest.importorskip("peft")

from verl_ext.export import ExportError, export_adapter  # noqa: E402

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

RANK_CODE = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    rank, world, init, model_dir, out, r = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
    jobs = sys.argv[7].split(",")
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method="file://" + init)
    from peft import LoraConfig, TaskType, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy
    from verl_ext.nvfp4_replace import replace_linears_with_nvfp4

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    tok = AutoTokenizer.from_pretrained(model_dir)

    def build(lora=True):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if not lora:
            return m
        replace_linears_with_nvfp4(m)
        m.enable_input_require_grads()
        return get_peft_model(m, LoraConfig(task_type=TaskType.CAUSAL_LM, r=r, lora_alpha=2 * r,
                                            target_modules="all-linear", bias="none"))

    def fsdp2(m):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
        apply_fsdp2(m, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True}, {})
        return m

    def fsdp1(m):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        return FSDP(m, auto_wrap_policy=get_fsdp_wrap_policy(module=m, config=None, is_lora=True),
                    device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=mp,
                    sync_module_states=False, device_mesh=mesh, use_orig_params=False)

    def train(m):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as verl's actor runs its forward
                loss = m(input_ids=torch.randint(0, 96, (2, 8), generator=g)).logits.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return opt

    def save(m, opt, name, **cfg):
        contents = ["model", "optimizer", "extra"] if opt is not None else ["model", "extra"]
        mgr = FSDPCheckpointManager(model=m, optimizer=opt, lr_scheduler=None, processing_class=tok,
                                    checkpoint_config={"save_contents": contents, **cfg})
        mgr.save_checkpoint(f"{out}/{name}/global_step_2/actor", global_step=2)

    def reference(m, name, ctx=None):
        import contextlib
        with ctx or contextlib.nullcontext():
            sd = m.state_dict()
        full = {k: v.full_tensor() for k, v in sd.items() if ".lora_" in k}
        if rank == 0:
            torch.save(full, f"{out}/{name}/lora.pt")

    if "fsdp2" in jobs:
        m = fsdp2(build())
        opt = train(m)
        save(m, opt, "fsdp2")
        save(m, opt, "lora_only", save_lora_only=True)
        reference(m, "fsdp2")
        reference(m, "lora_only")
    if "fsdp1" in jobs:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        m = fsdp1(build())
        opt = train(m)
        save(m, opt, "fsdp1")
        reference(m, "fsdp1", FSDP.state_dict_type(m, StateDictType.SHARDED_STATE_DICT))
    if "full" in jobs:
        save(fsdp2(build(lora=False)), None, "full")
    dist.destroy_process_group()
    """
)


def _write_checkpoints(root: Path, model_dir: Path, world: int, r: int, jobs: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    init = root / "pg_init"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_CODE, str(rank), str(world), str(init), str(model_dir), str(root), str(r), jobs],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        for rank in range(world)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return root


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir) -> Path:
    return tiny_qwen2_dir


@pytest.fixture(scope="module")
def ckpt1(tmp_path_factory, model_dir) -> Path:
    """World size 1, r=8: FSDP2 (full state and save_lora_only) and a full fine-tune without LoRA."""
    return _write_checkpoints(tmp_path_factory.mktemp("ckpt1"), model_dir, 1, 8, "fsdp2,full")


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory, model_dir) -> Path:
    """World size 2, r=5 (uneven shards): FSDP2 and FSDP1."""
    return _write_checkpoints(tmp_path_factory.mktemp("ckpt2"), model_dir, 2, 5, "fsdp2,fsdp1")


def _actor(root: Path, name: str) -> Path:
    return root / name / "global_step_2" / "actor"


def _peft_key(name: str) -> str:
    return name.replace(".default.weight", ".weight")


def _read_adapter(out: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors")), json.loads((out / "adapter_config.json").read_text())


CASES = [("ckpt1", "fsdp2", 8), ("ckpt1", "lora_only", 8), ("ckpt2", "fsdp2", 5), ("ckpt2", "fsdp1", 5)]


# ---------------------------------------------------------------------------------------------------------
# what verl wrote, and what the export makes of it


def test_verl_checkpoint_layout(ckpt1, ckpt2):
    actor = _actor(ckpt2, "fsdp2")
    names = sorted(p.name for p in actor.iterdir())
    assert names == [
        "extra_state_world_size_2_rank_0.pt", "extra_state_world_size_2_rank_1.pt", "fsdp_config.json", "huggingface",
        "lora_train_meta.json", "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt",
        "optim_world_size_2_rank_0.pt", "optim_world_size_2_rank_1.pt",
    ]  # fmt: skip
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}
    assert json.loads((actor / "lora_train_meta.json").read_text()) == {"r": 5, "lora_alpha": 10, "task_type": "CAUSAL_LM"}
    assert (actor / "huggingface" / "config.json").is_file() and (actor / "huggingface" / "tokenizer_config.json").is_file()
    # each rank file holds part of every LoRA tensor (r=5 over 2 ranks: 3 + 2 rows) and a whole NVFP4 base
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    for rank, rows in ((0, 3), (1, 2)):
        sd = torch.load(actor / f"model_world_size_2_rank_{rank}.pt", weights_only=False)
        assert tuple(sd[f"{key}.lora_A.default.weight"].to_local().shape) == (rows, 64)
        assert tuple(sd[f"{key}.base_layer.weight_packed"].shape) == (64, 32)
    lora_only = torch.load(_actor(ckpt1, "lora_only") / "model_world_size_1_rank_0.pt", weights_only=False)
    assert lora_only and all(".lora_" in k for k in lora_only)


@pytest.mark.parametrize("fixture,name,r", CASES)
def test_adapter_is_exactly_the_models_lora(request, tmp_path, fixture, name, r, model_dir):
    root = request.getfixturevalue(fixture)
    report = export_adapter(_actor(root, name), tmp_path / "adapter", base=model_dir)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors, config = _read_adapter(tmp_path / "adapter")
    expected = {_peft_key(k): v for k, v in torch.load(root / name / "lora.pt").items()}
    assert sorted(tensors) == sorted(expected)
    for key, value in expected.items():
        assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], value), key
    assert any(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)  # trained, not the zero init
    # only LoRA: nothing of the NVFP4 base, the norms, the embeddings, lm_head
    modules = {f"base_model.model.model.layers.{i}.{'self_attn' if p in PROJS[:4] else 'mlp'}.{p}" for i in (0, 1) for p in PROJS}
    assert set(tensors) == {f"{m}.lora_{h}.weight" for m in modules for h in "AB"}
    assert config["r"] == r and config["lora_alpha"] == 2 * r and config["task_type"] == "CAUSAL_LM"
    assert config["peft_type"] == "LORA" and config["bias"] == "none" and not config["use_rslora"]
    assert sorted(config["target_modules"]) == sorted(PROJS)
    assert config["base_model_name_or_path"] == str(model_dir)
    assert report.modules == 14 and report.r == r


def test_target_modules_name_only_what_was_trained(model_dir):
    """Leaf names when every module of that name has LoRA (PEFT's own form); full names when the run left some
    out, so that PEFT adds no untrained LoRA layers on load."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl_ext.export import _target_modules

    lora = {f"base_model.model.model.layers.{i}.self_attn.q_proj": {} for i in (0, 1)}
    others = {f"base_model.model.model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj")}
    assert _target_modules(lora, others) == ["q_proj"]
    one = {"base_model.model.model.layers.1.self_attn.q_proj": {}}
    targets = _target_modules(one, others)
    assert targets == ["model.layers.1.self_attn.q_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4, target_modules=targets))
    assert [n for n, m in model.named_modules() if hasattr(m, "lora_A")] == ["base_model.model.model.layers.1.self_attn.q_proj"]


def test_plain_tensors_merge_as_verls_merger_does(tmp_path):
    """Entries that are not DTensors (a module saved without FSDP) are replicated: one copy, and ranks must agree."""
    from verl_ext.lora_checkpoint import _merge

    files = [tmp_path / "model_world_size_2_rank_0.pt", tmp_path / "model_world_size_2_rank_1.pt"]
    t = torch.randn(4, 8)
    assert torch.equal(_merge("m.lora_A.weight", [t, t.clone()], files), t)
    with pytest.raises(ExportError, match="differs between rank 0 and rank 1"):
        _merge("m.lora_A.weight", [t, t + 1], files)


def test_dtype_conversion(tmp_path, ckpt1):
    export_adapter(_actor(ckpt1, "fsdp2"), tmp_path / "a", dtype="bfloat16")
    tensors, config = _read_adapter(tmp_path / "a")
    expected = torch.load(ckpt1 / "fsdp2" / "lora.pt")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all(torch.equal(tensors[_peft_key(k)], v.bfloat16()) for k, v in expected.items())
    assert config["base_model_name_or_path"] is None


def test_checkpoint_dir_forms(tmp_path, ckpt1):
    """The actor folder, its global_step_N folder, and the run folder with verl's tracker file give one adapter."""
    run = tmp_path / "run"
    shutil.copytree(ckpt1 / "fsdp2", run)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    outs = []
    for i, src in enumerate((run / "global_step_2" / "actor", run / "global_step_2", run)):
        report = export_adapter(src, tmp_path / f"a{i}")
        assert report.actor_dir == run / "global_step_2" / "actor"
        outs.append((tmp_path / f"a{i}" / "adapter_model.safetensors").read_bytes())
    assert outs[0] == outs[1] == outs[2]


# ---------------------------------------------------------------------------------------------------------
# the consumers: PEFT on the dequantized base, vLLM's LoRA loader


def _dequantized_base(model_dir: Path):
    """The bf16 model (in fp32) whose decoder projections hold the NVFP4 dequantization the actor trained on."""
    from transformers import AutoModelForCausalLM

    from verl_ext.nvfp4_replace import replace_linears_with_nvfp4

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quant = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    report = replace_linears_with_nvfp4(quant)
    with torch.no_grad():
        for name in report.replaced:
            base.get_submodule(name).weight.copy_(quant.get_submodule(name).dequantize_weight(torch.float32))
    return base, quant


@pytest.mark.parametrize("fixture,name,r", [CASES[0], CASES[2]])
def test_peft_loads_it_onto_the_dequantized_base_with_the_actors_outputs(request, tmp_path, fixture, name, r, model_dir):
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model, set_peft_model_state_dict

    root = request.getfixturevalue(fixture)
    export_adapter(_actor(root, name), tmp_path / "adapter")
    lora = {_peft_key(k): v for k, v in torch.load(root / name / "lora.pt").items()}

    base, actor = _dequantized_base(model_dir)  # actor: NVFP4Linear base, as in training
    actor = get_peft_model(actor, LoraConfig(task_type=TaskType.CAUSAL_LM, r=r, lora_alpha=2 * r,
                                             target_modules="all-linear", bias="none"))
    result = set_peft_model_state_dict(actor, lora)
    assert not result.unexpected_keys
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        got = loaded(input_ids=ids).logits
        want = actor.eval()(input_ids=ids).logits
    assert torch.equal(got, want), (got - want).abs().max()  # fp32: the same weights through the same ops
    assert (got - plain).abs().max() > 1e-3  # the adapter changes the outputs


def test_vllm_lora_loader_reads_it(tmp_path, ckpt2, monkeypatch):
    pytest.importorskip("vllm")
    import vllm.lora.lora_model as lora_model
    from vllm.lora.peft_helper import PEFTHelper

    export_adapter(_actor(ckpt2, "fsdp2"), tmp_path / "adapter")
    monkeypatch.setattr(lora_model, "PIN_MEMORY", False)  # no pinned memory without CUDA
    helper = PEFTHelper.from_local_dir(str(tmp_path / "adapter"), max_position_embeddings=256)
    assert (helper.r, helper.vllm_lora_scaling_factor) == (5, 2.0)
    loaded = lora_model.LoRAModel.from_local_checkpoint(
        str(tmp_path / "adapter"), expected_lora_modules=set(PROJS), peft_helper=helper, device="cpu", dtype=torch.float32
    )
    lora = {_peft_key(k): v for k, v in torch.load(ckpt2 / "fsdp2" / "lora.pt").items()}
    assert len(loaded.loras) == 14
    q = loaded.loras["model.layers.1.self_attn.q_proj"]
    assert torch.equal(q.lora_a, lora["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q.lora_b, lora["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"])


def test_base_may_be_the_nvfp4_checkpoint(tmp_path, ckpt1, tiny_qwen2_nvfp4_dir):
    export_adapter(_actor(ckpt1, "fsdp2"), tmp_path / "adapter", base=tiny_qwen2_nvfp4_dir)
    assert _read_adapter(tmp_path / "adapter")[1]["base_model_name_or_path"] == str(tiny_qwen2_nvfp4_dir)


# ---------------------------------------------------------------------------------------------------------
# bad input


def _copy(actor: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt" / "global_step_2" / "actor"
    shutil.copytree(actor, dst)
    return dst


def test_not_a_verl_checkpoint(tmp_path, model_dir):
    with pytest.raises(ExportError, match=r"Hugging Face model directory; expected a verl FSDP actor checkpoint: "
                       r"fsdp_config.json and model_world_size_<W>_rank_<R>.pt"):
        export_adapter(model_dir, tmp_path / "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="not a verl checkpoint.*found nothing"):
        export_adapter(tmp_path / "empty", tmp_path / "a")
    with pytest.raises(ExportError, match="no such directory"):
        export_adapter(tmp_path / "missing", tmp_path / "a")
    (tmp_path / "megatron" / "dist_ckpt").mkdir(parents=True)
    with pytest.raises(ExportError, match="a Megatron checkpoint; qerl export reads FSDP checkpoints"):
        export_adapter(tmp_path / "megatron", tmp_path / "a")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ExportError, match="already a PEFT adapter directory"):
        export_adapter(tmp_path / "adapter", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_full_fine_tune_is_named(tmp_path, ckpt1):
    with pytest.raises(ExportError, match=r"no LoRA tensors among its \d+ tensors: a full fine-tune checkpoint.*"
                       r"verl.model_merger merge --backend fsdp"):
        export_adapter(_actor(ckpt1, "full"), tmp_path / "a")


def test_missing_rank_file(tmp_path, ckpt2):
    actor = _copy(_actor(ckpt2, "fsdp2"), tmp_path)
    (actor / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(ExportError, match=r"world size 2, but model_world_size_2_rank_<R>.pt is missing for rank\(s\) \[1\]"):
        export_adapter(actor, tmp_path / "a")
    (actor / "fsdp_config.json").unlink()
    with pytest.raises(ExportError, match="fsdp_config.json: missing"):
        export_adapter(actor, tmp_path / "a")


def test_corrupt_rank_file(tmp_path, ckpt2):
    actor = _copy(_actor(ckpt2, "fsdp2"), tmp_path)
    path = actor / "model_world_size_2_rank_1.pt"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ExportError, match=r"model_world_size_2_rank_1.pt: torch.load cannot read it .*truncated or corrupt"):
        export_adapter(actor, tmp_path / "a")


def test_rank_files_from_different_saves(tmp_path, ckpt2):
    actor = _copy(_actor(ckpt2, "fsdp2"), tmp_path)
    shutil.copy(_actor(ckpt2, "fsdp1") / "model_world_size_2_rank_1.pt", actor)  # FSDP1 names the same tensors
    sd = torch.load(actor / "model_world_size_2_rank_1.pt", weights_only=False)
    sd.pop(next(k for k in sd if ".lora_B." in k))
    torch.save(sd, actor / "model_world_size_2_rank_1.pt")
    with pytest.raises(ExportError, match="holds other tensors than model_world_size_2_rank_0.pt"):
        export_adapter(actor, tmp_path / "a")


def test_missing_lora_meta(tmp_path, ckpt1):
    actor = _copy(_actor(ckpt1, "fsdp2"), tmp_path)
    (actor / "lora_train_meta.json").unlink()
    with pytest.raises(ExportError, match=r"lora_train_meta.json: missing; .*lora_rank and lora_alpha"):
        export_adapter(actor, tmp_path / "a")
    (actor / "lora_train_meta.json").write_text('{"r": 16, "lora_alpha": 32}')
    with pytest.raises(ExportError, match=r"do not match r=16 .*lora_A \(8, 128\)"):
        export_adapter(actor, tmp_path / "a")


def test_out_not_empty(tmp_path, ckpt1):
    out = tmp_path / "a"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"OUT .* is not empty \(notes.txt\); pass --overwrite"):
        export_adapter(_actor(ckpt1, "fsdp2"), out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    export_adapter(_actor(ckpt1, "fsdp2"), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(ExportError, match="overlaps the checkpoint"):
        export_adapter(_actor(ckpt1, "fsdp2"), _actor(ckpt1, "fsdp2") / "adapter")


def test_base_of_other_shapes(tmp_path, ckpt1):
    wide = make_tiny_qwen2(tmp_path / "wide", intermediate_size=192)
    out = tmp_path / "a"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match=r"does not fit --base .*\(6 module\(s\)\): model.layers.0.mlp.down_proj: adapter "
                       r"lora_A \(8, 128\) and lora_B \(64, 8\), but the base weight is 64x192 \(needs lora_A \(r, 192\)"):
        export_adapter(_actor(ckpt1, "fsdp2"), out, base=wide, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # untouched on failure
    shallow = make_tiny_qwen2(tmp_path / "shallow", num_hidden_layers=1)
    with pytest.raises(ExportError, match=r"model.layers.1.mlp.down_proj: the base has no such module"):
        export_adapter(_actor(ckpt1, "fsdp2"), tmp_path / "b", base=shallow)
    with pytest.raises(ExportError, match="--base .*: not a directory"):
        export_adapter(_actor(ckpt1, "fsdp2"), tmp_path / "b", base=tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------------------
# the command


def test_cli(tmp_path, ckpt2, model_dir, capsys, monkeypatch):
    from qerl_plugin import cli

    assert cli.main(["export", str(_actor(ckpt2, "fsdp2").parent), str(tmp_path / "a"), "--base", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "r=5 alpha=10 on 14 modules" in out and "FSDP2, 2 rank(s)" in out
    assert f"--enable-lora --max-lora-rank 8 --lora-modules qerl={tmp_path / 'a'}" in out
    _serve_hint_parses(out, model_dir, tmp_path / "a", monkeypatch)
    assert cli.main(["export", str(_actor(ckpt2, "fsdp2")), str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qerl export: error: OUT") and len(err.strip().splitlines()) == 1


def _serve_hint_parses(out: str, model_dir, adapter, monkeypatch) -> None:
    """The printed `vllm serve` line, read by vLLM's own serve parser: qerl's method on the base, the adapter by name
    (without --quantization nvfp4 an NVFP4A16 base would run on vLLM's stock path)."""
    pytest.importorskip("vllm")
    import shlex

    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(type(current_platform), "device_type", "cpu")  # vLLM's parser needs a device type
    (line,) = [x for x in out.splitlines() if x.startswith("serve it: vllm serve ")]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(shlex.split(line.removeprefix("serve it: vllm serve ")))
    got = (args.model_tag, args.quantization, args.enable_lora, args.max_lora_rank)
    assert got == (str(model_dir), "nvfp4", True, 8)
    assert [(m.name, m.path) for m in args.lora_modules] == [("qerl", str(adapter))]


def test_module_import_is_cheap():
    code = "import sys, verl_ext.export; print(sorted(m for m in ('torch', 'verl', 'peft', 'safetensors') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
