"""Device spellings read as names (tfshard/_device_names.py): pure parsing, nothing started.

Resolution against the devices that exist is tests/test_pinning.py's.
"""

import pytest
import tensorflow as tf

from tfshard import _device_names, pinning


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("worker1:GPU:0", ("worker", 1, "GPU", 0)),
        ("worker1:cpu", ("worker", 1, "CPU", 0)),
        ("worker12:gpu:3", ("worker", 12, "GPU", 3)),
        ("ps0:CPU:1", ("ps", 0, "CPU", 1)),
        ("/job:worker/task:1/device:CPU:0", ("worker", 1, "CPU", 0)),
        ("/job:worker/replica:0/task:1/device:GPU:2", ("worker", 1, "GPU", 2)),
    ],
)
def test_remote_spellings_parse_to_job_task_and_device(spec, expected):
    parsed = _device_names.parse_spec(spec)
    assert (parsed.job, parsed.task, parsed.device_type, parsed.device_index) == expected
    assert _device_names.is_remote(spec)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("gpu:1", ("GPU", 1)),
        ("GPU:1", ("GPU", 1)),
        ("/gpu:1", ("GPU", 1)),
        ("/device:GPU:1", ("GPU", 1)),
        ("device:gpu:1", ("GPU", 1)),
        ("cuda1", ("GPU", 1)),
        ("CUDA1", ("GPU", 1)),
        ("cuda", ("GPU", 0)),
        ("gpu", ("GPU", 0)),
        ("cpu", ("CPU", 0)),
        ("cpu:3", ("CPU", 3)),
        ("/job:localhost/replica:0/task:0/device:CPU:2", ("CPU", 2)),
    ],
)
def test_local_spellings_parse_to_type_and_index(spec, expected):
    parsed = _device_names.parse_spec(spec)
    assert (parsed.device_type, parsed.device_index) == expected
    assert not _device_names.is_remote(spec)


@pytest.mark.parametrize("spec", ["", "banana split", "cpu:-1", "/job:worker", "gpu:1:2"])
def test_what_is_no_device_name_parses_to_none(spec):
    assert _device_names.parse_spec(spec) is None


@pytest.mark.parametrize(
    "spec, local",
    [
        ("/device:CPU:1", True),
        ("/job:localhost/replica:0/task:0/device:CPU:2", True),
        ("/job:worker/task:1/device:CPU:0", False),
        ("worker1:GPU:0", False),
    ],
)
def test_a_job_is_local_when_it_is_none_or_localhost(spec, local):
    # The one rule pinning, cluster and processes all apply to a parsed name.
    assert _device_names.is_local_job(_device_names.parse_spec(spec).job) is local
    assert _device_names.is_remote(spec) is not local


def test_parse_name_reads_logical_devices_and_device_specs():
    logical = tf.config.list_logical_devices("CPU")[2]
    assert _device_names.parse_name(logical).to_string() == "/device:CPU:2"
    spec = tf.DeviceSpec(job="worker", task=1, device_type="gpu", device_index=0)
    assert _device_names.parse_name(spec).to_string() == "/job:worker/task:1/device:GPU:0"
    assert _device_names.parse_name(3) is None and not _device_names.is_remote(3)


@pytest.mark.parametrize(
    "have, want, same",
    [
        ("/job:localhost/replica:0/task:0/device:CPU:1", "/device:CPU:1", True),
        ("/device:CPU:1", "/device:CPU:2", False),
        ("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/task:1/device:CPU:0", True),
        ("/job:worker/replica:0/task:1/device:CPU:0", "/device:CPU:0", False),
        ("", "/device:CPU:0", False),  # a graph tensor before placement
        ("not a name", "/device:CPU:0", False),
    ],
)
def test_same_device_compares_what_identifies_a_device(have, want, same):
    assert _device_names.same_device(have, want) is same


def test_pinning_names_the_same_functions():
    # The modules that reach names through tfshard.pinning get these very functions.
    for name in ("is_remote", "parse_spec", "parse_name", "same_device", "DeviceSpecLike"):
        assert getattr(pinning, name) is getattr(_device_names, name)


def test_parsing_names_does_not_start_tensorflow(before_the_runtime_starts):
    # conftest's fresh interpreter parses names first: the split after them still works.
    out, _ = before_the_runtime_starts
    assert out[0] == "1 True"  # worker1:GPU:0 is task 1; /job:worker/task:0/... is remote
    assert out[3] == str(["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"])
