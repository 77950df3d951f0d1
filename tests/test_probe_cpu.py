"""The CPU probe's figures survive oneDNN's verbose log on its stdout, and its cache is keyed on
what tells CPUs apart on ARM as on x86."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline import hardware
from pipeline.hardware import CAPPED_ISA, ISA_CAPS, cpu_key, cpu_profile

ARMV8 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"
GRAVITON2 = f"""processor\t: 0
BogoMIPS\t: 243.75
Features\t: {ARMV8} lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""
GRAVITON3 = f"""processor\t: 0
BogoMIPS\t: 2100.00
Features\t: {ARMV8} jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit \
uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8488C
cpu MHz\t\t: 2400.000
flags\t\t: fpu vme de pse avx512f avx512_bf16 amx_bf16 amx_tile
bogomips\t: 4800.00
"""


def key_for(cpuinfo: str, monkeypatch: pytest.MonkeyPatch) -> str:
    real = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        return cpuinfo if str(self) == "/proc/cpuinfo" else real(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "read_text", read_text)
        return cpu_key()


@pytest.fixture
def no_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_caps")
def test_arm_cpus_get_their_own_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graviton2 (no bf16) and Graviton3 (bf16) shared one key: one cached probe for both."""
    assert key_for(GRAVITON2, monkeypatch) != key_for(GRAVITON3, monkeypatch)


@pytest.mark.usefixtures("no_caps")
def test_volatile_cpuinfo_fields_do_not_change_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    slower = GRAVITON3.replace("2100.00", "1050.00")
    assert key_for(slower, monkeypatch) == key_for(GRAVITON3, monkeypatch)
    idle = XEON.replace("2400.000", "800.000").replace("4800.00", "1600.00")
    assert key_for(idle, monkeypatch) == key_for(XEON, monkeypatch)


@pytest.mark.usefixtures("no_caps")
def test_an_x86_key_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its model name and flags alone, as before the ARM fields: cached probes stay valid."""
    lines = "".join(line for line in XEON.splitlines()
                    if line.startswith(("flags", "model name")))
    caps = "|".join(f"{name}=" for name in ISA_CAPS)
    before = hashlib.sha256(f"{lines}|{caps}|{torch.__version__}".encode()).hexdigest()[:16]
    assert key_for(XEON, monkeypatch) == before


def test_only_the_probes_marked_line_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other stdout lines (oneDNN's verbose log, even one that parses as JSON) are ignored."""
    figures = {"fp32_gflops": 200.0, "bf16_gflops": 400.0}
    stdout = "\n".join(["onednn_verbose,info,oneDNN v3.5", '{"bf16_gflops": 1}',
                        hardware.PROBE_MARK + '{"fp32_gflops": 200.0, "bf16_gflops": 400.0}',
                        "onednn_verbose,primitive,exec,cpu,matmul"])

    def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(args, 0, stdout=stdout, stderr="")

    monkeypatch.setattr(hardware.subprocess, "run", run)
    assert hardware._run_probe({}) == dict.fromkeys(hardware.FP32_KERNEL_FIGURES) | figures


@pytest.mark.skipif(not cpu_profile()["bf16_ok"], reason="this CPU cannot run bf16")
def test_the_probe_runs_with_onednn_verbose() -> None:
    """ONEDNN_VERBOSE=1 writes oneDNN's log to the probe's stdout; every line was parsed as
    the probe's JSON, and the first log line killed it."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    if cpu_profile()["amx_traps"]:
        env["ONEDNN_MAX_CPU_ISA"] = CAPPED_ISA
    figures = hardware._run_probe(env)
    assert figures is not None
    assert figures["fp32_gflops"] > 0 and figures["bf16_gflops"] > 0


def test_a_probe_that_runs_out_of_time_concludes_nothing_and_caches_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine is not a trapping one: the run takes the safe path (fp32, AMX capped)
    and the next process measures again (a timeout was cached as AMX trapping, for good)."""
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(hardware, "_PROBE", "import time; time.sleep(60)")
    monkeypatch.setattr(hardware, "PROBE_TIMEOUT_S", 1)
    cpu_profile.cache_clear()
    try:
        with pytest.raises(hardware.ProbeTimedOut):
            hardware._run_probe(dict(os.environ))
        profile = cpu_profile()
    finally:
        cpu_profile.cache_clear()
    assert profile == hardware.UNMEASURED and not profile["bf16_ok"] and profile["amx_traps"]
    assert not list(tmp_path.glob("cpu-probe-*.json"))
