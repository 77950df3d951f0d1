"""What this machine's hardware really does, measured once and cached.

Some CPUs advertise AMX while the virtual machine they run in does not enable it: oneDNN
then dies with SIGILL on the first bf16 matrix multiply. We never trust the flags. A child
process multiplies bf16 and fp32 matrices; if it crashes, oneDNN is capped below AMX for
this process (before torch runs any CPU kernel) and bf16 is measured again. The result
(does bf16 work, how fast against fp32) is cached per machine and torch version.

oneDNN (bf16 and int8 matrix work on a CPU) JIT-compiles a kernel for every input shape and
keeps it in two caches of 1,024 entries each (its own primitive cache and ideep's
``LRU_CACHE_CAPACITY``). An embedding run feeds a new batch shape almost every batch, so
without a bound its memory grows with the corpus: ``embedpipe embed`` of 200,000 PyPI
summaries through a tiny encoder in bf16 peaked at 1,278 MB where 20,000 rows peaked at 808
MB; in library calls over the 200,000 rows, 1,389 MB with the default caches and 657 MB with
both at 64, no slower (7.4 s vs 7.8 s). The fused forward's products now take a few row counts
(``pipeline.onednn.product_rows``: 14 up to 8,192, four products each), which oneDNN's cache
keeps at 128 entries beside the attention's batched products. MiniLM in bf16 on a 2-core AMX
Xeon VM, PyPI summaries 10,000 at a time: the second 10,000 compiled 8 product kernels (80
with 64 entries); over 50,000, 1.1x faster than with 64 entries, peak RSS the same 1,042 MB.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from pipeline.settings import cache_root, write_cache

CAPPED_ISA = "AVX512_CORE_BF16"
# the probe's fp32 figures timed only where this torch has oneDNN's fp32 product (else None):
# oneDNN's over a plain weight, and an up product with its bias and GELU: MKL's then ATen's
# GELU, oneDNN's with the GELU in its epilogue, and oneDNN's then ATen's GELU in place
FP32_KERNEL_FIGURES = ("fp32_onednn_gflops", "fp32_gelu_gflops", "fp32_onednn_gelu_gflops",
                       "fp32_onednn_gelu_apart_gflops")
PROFILE_FIGURES = ("fp32_gflops", "bf16_gflops", *FP32_KERNEL_FIGURES)  # GFLOP/s or None
PROFILE_FLAGS = ("bf16_ok", "amx_traps")
GELU_APART_MIN_GAIN = 1.05  # a GELU pass after the product must win by this (``fp32_gelu_apart``)
# what caps oneDNN's, ATen's and MKL's CPU kernels below what the CPU has
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
            "MKL_ENABLE_INSTRUCTIONS")
# kernels kept per cache: the products' ladder of shapes and the attention's recent ones (a
# user's setting wins)
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "64"}
PROBE_TIMEOUT_S = 120  # the probe takes seconds; past this the machine is too loaded to tell
# what a process runs with when the probe could not finish: nothing measured, bf16 not taken,
# AMX capped as if it trapped (never cached: the next process measures)
UNMEASURED = {"fp32_gflops": None, "bf16_gflops": None, **dict.fromkeys(FP32_KERNEL_FIGURES),
              "bf16_ok": False, "amx_traps": True}
# the probe's one line of figures starts with this; its other stdout (ONEDNN_VERBOSE's log) is not
PROBE_MARK = "embedpipe-probe: "
# /proc/cpuinfo lines that tell CPUs apart: x86's model name and flags; ARM's features, maker
# and part (its cpuinfo has no model name); never the volatile MHz or BogoMIPS
CPU_ID_FIELDS = ("flags", "model name", "Features", "CPU implementer", "CPU variant", "CPU part")

_PROBE = r"""
import json, time, torch
torch.manual_seed(0)
a, b, bias = torch.randn(512, 384), torch.randn(384, 1536), torch.randn(1536)
a16, b16, w = a.bfloat16(), b.bfloat16(), b.t().contiguous()
kernels = {"fp32_gflops": lambda: a @ b, "bf16_gflops": lambda: a16 @ b16}
for kernel in kernels.values():
    kernel()  # bf16 on AMX that traps dies here: no line, and the caller probes again capped
