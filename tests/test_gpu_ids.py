"""Tests of tfshard._gpu_ids: which TensorFlow device each nvidia-smi GPU is.

The GPUs are recorded nvidia-smi output (tests/fake_nvidia_smi/scenarios), read with
`tfshard.utilization.parse`; the environment is given, not this process's.
"""

from __future__ import annotations

import pytest
from fake_nvidia_smi import fake

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
    return _gpu_ids.tf_device_names(readings, environ)


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
