"""Vulkan devices as the Vulkan loader lists them (libvulkan through ctypes: no vulkaninfo needed).

What this adds to the sysfs and nvidia-smi probes is each device's type: an integrated GPU
shares the host's memory, and a CPU-type device (Mesa's lavapipe, `llvmpipe`; SwiftShader) is
software running on the host's cores, whose memory is host memory too, although it is not an
integrated GPU: llama.cpp's Vulkan backend reports it as a discrete GPU (`uma: 0`) and lists it
only when GGML_VK_VISIBLE_DEVICES names it. llama.cpp's `VulkanN` device is the one whose name
is its description.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

from .facts import Unavailable

# VkPhysicalDeviceType
TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
DEVICE_LOCAL = 0x1          # VkMemoryHeapFlagBits


@dataclass(frozen=True)
class VulkanDevice:
    name: str                # deviceName: "llvmpipe (LLVM 15.0.6, 256 bits)", "AMD Radeon Graphics (RADV GFX1151)"
    type: str                # integrated | discrete | virtual | cpu | other
    api_version: str         # "1.3.230"
    vendor_id: int
    device_local_bytes: int  # the device-local heaps, summed
    driver_version: str = ""  # driverVersion, by Vulkan's packing (NVIDIA's own: 10.8.8 bits)

    @property
    def host_memory(self) -> bool:
        """Whether what it holds is the host's memory: an integrated GPU, or software on the CPU."""
        return self.type in ("integrated", "cpu")


def version(v: int) -> str:
    """VK_MAKE_API_VERSION's packing (variant in the top 3 bits, dropped)."""
    return f"{(v >> 22) & 0x7F}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def device_local(heaps: list[tuple[int, int]]) -> int:
    """The bytes of the heaps (size, flags) flagged device-local."""
    return sum(size for size, flags in heaps if flags & DEVICE_LOCAL)


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


class _Properties(ctypes.Structure):
    """The head of VkPhysicalDeviceProperties; the limits that follow are read into `_rest`."""
    _fields_ = [("apiVersion", ctypes.c_uint32), ("driverVersion", ctypes.c_uint32),
                ("vendorID", ctypes.c_uint32), ("deviceID", ctypes.c_uint32), ("deviceType", ctypes.c_int),
                ("deviceName", ctypes.c_char * 256), ("pipelineCacheUUID", ctypes.c_uint8 * 16),
                ("_rest", ctypes.c_uint8 * 4096)]


class _Heap(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("flags", ctypes.c_uint32)]


class _MemoryProperties(ctypes.Structure):
    _fields_ = [("memoryTypeCount", ctypes.c_uint32), ("memoryTypes", ctypes.c_uint32 * 64),
                ("memoryHeapCount", ctypes.c_uint32), ("memoryHeaps", _Heap * 16)]


def _loader() -> ctypes.CDLL | Unavailable:
    name = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return Unavailable("no Vulkan loader (libvulkan.so.1)")
    lib.vkCreateInstance.argtypes = [ctypes.POINTER(_InstanceInfo), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.vkEnumeratePhysicalDevices.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                               ctypes.POINTER(ctypes.c_void_p)]
    lib.vkGetPhysicalDeviceProperties.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Properties)]
    lib.vkGetPhysicalDeviceMemoryProperties.argtypes = [ctypes.c_void_p, ctypes.POINTER(_MemoryProperties)]
    lib.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def probe_vulkan() -> tuple[VulkanDevice, ...] | Unavailable:
    """Every physical device the Vulkan loader finds, in its order. Never raises."""
    lib = _loader()
    if isinstance(lib, Unavailable):
        return lib
    info, instance = _InstanceInfo(sType=1), ctypes.c_void_p()     # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    rc = lib.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance))
    if rc != 0:
        return Unavailable(f"vkCreateInstance failed ({rc}): no Vulkan driver")
    try:
        count = ctypes.c_uint32(0)
        lib.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        lib.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        return tuple(_device(lib, handles[i]) for i in range(count.value))
    finally:
        lib.vkDestroyInstance(instance, None)


def _device(lib: ctypes.CDLL, handle: int) -> VulkanDevice:
    props, mem = _Properties(), _MemoryProperties()
    lib.vkGetPhysicalDeviceProperties(handle, ctypes.byref(props))
    lib.vkGetPhysicalDeviceMemoryProperties(handle, ctypes.byref(mem))
    heaps = [(mem.memoryHeaps[i].size, mem.memoryHeaps[i].flags) for i in range(min(mem.memoryHeapCount, 16))]
    return VulkanDevice(props.deviceName.decode(errors="replace"), TYPES.get(props.deviceType, "other"),
                        version(props.apiVersion), props.vendorID, device_local(heaps),
                        driver_text(props.driverVersion, props.vendorID))


def driver_text(v: int, vendor: int) -> str:
    """driverVersion as its vendor writes it: NVIDIA packs 10.8.8.6 bits, Mesa and most others
    Vulkan's version packing."""
    if vendor == 0x10DE:
        return f"{(v >> 22) & 0x3FF}.{(v >> 14) & 0xFF}.{(v >> 6) & 0xFF}"
    return version(v)
