"""AQN under tensor parallelism: two real vLLM ranks (gloo, CPU) draw the same noise for every norm.

Each rank is a subprocess that starts vLLM's distributed state with ``tensor_model_parallel_size=2`` and loads
the tiny Qwen2 with vLLM's own model loader (``quantization="nvfp4"``, quantized at load,
``additional_config={"qerl_aqn": true}``), so its norms are the real ``NoisyRMSNorm`` built by vLLM's model
code while its projections hold their TP slices. The noise is then set through the worker extension verl
runs, ``verl_ext.worker_extension.QerlVerlWorkerExtension.qerl_set_noise`` (mixed into a stand-in host with
``model_runner.get_model()`` and ``rank``, as in tests/vllm_ext/test_worker_extension.py; verl's ``__new__``,
which wants a vLLM worker, is skipped), whose report carries the checksum (the fp64 sum of every noise entry,
``vllm_ext.noisy_norm.set_noise``) that it prints on rank 0 as ``[qerl] vLLM noise set: ... checksum=...``.

Shown: both ranks report the same norms and the same checksum for (seed, stage), the same bytes in every
``qerl_noise`` buffer and the same noisy norm outputs for the same input, equal to the vectors the actor draws
for the same Hugging Face norm names (``verl_ext.aqn_hook.ActorNoise``, the ``apply_to_actor`` path); another
seed or stage gives another checksum; clearing restores vLLM's RMSNorm on both. And: only rank 0 prints the
line (what a 2-GPU log shows; rank 1's checksum comes back only in the RPC's return value). Both ranks also
accept the same full-size adapter through the sync's validation and build (``build_lora_model``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("verl")

import torch  # noqa: E402
from helpers import make_tiny_qwen2  # noqa: E402
from nvfp4_layers import free_port  # noqa: E402

SIGMA = 1e-2
SETTINGS = [(0, 1), (0, 2), (1, 1)]  # (seed, stage): the first is compared with the actor; the others must differ

RANK_CODE = textwrap.dedent(
    """
    import contextlib, hashlib, io, json, sys, torch
    rank, world, port, model_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    sigma, settings = float(sys.argv[6]), json.loads(sys.argv[7])

    from vllm.platforms import current_platform
    # vLLM's unspecified CPU platform names no attention backend; name vLLM's CPU one (tests/vllm_ext/conftest.py)
    type(current_platform).get_attn_backend_cls = classmethod(
        lambda cls, *a, **k: "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend")
    from vllm.config import (CompilationConfig, CompilationMode, DeviceConfig, LoadConfig, ModelConfig,
                             ParallelConfig, VllmConfig, set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader import get_model_loader
    from vllm_ext import noisy_norm, quant
    from verl_ext.worker_extension import QerlVerlWorkerExtension

    quant.register()
    noisy_norm.register()
    mc = ModelConfig(model=model_dir, quantization="nvfp4", dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                    load_config=LoadConfig(load_format="safetensors"),
                    parallel_config=ParallelConfig(tensor_parallel_size=world),
                    compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]),
                    additional_config={"qerl_aqn": True})
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(world, 1)
        model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)

    class Runner:
        def get_model(self):
            return model

    ext = object.__new__(QerlVerlWorkerExtension)  # the class verl's rollout uses, without a vLLM worker
    ext.model_runner, ext.rank = Runner(), rank

    def sha(t):
        return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    x = (3 * torch.randn(5, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).bfloat16()

    def norm_outputs():
        with torch.inference_mode():
            return {name: sha(norm(x)) for name, norm in noisy_norm.noisy_norms(model)}

    norms = noisy_norm.noisy_norms(model)
    report = {
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "norm_class": sorted({f"{type(n).__module__}.{type(n).__qualname__}" for _, n in norms}),
        "norm_weights": {name: sha(n.weight) for name, n in norms},
        "qkv_rows": int(model.model.layers[0].self_attn.qkv_proj.weight.shape[0]),
        "stock_outputs": norm_outputs(),
        "settings": [],
    }
    for seed, stage in settings:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rep = ext.qerl_set_noise(sigma, seed, stage)
        report["settings"].append({
            "report": rep,
            "printed": printed.getvalue(),
            "noise": {name: sha(n.qerl_noise) for name, n in norms},
            "outputs": norm_outputs(),
        })
        if (seed, stage) == tuple(settings[0]):
            torch.save({name: n.qerl_noise.clone() for name, n in norms}, f"{out}/noise{rank}.pt")
    report["cleared"] = ext.qerl_clear_noise()

    # the adapter sync's validation and build (verl_ext's sync calls it on every TP rank with the full tensors)
    import vllm.lora.lora_model
    from vllm.config import LoRAConfig
    from vllm_ext.worker_extension import build_lora_model
    vllm.lora.lora_model.PIN_MEMORY = False  # no pinned memory without an NVIDIA driver
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128),
              "mlp.down_proj": (128, 64)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(2):
        for m, (n_in, n_out) in shapes.items():
            tensors[f"base_model.model.model.layers.{i}.{m}.lora_A.weight"] = torch.randn(8, n_in, generator=g)
            tensors[f"base_model.model.model.layers.{i}.{m}.lora_B.weight"] = torch.randn(n_out, 8, generator=g)
    peft_config = {"r": 8, "lora_alpha": 16, "target_modules": sorted({m.split(".")[-1] for m in shapes}),
                   "bias": "none", "peft_type": "LORA"}
    with set_current_vllm_config(vc):
        lora = build_lora_model("policy", 1, tensors, peft_config, model=model, lora_config=LoRAConfig(max_lora_rank=8),
                                vocab_size=128)
    report["adapter_modules"] = len(lora.loras)
    report["adapter_sha"] = hashlib.sha256(b"".join(
        sha(t).encode() for name in sorted(lora.loras) for t in (lora.loras[name].lora_a, lora.loras[name].lora_b)
    )).hexdigest()
    report["cleared_outputs"] = norm_outputs()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("noisy_norm_tp")
    model_dir = make_tiny_qwen2(root / "bf16")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_CODE, str(r), "2", str(port), str(model_dir), str(root), str(SIGMA),
             json.dumps(SETTINGS)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    reports = [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]
    noise = [torch.load(root / f"noise{r}.pt") for r in (0, 1)]
    return reports, noise, model_dir


