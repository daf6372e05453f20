"""Fixtures shared by the test modules (the device split is in ../conftest.py).

The rules every test meets (tests/README.md has them in full):

- Floats computed two ways are compared with `numerics.assert_close` (tests/numerics.py):
  the tolerance knows the dtype and the device kind (TF32 on GPUs); no test picks its own.
- A Python child's environment is `children.environ()` (tests/children.py): it finds the
  packages this process found and this checkout's tfshard.
- Every test passes alone, in any order and under load: it seeds its own random values, names
  the devices it means, skips with `_gpu_or_skip` where it needs a kind of machine, and waits
  for events, never for a time.
"""

import os
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import children
import pytest
import tensorflow as tf
from fake_nvidia_smi import fake

from tfshard import pinning
from tfshard.replicas import Replicas


def _gpu_or_skip(count: int = 1) -> None:
    have = len(tf.config.list_logical_devices("GPU"))
    if have >= count:
        return
    reason = f"needs {count} GPU(s), this machine has {have}"
    if os.environ.get("TFSHARD_REQUIRE_GPU") == "1":
        pytest.fail(f"TFSHARD_REQUIRE_GPU=1 but the test {reason}")
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def no_replicas_outside():
    """Each test starts and leaves without replicas (`Replicas.forget_all`).

    Replicas belong to the process (`Replicas.of` keeps one per set of devices), so
    one test's copies (an example run with 4 logical devices, say) would make every
    later function on those devices trace its shards in replica contexts; forgetting
    them makes the functions traced with them retrace.
    """
    Replicas.forget_all()
    yield
    Replicas.forget_all()


@pytest.fixture(scope="session")
def before_the_runtime_starts() -> tuple[list[str], str]:
    """One fresh interpreter for what must happen before TensorFlow's runtime starts
    (`virtual_devices` works only until then): parsing device names, the reads of the
    configuration (`num_gpus`, `try_gpu`, `try_all_gpus`) and of the ``TFSHARD_CONTEXTS``
    map come first, then the split, then a name resolved on the split devices.

    Returns:
      The child's stdout lines (one per print below) and its stderr (INFO logging).
    """
    script = textwrap.dedent(
        """
        import logging
        from tfshard import _device_names
        import tfshard
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        print(_device_names.parse_spec("worker1:GPU:0").task,
              _device_names.is_remote("/job:worker/task:0/device:CPU:0"))
        print(tfshard.num_gpus(), tfshard.try_gpu(5), len(tfshard.try_all_gpus()) >= 1)
        print(sorted(tfshard.active_contexts().items()))
        print(tfshard.virtual_devices(3))
        print(tfshard.list_devices("CPU"))
        print(tfshard.resolve_device("dev1"))
        """
    )
    done = children.python(
        script,
        CUDA_VISIBLE_DEVICES="",
        TFSHARD_CONTEXTS="dev0->cpu:0;dev1->cpu:1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines(), done.stderr


@pytest.fixture
def built_on_the_cpu_bed():
    """Eager variables, models and references made in the test live on /device:CPU:0.

    TensorFlow's default device is GPU:0 on a machine with a GPU: a model built there would
    make every CPU shard read its weights remotely, and its reference would run in TF32. A
    file about the CPU bed uses it for every test:
    ``pytestmark = pytest.mark.usefixtures("built_on_the_cpu_bed")``.
    """
    with tf.device("/device:CPU:0"):
        yield


@pytest.fixture
def one_gpu():
    """Skips (or, with TFSHARD_REQUIRE_GPU=1, fails) without a GPU."""
    _gpu_or_skip(1)


@pytest.fixture
def two_gpus():
    """Skips (or, with TFSHARD_REQUIRE_GPU=1, fails) without two GPUs."""
    _gpu_or_skip(2)


def _session_config() -> Any:
    """A TF1 session config with this process's logical devices (a session reads no tf.config)."""
    cpus = len(tf.config.list_logical_devices("CPU"))
    config = tf.compat.v1.ConfigProto(allow_soft_placement=True, device_count={"CPU": cpus})
    for physical in tf.config.list_physical_devices("GPU"):
        split = tf.config.get_logical_device_configuration(physical) or []
        if split:
            limits = config.gpu_options.experimental.virtual_devices.add()
            limits.memory_limit_mb.extend(c.memory_limit for c in split)
    return config


def _run_traced(concrete: Any, *inputs: Any) -> Any:
    """Runs a traced graph once in a TF1 session with a full trace; returns its step stats."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    config = _session_config()
    feeds = {t.name: value for t, value in zip(concrete.inputs, inputs)}
    with tf.compat.v1.Session(graph=concrete.graph, config=config) as session:
        session.run([t.name for t in concrete.outputs], feeds, options, metadata)
    return metadata.step_stats


@pytest.fixture
def traced_run() -> Callable[..., Any]:
    """`traced_run(concrete_function, *inputs)`: one run's step stats (GPU streams included)."""
    return _run_traced


def _executed_nodes(concrete: Any, *inputs: Any) -> list[tuple[str, str, str]]:
    """Runs a traced graph once; returns [(node, op type, device it ran on)].

    A node of a function called on several devices (the shards' shared trace)
    is listed once per device it ran on. It runs in a TF1 session with a full
    trace: the step stats name the device each node ran on after placement
    (soft placement included), which the graph's requested devices do not, and
    it needs no process-global logging
    (tf.debugging.set_log_device_placement).
    """
    ran = []
    for device in _run_traced(concrete, *inputs).dev_stats:
        if "/stream:" in device.device or "/memcpy" in device.device:
            continue  # GPU kernel timings, listed again by stream
        for node in device.node_stats:
            op = node.timeline_label.split(" = ", 1)[-1].split("(", 1)[0]
            spec = tf.DeviceSpec.from_string(device.device)
            local = tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index)
            ran.append((node.node_name, op, local.to_string()))
    return ran


