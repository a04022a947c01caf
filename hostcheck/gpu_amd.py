"""AMD GPUs through amdgpu's sysfs (memory, clocks), KFD topology (arch) and /opt/rocm (runtime).

amdgpu reports memory in bytes (`mem_info_vram_total`, `mem_info_gtt_total`), the shader clock
in Hz on its hwmon (`freq1_input`) and its DPM states in `pp_dpm_sclk` (`*` marks the current
one). KFD's `gfx_target_version` (e.g. 110501) encodes the ISA: major, minor, stepping.
"""
from __future__ import annotations

import re

from .facts import Fs, Runner, Unavailable, key_values
from .gpu_types import GpuInfo, GttLimits
from .kernel import cmdline_params

KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
# ISAs of APUs, whose GPU uses the host's memory through GTT: Strix Halo, Strix / Krackan Point,
# Phoenix / Hawk Point, Rembrandt / Raphael / Mendocino, Renoir / Cezanne, Raven / Picasso.
APU_ARCHS = frozenset({"gfx1151", "gfx1150", "gfx1152", "gfx1153", "gfx1103", "gfx1035",
                       "gfx1036", "gfx1037", "gfx90c", "gfx902", "gfx909"})
PAGE_BYTES = 4096  # ttm.pages_limit counts 4 KiB pages on x86-64


def probe_amd_card(fs: Fs, run: Runner, dev: str, uevent: dict[str, str]) -> GpuInfo:
    """One amdgpu device; `dev` is its sysfs device directory (/sys/class/drm/cardN/device)."""
    slot = uevent.get("PCI_SLOT_NAME")
    arch = _arch(fs, run, slot)
    cur, top = _clocks(fs, dev)
    return GpuInfo(
        vendor="AMD",
        name=_name(fs, run, dev, uevent),
        arch=arch,
        pci_slot=slot or Unavailable(f"no PCI_SLOT_NAME in {dev}/uevent"),
        driver=_driver(fs),
        runtime=rocm_version(fs),
        vram_bytes=fs.read_int(f"{dev}/mem_info_vram_total"),
        gtt_bytes=fs.read_int(f"{dev}/mem_info_gtt_total"),
        unified=(arch in APU_ARCHS) if isinstance(arch, str) else Unavailable(
            "the GPU's ISA is unknown, so whether it is an APU is too"),
        cur_mhz=cur, max_mhz=top,
        source=dev.rsplit("/device", 1)[0],
    )


def gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version to the ISA name: 110501 -> gfx1151, 90010 -> gfx90a."""
    major, minor, step = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def gtt_limits(fs: Fs) -> GttLimits:
    cmdline = fs.read("/proc/cmdline")
    params = cmdline_params(cmdline) if isinstance(cmdline, str) else {}
    booted = {k: v for k, v in params.items()
              if k == "amdgpu.gttsize" or k.startswith("ttm.") or k.startswith("amdttm.")}
    return GttLimits(
        ttm_pages_limit=fs.read_int("/sys/module/ttm/parameters/pages_limit"),
        amdgpu_gttsize_mib=fs.read_int("/sys/module/amdgpu/parameters/gttsize"),
        cmdline=booted,
    )


def rocm_version(fs: Fs) -> str | Unavailable:
    candidates = ["/opt/rocm/.info/version"] + list(reversed(fs.glob("/opt/rocm-*/.info/version")))
    for p in candidates:
        text = fs.read(p)
        if isinstance(text, str) and text:
            return f"ROCm {text.splitlines()[0].strip()}"
    return Unavailable("no /opt/rocm/.info/version (ROCm not installed under /opt)")


def _arch(fs: Fs, run: Runner, slot: str | None) -> str | Unavailable:
    nodes = fs.glob(f"{KFD_NODES}/*/properties")
    for p in nodes:
        props = _properties(fs.read(p))
        target = props.get("gfx_target_version", 0)
        if target and (slot is None or _location(slot) == (props.get("domain", 0),
                                                           props.get("location_id"))):
            return gfx_name(target)
    out = run(["rocminfo"])
    names = [a.get("Name", "") for a in rocminfo_gpus(out)]
    if names and names[0].startswith("gfx"):
        return names[0]
    why = "no matching KFD topology node" if nodes else f"no {KFD_NODES} (amdkfd not loaded)"
    return Unavailable(why + ("" if isinstance(out, str) else f"; {out.reason}"))


def rocminfo_gpus(out: str | Unavailable) -> list[dict[str, str]]:
    """The GPU agents of `rocminfo` output, each as its `key: value` lines."""
    if isinstance(out, Unavailable):
        return []
    agents = [key_values(block) for block in re.split(r"^\s*Agent \d+\s*$", out, flags=re.M)[1:]]
    return [a for a in agents if a.get("Device Type") == "GPU"]


def _properties(text: str | Unavailable) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines() if isinstance(text, str) else []:
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _location(slot: str) -> tuple[int, int] | None:
    """0000:c5:00.0 -> (domain, bus << 8 | device << 3 | function), KFD's location_id."""
    m = re.fullmatch(r"([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", slot.lower())
    if m is None:
        return None
    domain, bus, dev, fn = (int(x, 16) for x in m.groups())
    return domain, bus << 8 | dev << 3 | fn