linear_pointwise = torch.ops.mkldnn._linear_pointwise
try:  # fp32 through oneDNN's inner product (pipeline.onednn), where this torch has it: over a
    # plain weight (a model's own Linear), and as the fused forward's up product runs it
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    plain = lambda: linear_pointwise(a, w, None, "none", [], "")
    epilogue = lambda: linear_pointwise(a, packed, bias, "gelu", [], "none")
    plain(), epilogue()  # raise here where this torch lacks them
    kernels |= {
        "fp32_onednn_gflops": plain,
        "fp32_gelu_gflops": lambda: torch.nn.functional.gelu(
            torch.nn.functional.linear(a, w, bias)),
        "fp32_onednn_gelu_gflops": epilogue,
        "fp32_onednn_gelu_apart_gflops": lambda: torch.ops.aten.gelu_(
            linear_pointwise(a, packed, bias, "none", [], "")),
    }
except (RuntimeError, AttributeError):
    pass
# the kernels take turns, 5 products each, for ~1.2 s; the best round of each counts: a load that
# comes and goes (a first run starts the Prefect API meanwhile) reaches them all alike. An
# emulated bf16 (no hardware path: ~1 GFLOP/s) costs one round, not a minute.
best, end = dict.fromkeys(kernels, float("inf")), time.perf_counter() + 1.2
while time.perf_counter() < end:
    for name, kernel in kernels.items():
        t = time.perf_counter()
        for _ in range(5):
            kernel()
        best[name] = min(best[name], time.perf_counter() - t)
print(MARK + json.dumps({name: 5 * 2 * 512 * 384 * 1536 / s / 1e9 for name, s in best.items()}))
"""


def cpu_key() -> str:
    """This CPU (its ``CPU_ID_FIELDS``), the instruction sets its kernels are capped to (the
    variables below: the same CPU runs other kernels under them) and torch's version, as a short
    hash. An x86 CPU's key is what it was before the ARM fields counted (it has none of them)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(CPU_ID_FIELDS):
                flags += line
    except OSError:
        flags = platform.processor()
    import torch

    caps = "|".join(f"{name}={os.environ.get(name, '')}" for name in ISA_CAPS)
    return hashlib.sha256(f"{flags}|{caps}|{torch.__version__}".encode()).hexdigest()[:16]


def _cache_file() -> Path:
    return cache_root() / f"cpu-probe-v3-{cpu_key()}.json"  # v3: the fused up product too


class ProbeTimedOut(Exception):
    """The probe ran past ``PROBE_TIMEOUT_S`` before bf16 was measured: a loaded machine, not
    a trap; nothing is concluded (or cached) from it."""


def _run_probe(env: dict[str, str]) -> dict | None:
    """The probe's figures; None when it died before bf16 was measured (oneDNN's bf16 trapped);
    ``ProbeTimedOut`` when it was still running then. A failure of the oneDNN fp32 timings
    alone leaves their figures None."""
    script = f"MARK = {PROBE_MARK!r}\n{_PROBE}"
    timed_out = False
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
        out = done.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        timed_out = True
    figures: dict = dict.fromkeys(FP32_KERNEL_FIGURES)
    for line in out.splitlines():  # oneDNN's verbose log may share stdout: only our line counts
        if line.startswith(PROBE_MARK):
            figures.update(json.loads(line.removeprefix(PROBE_MARK)))
    if "bf16_gflops" in figures:
        return figures
    if timed_out:
        raise ProbeTimedOut
    return None


def _measure() -> dict:
    env = dict(os.environ)
    result = None if env.get("ONEDNN_MAX_CPU_ISA") else _run_probe(env)
    if result is not None:
        return {**result, "bf16_ok": True, "amx_traps": False}
    env["ONEDNN_MAX_CPU_ISA"] = env.get("ONEDNN_MAX_CPU_ISA") or CAPPED_ISA
    capped = _run_probe(env)
    traps = not os.environ.get("ONEDNN_MAX_CPU_ISA")
    if capped is None:
        return {"fp32_gflops": None, "bf16_gflops": None, **dict.fromkeys(FP32_KERNEL_FIGURES),
                "bf16_ok": False, "amx_traps": traps}
    return {**capped, "bf16_ok": True, "amx_traps": traps}


@lru_cache(maxsize=1)
def cpu_profile() -> dict:
    """{'fp32_gflops', 'bf16_gflops', the ``FP32_KERNEL_FIGURES``, 'bf16_ok', 'amx_traps'} for this
    machine (cached; measured again where the cache cannot serve, ``_read_profile``)."""
    cache = _cache_file()
    profile = _read_profile(cache)
    if profile is None:
        try:
            profile = _measure()
        except ProbeTimedOut:  # this process runs safe (fp32, AMX capped); the next measures
            return dict(UNMEASURED)
        write_cache(cache, profile)
    return profile


