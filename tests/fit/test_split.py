"""The planner's layer split over several GPUs (issue 52: RPC workers' devices and this host's),
worked out by hand from llama.cpp's rule (llama-model.cpp: layer il of the ngl on the GPUs goes
to the first GPU whose cumulative share exceeds (il - i_gpu_start) / ngl; the output is layer
n_layer). The RPC tests check the same rule against what llama.cpp allocated on two workers."""
from __future__ import annotations

import pytest

from appliance.fit import devices as dev
from appliance.fit import planner, shapes
from appliance.fit.devices import GIB, Device
from appliance.fit.planner import FitRequest, place, plan
from appliance.fit.render import render


@pytest.fixture(scope="module")
def llama8b():
    return shapes.build("Llama-3.1-8B-Q4_K_M")      # 32 layers: 33 with the output


def cpu(budget=64 * GIB):
    return Device("CPU", "cpu", budget)


def layers_on(p, name):
    return sorted(i for i, d in p.layers.items() if d == name)


def test_shares_split_the_layers_as_llama_cpp_does(llama8b):
    devices = [cpu(), Device("GPU0", "gpu", 40 * GIB, remote=True), Device("GPU1", "gpu", 40 * GIB)]
    p = place(llama8b, FitRequest(n_ctx=4096, tensor_split=(1, 3)), devices, 33, 0, 0)
    # shares 1:3: il / 33 < 0.25 for il <= 8
    assert layers_on(p, "GPU0") == list(range(0, 9)) and layers_on(p, "GPU1") == list(range(9, 32))
    assert p.where["output.weight"] == "GPU1" and p.where["token_embd.weight"] == "CPU"
    assert p.to_dict()["split"] == {"GPU0": 0.25, "GPU1": 0.75} and p.gpu == "GPU0"
    text = render(llama8b, p)
    assert "layer split: GPU0 25%, GPU1 75% (--tensor-split)" in text
    assert "attention + KV  layers 0-8 on GPU0" in text and "attention + KV  layers 9-31 on GPU1" in text


def test_by_default_each_gpu_takes_layers_in_proportion_to_its_memory(llama8b):
    devices = [cpu(), Device("GPU0", "gpu", 30 * GIB), Device("GPU1", "gpu", 10 * GIB)]
    p = place(llama8b, FitRequest(n_ctx=4096), devices, 33, 0, 0)
    # 3:1: il / 33 < 0.75 for il <= 24
    assert layers_on(p, "GPU0") == list(range(0, 25)) and layers_on(p, "GPU1") == list(range(25, 32))
    # fewer layers on the GPUs: the first leave for the CPU, the rest are split the same way
    p = place(llama8b, FitRequest(n_ctx=4096), devices, 9, 0, 0)
    assert layers_on(p, "CPU") == list(range(0, 24))
    assert layers_on(p, "GPU0") == list(range(24, 31)) and layers_on(p, "GPU1") == [31]   # 6 / 9 < 0.75 <= 7 / 9


def test_a_zero_share_leaves_a_gpu_out(llama8b):
    devices = [cpu(), Device("GPU0", "gpu", 30 * GIB), Device("GPU1", "gpu", 10 * GIB)]
    p = place(llama8b, FitRequest(n_ctx=4096, tensor_split=(0, 1)), devices, 33, 0, 0)
    assert layers_on(p, "GPU0") == [] and layers_on(p, "GPU1") == list(range(32)) and p.gpu == "GPU1"
    assert sum(p.use["GPU0"].weights.values()) == 0 and p.use["GPU0"].kv == 0


def test_two_small_gpus_hold_what_neither_holds_alone(llama8b):
    """4.9 GB of weights: one 3 GiB card keeps most dense FFNs in host memory, two hold it all."""
    req = FitRequest(n_ctx=4096, n_slots=1, flash_attn=True)
    one = plan(llama8b, req, [cpu(), Device("GPU0", "gpu", 3 * GIB)])
    two = plan(llama8b, req, [cpu(), Device("GPU0", "gpu", 3 * GIB), Device("GPU1", "gpu", 3 * GIB)])
    assert one.fits and one.n_cpu_ffn > 16
    assert two.fits and two.n_gpu_layers == 33 and two.n_cpu_ffn == 0 and not layers_on(two, "CPU")
    for g in ("GPU0", "GPU1"):
        assert 0 < two.use[g].total <= 3 * GIB