def _name(fs: Fs, run: Runner, dev: str, uevent: dict[str, str]) -> str | Unavailable:
    name = fs.read(f"{dev}/product_name")
    if isinstance(name, str) and name:
        return name
    out = run(["rocminfo"])
    names = [a["Marketing Name"] for a in rocminfo_gpus(out) if a.get("Marketing Name")]
    if names:
        return names[0]
    pci_id = uevent.get("PCI_ID", "?")
    return Unavailable(f"no product_name in sysfs for PCI id {pci_id}"
                       + ("" if isinstance(out, str) else f"; {out.reason}"))


def _driver(fs: Fs) -> str | Unavailable:
    version = fs.read("/sys/module/amdgpu/version")
    if isinstance(version, str) and version:
        return f"amdgpu {version} (out of tree)"
    if not fs.exists("/sys/module/amdgpu"):
        return Unavailable("amdgpu module not loaded")
    release = fs.read("/proc/sys/kernel/osrelease")
    return "amdgpu (in-tree" + (f", kernel {release})" if isinstance(release, str) else ")")


def _clocks(fs: Fs, dev: str) -> tuple[float | Unavailable, float | Unavailable]:
    states = dpm_states(fs.read(f"{dev}/pp_dpm_sclk"))
    cur = read_amd_sclk_mhz(fs, dev)
    if isinstance(states, Unavailable):
        return cur, states
    return cur, max(mhz for mhz, _ in states)


def read_amd_sclk_mhz(fs: Fs, dev: str) -> float | Unavailable:
    """The shader clock now: hwmon freq1_input (Hz), else the `*` state of pp_dpm_sclk."""
    for hw in fs.glob(f"{dev}/hwmon/hwmon*"):
        label = fs.read(f"{hw}/freq1_label")
        hz = fs.read_int(f"{hw}/freq1_input")
        if isinstance(hz, int) and (not isinstance(label, str) or label == "sclk"):
            return hz / 1e6
    states = dpm_states(fs.read(f"{dev}/pp_dpm_sclk"))
    if isinstance(states, Unavailable):
        return states
    current = [mhz for mhz, on in states if on]
    return current[0] if current else Unavailable("no current state marked in pp_dpm_sclk")


def dpm_states(text: str | Unavailable) -> list[tuple[float, bool]] | Unavailable:
    """`0: 600Mhz\\n1: 2900Mhz *` -> [(600.0, False), (2900.0, True)]."""
    if isinstance(text, Unavailable):
        return text
    states = [(float(m.group(1)), bool(m.group(2)))
              for m in re.finditer(r"^\s*\w+:\s*(\d+)\s*Mhz\s*(\*)?", text, re.M | re.I)]
    return states or Unavailable("pp_dpm_sclk lists no states")


def uevent_of(fs: Fs, dev: str) -> dict[str, str]:
    text = fs.read(f"{dev}/uevent")
    return key_values(text, "=") if isinstance(text, str) else {}