def _read_profile(cache: Path) -> dict | None:
    """The cached profile, or None where it cannot serve: unreadable, or without a figure or
    flag this code reads (an older probe's, which would quietly take a missing figure as
    "not measured": the capped up product's GELU stayed in its epilogue that way)."""
    try:
        profile = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(profile, dict):
        return None
    figures = all(_figure(profile.get(name, "")) for name in PROFILE_FIGURES)
    flags = all(isinstance(profile.get(name), bool) for name in PROFILE_FLAGS)
    return profile if figures and flags else None


def _figure(value: object) -> bool:
    """A probe's figure: a number, or None where it was not measured."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def prepare_cpu_kernels() -> None:
    """Bound oneDNN's kernel caches, and cap oneDNN below AMX when AMX traps here.

    Must run before torch's first CPU kernel (both are read once, from the environment)."""
    for name, value in ONEDNN_CACHES.items():
        os.environ.setdefault(name, value)
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or not _advertises_amx():
        return
    if cpu_profile()["amx_traps"]:
        os.environ["ONEDNN_MAX_CPU_ISA"] = CAPPED_ISA


def amx_runs() -> bool:
    """True where the CPU advertises AMX's bf16 tiles and they do not trap here (the probe):
    torch's own bf16 kernels that pack for AMX (SDPA's flash attention among them) run."""
    return _advertises_amx() and not cpu_profile()["amx_traps"]


def aten_avx512() -> bool:
    """Whether ATen runs its AVX-512 kernels here (not an AVX2 CPU, nor capped to AVX2 by
    ``ATEN_CPU_CAPABILITY``): where the fused forward's attention kernels were measured."""
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _advertises_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cpu_bf16_is_faster() -> bool:
    """True when bf16 matrix work runs correctly here and faster than torch's default fp32
    products (by 20% or more): a hardware path, not emulation. Only a gate: ``dtype auto``
    then times the model itself in both dtypes (fp32 through oneDNN where that is faster).
    Against oneDNN's fp32 figure the gate misjudged a first CLI run, whose probe ran while the
    local Prefect API booted: bf16 505 against oneDNN fp32 481 GFLOP/s (1,004 / 512 when quiet)."""
    profile = cpu_profile()
    if not profile["bf16_ok"] or not profile["fp32_gflops"]:
        return False
    return profile["bf16_gflops"] > 1.2 * profile["fp32_gflops"]


def cpu_fp32_onednn_is_faster(min_gain: float, fused: bool = False) -> bool:
    """True when fp32 products run through oneDNN at ``min_gain`` times torch's default (MKL)
    speed here, or faster (see ``pipeline.onednn``): as a model's own Linear runs them (a plain
    weight, no epilogue), or, ``fused``, as the fused forward's up product runs (a packed
    weight, its bias and GELU in oneDNN's epilogue or after it, ``fp32_gelu_apart``, against
    MKL's ``addmm`` then ``gelu``)."""
    profile = cpu_profile()
    if fused:
        in_epilogue, apart = _onednn_up_figures(profile)
        onednn = apart if fp32_gelu_apart() else in_epilogue
        default = profile.get("fp32_gelu_gflops")
    else:
        onednn, default = profile.get("fp32_onednn_gflops"), profile.get("fp32_gflops")
    return bool(onednn and default and onednn >= min_gain * default)


def fp32_gelu_apart() -> bool:
    """Whether oneDNN's fp32 up product runs faster here with its GELU as a pass of ATen's
    after it than in its epilogue (``pipeline.onednn.PackedLinear``): where oneDNN's kernels
    run AVX2 only, its epilogue's erf cost 8.5 ms over a [4,096 x 1,536] output, ATen's pass 4
    (2-core Xeon VM capped to AVX2; with AVX-512 the epilogue won, 14.7 against 15.5 ms)."""
    with_epilogue, apart = _onednn_up_figures(cpu_profile())
    return apart > GELU_APART_MIN_GAIN * with_epilogue


def _onednn_up_figures(profile: dict) -> tuple[float, float]:
    """The probe's oneDNN up product, GELU in its epilogue and apart (0 where not timed)."""
    return (profile.get("fp32_onednn_gelu_gflops") or 0.0,
            profile.get("fp32_onednn_gelu_apart_gflops") or 0.0)