def test_the_ranks_are_a_tensor_parallel_engine_with_real_aqn_norms(ranks):
    reports, _, _ = ranks
    assert [r["tp_rank"] for r in reports] == [0, 1] and {r["tp_size"] for r in reports} == {2}
    assert {r["qkv_rows"] for r in reports} == {64}  # q 64 + k 32 + v 32 rows split over 2 ranks
    for r in reports:
        assert r["norm_class"] == ["vllm_ext.noisy_norm.NoisyRMSNorm"]
        assert sorted(r["norm_weights"]) == [
            "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
            "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm",
        ]  # fmt: skip
    assert reports[0]["norm_weights"] == reports[1]["norm_weights"]  # norm weights are replicated under TP
    assert reports[0]["stock_outputs"] == reports[1]["stock_outputs"]


def test_checksums_agree_across_ranks_and_change_with_seed_and_stage(ranks):
    reports, _, _ = ranks
    checksums = []
    for i, (seed, stage) in enumerate(SETTINGS):
        r0, r1 = (r["settings"][i] for r in reports)
        assert r0["report"]["rank"] == 0 and r1["report"]["rank"] == 1
        strip = lambda rep: {k: v for k, v in rep.items() if k != "rank"}  # noqa: E731
        assert strip(r0["report"]) == strip(r1["report"])  # norms, sigma, seed, stage, checksum, enabled
        rep = r0["report"]
        assert rep["norms"] == 5 and rep["enabled"] and (rep["seed"], rep["stage"]) == (seed, stage)
        assert r0["noise"] == r1["noise"]  # every buffer, byte for byte
        assert r0["outputs"] == r1["outputs"] and r0["outputs"] != reports[0]["stock_outputs"]
        checksums.append(r0["report"]["checksum"])
        # the log line verl's extension prints: rank 0 only
        assert r0["printed"].startswith("[qerl] vLLM noise set: norms=5, sigma=0.01, ")
        assert f"checksum={checksums[-1]}" in r0["printed"]
        assert r1["printed"] == ""
    print(f"\nchecksums per (seed, stage) {SETTINGS}: {checksums} (rank 0 == rank 1 for each)")
    assert len(set(checksums)) == len(SETTINGS)
    for r in reports:
        assert r["cleared"]["norms"] == 5 and r["cleared_outputs"] == r["stock_outputs"]


def test_both_ranks_accept_and_build_the_same_full_adapter(ranks):
    """The adapter sync hands every TP rank the whole (unsliced) PEFT tensors; each rank's validation compares
    them with the layers' full sizes and builds the same vLLM LoRAModel (vLLM's LoRA layers slice it later,
    on the GPU)."""
    reports, _, _ = ranks
    assert [r["adapter_modules"] for r in reports] == [14, 14]
    assert reports[0]["adapter_sha"] == reports[1]["adapter_sha"]


def test_the_vectors_are_the_actors(ranks):
    """The actor's noise (apply_to_actor) for the Hugging Face model's norms: the same vectors, the same checksum."""
    from transformers import AutoModelForCausalLM

    from verl_ext.aqn_hook import ActorNoise

    reports, noise, model_dir = ranks
    seed, stage = SETTINGS[0]
    actor = ActorNoise(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    assert actor.set(SimpleNamespace(active=True, sigma=SIGMA, seed=seed, key=stage)) == 5
    by_name = {name: actor.noise[id(m)] for name, m in actor.norms}
    assert sorted(by_name) == sorted(noise[0])
    for name, z in by_name.items():
        assert torch.equal(noise[0][name], z) and torch.equal(noise[1][name], z), name
    checksum = float(sum(z.double().sum().item() for _, z in sorted(by_name.items())))
    assert checksum == reports[0]["settings"][0]["report"]["checksum"] == reports[1]["settings"][0]["report"]["checksum"]
    actor.remove()