@pytest.fixture
def executed_nodes() -> Callable[..., list[tuple[str, str, str]]]:
    """`executed_nodes(concrete_function, *inputs)`: [(node, op, device it ran on)]."""
    return _executed_nodes


@pytest.fixture(autouse=True)
def no_active_contexts(monkeypatch):
    """Every test starts and leaves with no context map, explicit or from the environment.

    `pinning.reset_contexts` forgets pinning's one piece of process state: no
    `set_contexts` map, no `use_contexts` block, nothing logged.
    """
    pinning.reset_contexts()
    monkeypatch.delenv(pinning.CONTEXTS_ENV, raising=False)
    yield
    pinning.reset_contexts()


def _process_gone(pid: int, seconds: float = 10.0) -> bool:
    """True once pid is gone or a zombie (init reaps what it inherits, on its own time)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def process_gone() -> Callable[..., bool]:
    """`process_gone(pid, seconds=10.0)`: waits until pid is gone (or a zombie)."""
    return _process_gone


# ------------------------------------------------ the fake nvidia-smi and its scenarios


@pytest.fixture
def fake_nvidia_smi(monkeypatch, tmp_path) -> Callable[[str], Path]:
    """Puts the fake first on PATH; returns a function that picks a scenario.

    The fake counts its calls in the returned state directory (files "calls" and "pid").
    """
    return fake.install(monkeypatch, tmp_path)


@pytest.fixture
def nvidia_smi_several_gpus_busy(fake_nvidia_smi):
    return fake_nvidia_smi("several_gpus_busy")


@pytest.fixture
def nvidia_smi_units_and_header(fake_nvidia_smi):
    return fake_nvidia_smi("several_gpus_busy_with_units_and_header")


@pytest.fixture
def nvidia_smi_one_gpu_idle(fake_nvidia_smi):
    return fake_nvidia_smi("one_gpu_idle")


@pytest.fixture
def nvidia_smi_not_supported_fields(fake_nvidia_smi):
    return fake_nvidia_smi("not_supported_fields")


@pytest.fixture
def nvidia_smi_mig_enabled(fake_nvidia_smi):
    return fake_nvidia_smi("mig_enabled")


@pytest.fixture
def nvidia_smi_utilization_changes(fake_nvidia_smi):
    return fake_nvidia_smi("utilization_changes")


@pytest.fixture
def nvidia_smi_driver_library_mismatch(fake_nvidia_smi):
    return fake_nvidia_smi("driver_library_mismatch")


@pytest.fixture
def nvidia_smi_driver_hangs(fake_nvidia_smi):
    return fake_nvidia_smi("driver_hangs")


@pytest.fixture
def nvidia_smi_no_devices(fake_nvidia_smi):
    return fake_nvidia_smi("no_devices")
