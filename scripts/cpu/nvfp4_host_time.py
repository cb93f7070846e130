"""Host time per call of the actor's NVFP4Linear against a BF16 nn.Linear, on CPU, with the Triton launch replaced
by a no-op: what the Python wrapper itself costs per forward, forward under autocast, forward + backward, and one
decode call (docs/benchmarks.md §4e). The numbers are this CPU's; on the GPU machine each Python call is slower.

    QERL_DEQUANT_BACKEND=triton python scripts/cpu/nvfp4_host_time.py
"""
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before verl_ext.kernels is imported: the Triton path on CPU tensors
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from verl_ext import kernels  # noqa: E402
from verl_ext.nvfp4_linear import NVFP4Linear  # noqa: E402


class _NoLaunch:
    """Stands in for the Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, calls: int = 3000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    if os.environ.get("QERL_DEQUANT_BACKEND") != "triton":
        sys.exit("set QERL_DEQUANT_BACKEND=triton (on CPU tensors the default backend is the torch codec)")
    kernels._nvfp4_dequant_kernel = _NoLaunch()
    torch.set_num_threads(1)
    w = (torch.randn(256, 256) * 0.05).to(torch.bfloat16)
    layers = {"bf16": torch.nn.Linear(256, 256, bias=False, dtype=torch.bfloat16).requires_grad_(False),
              "nvfp4": NVFP4Linear.from_weight(w)}
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    res = {}
    for label, layer in layers.items():
        with torch.no_grad():
            res[f"{label}_fwd"] = per_call_us(lambda: layer(x))

        def fwd_autocast():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                layer(x)

        res[f"{label}_fwd_autocast"] = per_call_us(fwd_autocast)
        res[f"{label}_fwd_bwd"] = per_call_us(lambda: layer(x).sum().backward())
    q = layers["nvfp4"]
    res["dequantize_call"] = per_call_us(
        lambda: kernels.dequantize_nvfp4_triton(q.weight_packed, q._buffers["weight_scale"], q.weight_global_scale))
    print({k: round(v, 1) for k, v in res.items()})


if __name__ == "__main__":
    main()
