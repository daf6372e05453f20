"""Tests of tfshard._gpu_ids: which TensorFlow device each nvidia-smi GPU is.

The GPUs are recorded nvidia-smi output (tests/fake_nvidia_smi/scenarios), read with
`tfshard.utilization.parse`; the environment is given, not this process's.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from fake_nvidia_smi import fake
from tensorflow.config import LogicalDeviceConfiguration, PhysicalDevice

from tfshard import _gpu_ids, utilization

SCENARIOS = fake.SCENARIOS
U0 = "GPU-8f3a2c1e-5b7d-4e9f-a0c2-1d3e5f7a9b0c"
U1 = "GPU-8f3b9d04-22c6-0a1b-7e35-c4d2f09e8a61"
U2 = "GPU-3c71e0a9-9f2d-5b48-1c6e-a7b3d58f2e90"
U3 = "GPU-d4e2b6f8-1a3c-47d9-8e05-6b9c2f1a7d34"

FOUR = (SCENARIOS / "several_gpus_busy.txt").read_text()
MIXED = (SCENARIOS / "mixed_models.txt").read_text()


def _devices(text: str, **environ: str) -> dict[int, str]:
    readings = utilization.parse(text, environ={})
    names = _gpu_ids.tf_device_names(readings, environ)
    assert all(len(each) == 1 for each in names.values())  # no logical split here
    return {index: each[0] for index, each in names.items()}


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, {0: "GPU:0", 1: "GPU:1", 2: "GPU:2", 3: "GPU:3"}),
        ("2,0", {2: "GPU:0", 0: "GPU:1"}),
        (" 3, 1", {3: "GPU:0", 1: "GPU:1"}),  # blanks around entries are skipped
        ("1gpu,3", {1: "GPU:0", 3: "GPU:1"}),  # strtoul reads the leading number
        ("", {}),  # empty: no GPU visible
        ("-1", {}),
        ("1,-1,3", {1: "GPU:0"}),  # a negative entry stops the list
        ("1,7,2", {1: "GPU:0"}),  # so does one out of range
        ("1,x,2", {1: "GPU:0"}),  # and one that is not a number
        ("0,1,0", {}),  # a repeated GPU hides every GPU
        (f"{U3},GPU-8f3a", {3: "GPU:0", 0: "GPU:1"}),  # UUIDs and unique prefixes
        (f"{U2},GPU-8f3,{U1}", {2: "GPU:0"}),  # an ambiguous prefix stops the list
        (f"{U2},GPU-ffff,{U1}", {2: "GPU:0"}),  # so does an unknown UUID
        (f"{U1},2", {1: "GPU:0"}),  # and an entry of another kind
        (f"{U1},GPU-8f3b", {}),  # the same GPU twice hides every GPU
        ("0,GPU-8f3a", {0: "GPU:0"}),
        (f"MIG-{U0}/1/0,MIG-{U0}/2/0", {}),  # MIG slices are not whole GPUs
    ],
)
def test_cuda_visible_devices_maps_gpus_to_tf_names(visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    want = {index: f"/device:{name}" for index, name in expected.items()}
    assert _devices(FOUR, **environ) == want
    assert _devices(FOUR, CUDA_DEVICE_ORDER="PCI_BUS_ID", **environ) == want


def test_mixed_models_in_fastest_first_order_are_not_guessed():
    # CUDA puts the faster model first by a heuristic nvidia-smi does not show.
    assert _devices(MIXED) == {}
    assert _devices(MIXED, CUDA_VISIBLE_DEVICES="1,0") == {}
    assert _devices(MIXED, CUDA_DEVICE_ORDER="FASTEST_FIRST") == {}
    # UUIDs name the GPU whatever the order; PCI_BUS_ID order is nvidia-smi's.
    uuid_a6000 = "GPU-99ff88ee-77dd-66cc-55bb-44aa33221100"
    assert _devices(MIXED, CUDA_VISIBLE_DEVICES=uuid_a6000) == {1: "/device:GPU:0"}
    assert _devices(MIXED, CUDA_DEVICE_ORDER="PCI_BUS_ID") == {
        0: "/device:GPU:0",
        1: "/device:GPU:1",
    }
    assert _devices(MIXED, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES="1") == {
        1: "/device:GPU:0"
    }


# --- TensorFlow's configuration: visible subsets and logical splits -----------------------


def _tf(physical: int, visible=None, splits=None) -> SimpleNamespace:
    """A stand-in for the tensorflow module: its tf.config as seen before the runtime starts.

    physical: how many physical GPUs; visible: the ordinals left visible (default all);
    splits: {ordinal: [memory limit of each logical GPU]}.
    """
    devices = [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(physical)]
    shown = devices if visible is None else [devices[i] for i in visible]
    configs = {
        devices[i].name: [LogicalDeviceConfiguration(memory_limit=m) for m in limits]
        for i, limits in (splits or {}).items()
    }

    def listing(kind=None):
        assert kind == "GPU"
        return devices

    def visible_devices(kind=None):
        assert kind == "GPU"
        return shown

    config = SimpleNamespace(
        list_physical_devices=listing,
        get_visible_devices=visible_devices,
        get_logical_device_configuration=lambda device: configs.get(device.name),
    )
    return SimpleNamespace(config=config)


@pytest.mark.parametrize(
    ("tf", "expected"),
    [
        (_tf(2), [(0, None), (1, None)]),
        (_tf(2, splits={0: [1024, 2048]}), [(0, 1024), (0, 2048), (1, None)]),
        (_tf(3, visible=[2]), [(2, None)]),
        (_tf(3, visible=[1, 2], splits={2: [512, 512]}), [(1, None), (2, 512), (2, 512)]),
        (_tf(0), []),
    ],
    ids=["unsplit", "gpu0_split_in_two", "visible_subset", "subset_and_split", "no_gpu"],
)
def test_logical_gpus_follow_visible_devices_and_splits(tf, expected):
    assert [(g.physical, g.memory_limit_mb) for g in _gpu_ids.logical_gpus(tf)] == expected


def test_a_split_gpu_has_one_name_per_logical_gpu():
    readings = utilization.parse(FOUR, environ={})
    split = _gpu_ids.logical_gpus(_tf(2, splits={0: [1024, 1024]}))
    # CUDA shows nvidia-smi's GPUs 2 and 3 as its devices 0 and 1; TensorFlow splits device 0.
    names = _gpu_ids.tf_device_names(readings, {"CUDA_VISIBLE_DEVICES": "2,3"}, split)
    assert names == {2: ("/device:GPU:0", "/device:GPU:1"), 3: ("/device:GPU:2",)}


def test_gpus_hidden_by_set_visible_devices_have_no_name():
    readings = utilization.parse(FOUR, environ={})
    subset = _gpu_ids.logical_gpus(_tf(4, visible=[1, 3]))
    assert _gpu_ids.tf_device_names(readings, {}, subset) == {
        1: ("/device:GPU:0",),
        3: ("/device:GPU:1",),
    }
    # With CUDA's own list in between: CUDA device 1 is nvidia-smi's GPU 0.
    subset = _gpu_ids.logical_gpus(_tf(2, visible=[1]))
    names = _gpu_ids.tf_device_names(readings, {"CUDA_VISIBLE_DEVICES": "3,0"}, subset)
    assert names == {0: ("/device:GPU:0",)}


def test_this_process_uses_tensorflow_only_when_it_lists_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", _tf(0))
    assert _gpu_ids.this_process_logical_gpus() is None  # CPU-only TensorFlow: CUDA rules
    monkeypatch.setitem(sys.modules, "tensorflow", _tf(2, visible=[1]))
    assert _gpu_ids.this_process_logical_gpus() == (_gpu_ids.LogicalGpu(1),)
    monkeypatch.setitem(sys.modules, "tensorflow", SimpleNamespace())  # still importing
    assert _gpu_ids.this_process_logical_gpus() is None
    monkeypatch.delitem(sys.modules, "tensorflow")
    assert _gpu_ids.this_process_logical_gpus() is None


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, None), ("", [""]), ("2, 0", ["2", "0"]), (f"{U1},{U3}", [U1, U3])],
)
def test_cuda_visible_entries(visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert _gpu_ids.cuda_visible_entries(environ) == expected
