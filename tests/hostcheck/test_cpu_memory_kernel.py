"""CPU, memory and kernel probes against the three fixture hosts and an empty root."""
from __future__ import annotations

from hostcheck.cpu import probe_cpu, read_cpu_mhz
from hostcheck.facts import Unavailable
from hostcheck.kernel import cmdline_params, probe_kernel
from hostcheck.memory import probe_memory, selected_choice

from .trees import APU_CMDLINE, FakeRunner


def test_cpu_on_the_apu(apu):
    c = probe_cpu(apu, FakeRunner())
    assert c.model == "AMD RYZEN AI MAX+ 395 w/ Radeon 8060S" and c.vendor == "AuthenticAMD"
    assert (c.logical_cpus, c.physical_cores, c.smt_active, c.smt_control) == (32, 16, True, "on")
    assert c.virtual_machine is False
    assert (c.governor, c.scaling_driver, c.energy_perf_preference) == (
        "powersave", "amd-pstate-epp", "balance_power")
    assert c.boost is True
    assert c.max_mhz == 5187.0
    assert c.cur_mhz == 2950.0  # median of 3000, 1200, 3100, 2900 MHz repeated over 32 CPUs


def test_cpu_on_the_desktop_counts_hybrid_cores(desktop):
    c = probe_cpu(desktop, FakeRunner())
    assert (c.logical_cpus, c.physical_cores) == (32, 24)  # 8 P-cores x 2 + 16 E-cores
    assert (c.governor, c.scaling_driver) == ("performance", "intel_pstate")
    assert c.boost is True  # intel_pstate/no_turbo = 0
    assert c.max_mhz == 5800.0


def test_cpu_in_the_vm_says_why_frequency_facts_are_missing(vm):
    c = probe_cpu(vm, FakeRunner())
    assert (c.model, c.logical_cpus, c.physical_cores) == ("AMD EPYC", 2, 2)
    assert c.virtual_machine is True
    assert (c.smt_active, c.smt_control) == (False, "notsupported")
    for fact in (c.governor, c.scaling_driver, c.energy_perf_preference, c.max_mhz):
        assert isinstance(fact, Unavailable) and "virtual machine" in fact.reason
    assert c.cur_mhz == 2596.132  # from /proc/cpuinfo when cpufreq is absent


def test_mixed_governors_are_reported_as_such(apu):
    (apu / "sys/devices/system/cpu/cpu3/cpufreq/scaling_governor").write_text("performance\n")
    assert probe_cpu(apu, FakeRunner()).governor == "mixed: powersave x31, performance x1"


def test_cpu_model_falls_back_to_lscpu(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nCPU implementer\t: 0x41\n\n")
    run = FakeRunner({"lscpu": "Architecture: aarch64\nModel name:   Cortex-X925\n"})
    c = probe_cpu(tmp_path, run)
    assert c.model == "Cortex-X925" and c.vendor == "0x41" and c.logical_cpus == 1


def test_memory(apu, vm):
    m = probe_memory(apu, FakeRunner())
    assert m.total_bytes == 133693440 * 1024 and m.available_bytes == 125829120 * 1024
    assert (m.thp_enabled, m.thp_defrag) == ("madvise", "madvise")
    assert probe_memory(vm, FakeRunner()).total_bytes == 24684084 * 1024
    assert selected_choice("[always] madvise never") == "always"


def test_kernel(apu, desktop):
    k = probe_kernel(apu, FakeRunner())
    assert k.release == "6.17.0-5-generic" and k.distribution == "Ubuntu 24.04.3 LTS"
    assert k.cmdline == APU_CMDLINE
    assert k.params["iommu"] == "pt" and k.params["amdgpu.gttsize"] == "65536"
    assert probe_kernel(desktop, FakeRunner()).distribution == "Debian GNU/Linux 12 (bookworm)"


def test_cmdline_params_stop_at_init_arguments():
    p = cmdline_params('quiet iommu=pt foo="a b" iommu=off -- --addr 0.0.0.0:2024 x=1')
    assert p == {"quiet": "", "iommu": "off", "foo": "a b"}


def test_missing_files_are_unavailable_not_errors(empty):
    run = FakeRunner()
    c, m, k = probe_cpu(empty, run), probe_memory(empty, run), probe_kernel(empty, run)
    assert isinstance(c.model, Unavailable) and c.model.reason == "no /proc/cpuinfo"
    assert isinstance(c.logical_cpus, Unavailable) and isinstance(c.physical_cores, Unavailable)
    assert isinstance(read_cpu_mhz(empty), Unavailable)
    assert all(isinstance(v, Unavailable) for v in (m.total_bytes, m.thp_enabled, k.release,
                                                    k.cmdline, k.distribution))
    assert k.params == {}


def test_unreadable_and_garbled_files_are_unavailable(apu):
    smt = apu / "sys/devices/system/cpu/smt/active"
    smt.unlink()
    smt.mkdir()  # reading a directory fails with an OSError that is not FileNotFoundError
    (apu / "proc/meminfo").write_text("MemTotal: lots kB\n")
    c, m = probe_cpu(apu, FakeRunner()), probe_memory(apu, FakeRunner())
    assert isinstance(c.smt_active, Unavailable) and "failed" in c.smt_active.reason
    assert isinstance(m.total_bytes, Unavailable) and "lots" in m.total_bytes.reason
