"""``qerl doctor``: what this environment has and lacks for each job.

Jobs and what they need:

* ``quantize``  (CPU)  Python 3.10-3.12, torch, safetensors, compressed-tensors, huggingface-hub, tqdm:
                       ``qerl quantize`` runs.
* ``rollout``          a CUDA GPU of compute capability >= 7.5 (vLLM's own test for its Marlin FP4 kernel),
                       vLLM importable with its compiled ops ``torch.ops._C.marlin_gemm`` /
                       ``gptq_marlin_repack``, and our ``vllm.general_plugins`` entry point ``qerl``.
* ``serve``            as rollout (the plugin is only recommended: stock vLLM serves NVFP4 + LoRA; with it,
                       ``vllm serve CKPT --quantization nvfp4`` runs qerl's kernels).
* ``train``            rollout, plus verl, peft, transformers and our ``verl.plugins`` entry point ``qerl``.

Versions that differ from the pins (:data:`qerl_plugin.upstream.PINS`) are warnings, not failures. vLLM and
verl are imported in a child process, so a broken install cannot take this report down, and this module
itself imports neither.

Exit status: with ``--job`` (repeatable), 1 if any named job cannot run; without it every job is
reported and the status is 1 only if ``quantize`` (the CPU job, the one every machine should run)
cannot run. 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata

from qerl_plugin.upstream import MARLIN_FP4_MIN_CAPABILITY, PINS

HELP = "report what this environment has and lacks for each job (quantize, rollout, train, serve)"

PACKAGES = ("torch", "safetensors", "compressed-tensors", "transformers", "huggingface-hub", "tqdm", "vllm", "verl", "peft")
JOBS = ("quantize", "rollout", "train", "serve")
MARLIN_OPS = ("marlin_gemm", "gptq_marlin_repack")
# the compiled library that registers torch.ops._C: vLLM 0.24 CUDA wheels ship the first, older ones the second
VLLM_OPS_LIBS = ("vllm._C_stable_libtorch", "vllm._C")
ENTRY_POINTS = {"vllm": ("vllm.general_plugins", "qerl", "vllm_ext:register"), "verl": ("verl.plugins", "qerl", "verl_ext")}
PROBE_TIMEOUT_S = 300
_PROBE_MARK = "QERL_DOCTOR_PROBE="


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# checks run in this process (no vLLM/verl import)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def check_python() -> Check:
    v = sys.version_info
    ok = (3, 10) <= (v.major, v.minor) < (3, 13)
    return Check("python", ok, f"{platform.python_version()} ({sys.executable})", "" if ok else "use Python 3.10, 3.11 or 3.12")


def check_package(dist: str) -> Check:
    version = _version(dist)
    if version is None:
        pin = PINS.get(dist)
        return Check(dist, False, "not installed", f"pip install {dist}=={pin}" if pin else f"pip install {dist}")
    pin = PINS.get(dist)
    warnings = []
    detail = version
    if pin:
        detail += f" (pin {pin})"
        if _base(version) != pin:
            warnings.append(f"{dist} {version} is not the pinned {pin}; qerl-plugin is tested with {pin}")
    return Check(dist, True, detail, warnings=warnings)


def check_cuda() -> tuple[Check, Check]:
    """(CUDA GPU present, its capability is enough for vLLM's Marlin FP4 kernel)."""
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency
        c = Check("CUDA GPU", False, f"torch does not import ({type(exc).__name__}: {exc})", "reinstall torch")
        return c, Check("GPU capability", False, "unknown (no torch)")
    if not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False"
        if torch.version.cuda is None:
            why += f"; torch {torch.__version__} is a CPU-only build"
        fix = "run on a machine with an NVIDIA GPU (sm75+) and a CUDA build of torch"
        return Check("CUDA GPU", False, why, fix), Check("GPU capability", False, "no GPU", fix)
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    cap = torch.cuda.get_device_capability(idx)
    gpu = Check(
        "CUDA GPU",
        True,
        f"{torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}",
    )
    need = MARLIN_FP4_MIN_CAPABILITY
    ok = tuple(cap) >= need
    capc = Check(
        "GPU capability",
        ok,
        f"sm_{cap[0]}{cap[1]} (vLLM's Marlin FP4 needs sm_{need[0]}{need[1]}+)",
        "" if ok else f"use a GPU of compute capability {need[0]}.{need[1]} or newer (Turing/Ampere/Hopper/Blackwell)",
    )
    return gpu, capc


def check_entry_point(framework: str) -> Check:
    group, name, value = ENTRY_POINTS[framework]
    eps = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
    label = f"{group}:{name}"
    if not eps:
        return Check(label, False, "not registered", "install qerl-plugin (pip install qerl-plugin, or pip install -e . in the repo)")
    ep = eps[0]
    if ep.value != value:
        return Check(label, False, f"points to {ep.value}, expected {value}", "reinstall qerl-plugin")
    return Check(label, True, f"-> {ep.value}")


def check_quantize_import() -> Check:
    try:
        import qerl_plugin.quantize  # noqa: F401
    except Exception as exc:
        return Check("qerl_plugin.quantize", False, f"does not import ({type(exc).__name__}: {exc})", "reinstall qerl-plugin")
    return Check("qerl_plugin.quantize", True, "imports")


# ---------------------------------------------------------------------------------------------------
# checks that import vLLM / verl, in a child process

_PROBE = r"""
import json, sys
from importlib import metadata
res = {}
def attempt(key, fn):
    try:
        res[key] = {"ok": True, **(fn() or {})}
    except BaseException as exc:
        res[key] = {"ok": False, "error": (type(exc).__name__ + ": " + str(exc)).splitlines()[0][:400]}

def vllm_import():
    import vllm
    return {"version": vllm.__version__}

def marlin():
    import importlib
    import torch
    errors = []
    for lib in %(libs)r:
        try:
            importlib.import_module(lib)
            break
        except ImportError as exc:
            errors.append(lib + ": " + str(exc).splitlines()[0][:160])
    else:
        raise ImportError("no compiled vLLM ops library: " + "; ".join(errors))
    ops = {name: hasattr(torch.ops._C, name) for name in %(ops)r}
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported
    missing = [n for n, ok in ops.items() if not ok]
    if missing:
        raise RuntimeError("torch.ops._C lacks " + ", ".join(missing))
    return {"ops": ops, "fp4_marlin_supported": bool(is_fp4_marlin_supported())}

def entry(group, name):
    eps = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
    if not eps:
        raise LookupError("no entry point " + name + " in " + group)
    return eps[0]

def vllm_plugin():
    fn = entry("vllm.general_plugins", "qerl").load()
    fn()  # what vLLM does in every process
    fn()  # and it must be safe to do twice
    return {}

def verl_import():
    import verl
    return {"version": getattr(verl, "__version__", "?")}

def verl_plugin():
    ep = entry("verl.plugins", "qerl")
    import verl  # its loader imports plugin modules and hides errors at DEBUG
    loaded = ep.value.split(":")[0] in sys.modules
    ep.load()  # surfaces the error verl would hide
    return {"loaded_by_verl": loaded}

attempt("vllm", vllm_import)
if res["vllm"]["ok"]:
    attempt("marlin", marlin)
    attempt("vllm_plugin", vllm_plugin)
attempt("verl", verl_import)
if res["verl"]["ok"]:
    attempt("verl_plugin", verl_plugin)
print(%(mark)r + json.dumps(res), flush=True)
""" % {"ops": MARLIN_OPS, "libs": VLLM_OPS_LIBS, "mark": _PROBE_MARK}


def run_probe(timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Import vLLM and verl in a child process; returns ``{key: {"ok": bool, ...}}`` or ``{"error": ...}``."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return {"error": f"importing vLLM/verl took more than {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_PROBE_MARK):
            return json.loads(line[len(_PROBE_MARK) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the import probe exited with {proc.returncode}: {tail[:400]}"}


def _probe_check(probe: dict, key: str, name: str, fix: str, ok_detail) -> Check:
    if "error" in probe:
        return Check(name, False, f"not checked: {probe['error']}", fix)
    r = probe.get(key)
    if r is None:
        return Check(name, False, "not checked (a prerequisite failed)", fix)
    if not r["ok"]:
        return Check(name, False, r["error"], fix)
    return Check(name, True, ok_detail(r))


# ---------------------------------------------------------------------------------------------------
# the report


def collect(probe: dict | None = None) -> dict[str, Check]:
    checks: dict[str, Check] = {}
    for c in (check_python(), *map(check_package, PACKAGES), check_quantize_import()):
        checks[c.name] = c
    gpu, cap = check_cuda()
    checks[gpu.name], checks[cap.name] = gpu, cap
    for fw in ENTRY_POINTS:
        c = check_entry_point(fw)
        checks[f"{fw} entry point"] = c
    if probe is None:
        probe = run_probe() if (checks["vllm"].ok or checks["verl"].ok) else {}
    pin_vllm = PINS["vllm"]
    checks["vllm import"] = _probe_check(
        probe, "vllm", "vllm import", f"pip install vllm=={pin_vllm}", lambda r: f"vllm {r['version']} imports"
    )
    checks["Marlin FP4 op"] = _probe_check(
        probe,
        "marlin",
        "Marlin FP4 op",
        "install a CUDA build of vLLM (its compiled vllm._C_stable_libtorch provides torch.ops._C.marlin_gemm)",
        lambda r: "torch.ops._C." + " / ".join(MARLIN_OPS) + " present"
        + ("" if r.get("fp4_marlin_supported") else "; vLLM says FP4 Marlin is not supported on this device"),
    )
    checks["vllm plugin loads"] = _probe_check(
        probe, "vllm_plugin", "vllm plugin loads", "see the error; reinstall qerl-plugin", lambda r: "vllm_ext:register() runs (twice)"
    )
    checks["verl import"] = _probe_check(
        probe, "verl", "verl import", f"pip install verl=={PINS['verl']}", lambda r: f"verl {r['version']} imports"
    )
    checks["verl plugin loads"] = _probe_check(
        probe,
        "verl_plugin",
        "verl plugin loads",
        "see the error; reinstall qerl-plugin",
        lambda r: "verl_ext imports" + (" (verl's loader picked it up)" if r.get("loaded_by_verl") else " (but verl's loader did not import it)"),
    )
    if checks["verl plugin loads"].ok and "not import it" in checks["verl plugin loads"].detail:
        checks["verl plugin loads"].warnings.append("verl did not import verl_ext on `import verl`")
    return checks


# job -> (required checks, recommended checks)
REQUIREMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "quantize": (
        ("python", "torch", "safetensors", "compressed-tensors", "huggingface-hub", "tqdm", "qerl_plugin.quantize"),
        (),
    ),
    "rollout": (
        ("python", "torch", "CUDA GPU", "GPU capability", "vllm import", "Marlin FP4 op", "vllm entry point", "vllm plugin loads"),
        ("compressed-tensors",),
    ),
    "serve": (("python", "torch", "CUDA GPU", "GPU capability", "vllm import", "Marlin FP4 op"), ("vllm entry point", "vllm plugin loads")),
    "train": (
        (
            "python", "torch", "CUDA GPU", "GPU capability", "vllm import", "Marlin FP4 op", "vllm entry point",
            "vllm plugin loads", "verl import", "verl entry point", "verl plugin loads", "peft", "transformers",
        ),
        ("compressed-tensors",),
    ),
}  # fmt: skip


def jobs_status(checks: dict[str, Check]) -> dict[str, dict]:
    out = {}
    for job, (required, recommended) in REQUIREMENTS.items():
        failed = [n for n in required if not checks[n].ok]
        if "CUDA GPU" in failed and "GPU capability" in failed:
            failed.remove("GPU capability")  # no GPU, nothing more to say about its capability
        missing = [f"{n}: {checks[n].detail}" for n in failed]
        fixes = list(dict.fromkeys(checks[n].fix for n in failed if checks[n].fix))
        warnings = [w for n in required + recommended for w in checks[n].warnings]
        warnings += [f"{n}: {checks[n].detail}" for n in recommended if not checks[n].ok]
        out[job] = {"ready": not missing, "missing": missing, "fixes": fixes, "warnings": warnings}
    return out


def report(jobs: list[str] | None = None, probe: dict | None = None) -> dict:
    """The whole report as plain data (what ``--json`` prints)."""
    from qerl_plugin import __version__

    checks = collect(probe)
    status = jobs_status(checks)
    asked = jobs or []
    blocking = asked or ["quantize"]
    return {
        "qerl_plugin": __version__,
        "checks": {k: asdict(c) for k, c in checks.items()},
        "jobs": status,
        "requested": asked,
        "exit_code": 0 if all(status[j]["ready"] for j in blocking) else 1,
    }


def format_report(data: dict) -> str:
    lines = [f"qerl doctor (qerl-plugin {data['qerl_plugin']})", "", "environment"]
    width = max(len(k) for k in data["checks"])
    for name, c in data["checks"].items():
        mark = "ok " if c["ok"] else "-- "
        lines.append(f"  {mark} {name:<{width}}  {c['detail']}")
        for w in c["warnings"]:
            lines.append(f"      {'':<{width}}  warning: {w}")
    lines += ["", "jobs"]
    for job, s in data["jobs"].items():
        if data["requested"] and job not in data["requested"]:
            continue
        state = "ready" if s["ready"] else "NOT READY"
        lines.append(f"  {job:<9} {state}")
        for m in s["missing"]:
            lines.append(f"            missing: {m}")
        for f in s["fixes"]:
            lines.append(f"            fix: {f}")
        for w in s["warnings"]:
            lines.append(f"            warning: {w}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", action="append", choices=JOBS, help="check only this job (repeatable); its readiness sets the exit status")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    jobs = list(dict.fromkeys(args.job or []))
    data = report(jobs)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_report(data))
    return data["exit_code"]