def test_a_split_that_does_not_fit_moves_the_first_layers_to_the_cpu(llama8b):
    req = FitRequest(n_ctx=4096, n_slots=1, flash_attn=True)
    p = plan(llama8b, req, [cpu(), Device("GPU0", "gpu", GIB // 2), Device("GPU1", "gpu", GIB)])
    assert p.fits and 0 < p.n_gpu_layers < 33 and p.n_cpu_ffn == 32
    first = 33 - p.n_gpu_layers
    assert layers_on(p, "CPU") == list(range(first))
    assert max(layers_on(p, "GPU0")) < min(layers_on(p, "GPU1"))
    assert all(u.headroom >= 0 for u in p.use.values())


def test_only_a_local_gpu_takes_the_big_batches(llama8b):
    """llama.cpp's scheduler hands a big batch's ops on host weights to a GPU that offers to take
    them (op offload); an RPC device does not, so beside workers alone the CPU computes them."""
    req = FitRequest(n_ctx=4096, n_slots=1, flash_attn=True)
    remote = [cpu(), Device("GPU0", "gpu", 40 * GIB, remote=True), Device("GPU1", "gpu", 40 * GIB, remote=True)]
    p = place(llama8b, req, remote, 20, 0, 0)
    assert p.use["CPU"].compute == planner.compute_bytes(llama8b, req, False, True)
    assert p.use["GPU1"].compute == planner.compute_bytes(llama8b, req, True, True)
    mixed = remote[:2] + [Device("GPU1", "gpu", 40 * GIB)]
    p = place(llama8b, req, mixed, 20, 0, 0)
    where = p.where
    assert p.use["GPU1"].compute == planner.offload_compute_bytes(llama8b, req, where)
    assert p.use["CPU"].compute == planner.host_compute_bytes(llama8b, req)
    assert p.use["GPU0"].compute == planner.compute_bytes(llama8b, req, False, True)


def test_a_share_for_each_gpu_or_a_clear_refusal(llama8b):
    devices = [cpu(), Device("GPU0", "gpu", 8 * GIB), Device("GPU1", "gpu", 8 * GIB)]
    for bad in ((1,), (1, 1, 1), (0, 0), (1, -1)):
        with pytest.raises(ValueError, match="one non-negative share per GPU"):
            planner.split_of(FitRequest(n_ctx=512, tensor_split=bad), devices)


def test_workers_come_first_and_the_local_gpus_follow(hosts):
    local = dev.from_snapshot(hosts["desktop"])
    both = dev.with_workers(local, [("10.0.0.2:50052", 100 * GIB, 128 * GIB)])
    assert [(d.name, d.remote) for d in both] == [("CPU", False), ("GPU0", True), ("GPU1", False)]
    assert both[2].budget == local[1].budget and "10.0.0.2:50052" in both[1].how
    assert dev.main_gpu_only(both) == both[:2]


def test_a_splits_identity_is_its_layers_not_its_devices_free_memory(llama8b):
    """The KV fingerprint of a split names the layers each device holds: free memory (the default
    shares) differs at every start, and a restart must still find its prompt cache on disk."""
    from appliance.engine.runners.placement import RunnerPlacement

    def identity(budget0):
        devices = [cpu(), Device("GPU0", "gpu", budget0, remote=True), Device("GPU1", "gpu", 30 * GIB)]
        p = place(llama8b, FitRequest(n_ctx=4096), devices, 33, 0, 0)
        return RunnerPlacement(p, llama8b, [], None, "RPC0", names={"GPU0": "RPC0", "GPU1": "Vulkan0"}).identity()
    assert identity(30 * GIB) == identity(30 * GIB + 12345) != identity(10 * GIB)
    assert "split=RPC0:17,Vulkan0:15" in identity(30 * GIB)     # il / 33 < 0.5 for il <= 16; the output on GPU1
