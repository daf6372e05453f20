"""Tests of tfshard.utilization against a fake nvidia-smi that replays recorded output.

The fake is a real executable, tests/fake_nvidia_smi/nvidia-smi, put first on PATH; it
answers only the exact query tfshard runs. No test needs TensorFlow or a GPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fake_nvidia_smi import fake

from tfshard import utilization
from tfshard.errors import ArgumentError, TfshardError, UtilizationError
from tfshard.utilization import GpuReading, Monitor

FAKE = fake.FAKE
SCENARIOS = fake.SCENARIOS
THREAD_NAME = "tfshard-utilization-monitor"

A100 = "NVIDIA A100-SXM4-40GB"
U0 = "GPU-8f3a2c1e-5b7d-4e9f-a0c2-1d3e5f7a9b0c"
U1 = "GPU-8f3b9d04-22c6-0a1b-7e35-c4d2f09e8a61"
U2 = "GPU-3c71e0a9-9f2d-5b48-1c6e-a7b3d58f2e90"
U3 = "GPU-d4e2b6f8-1a3c-47d9-8e05-6b9c2f1a7d34"


@pytest.fixture(autouse=True)
def no_monitor_thread_left():
    """Every test must leave no sampling thread behind."""
    yield
    assert _monitor_threads() == []


@pytest.fixture
def no_nvidia_driver(monkeypatch, tmp_path):
    """A machine with no nvidia-smi on PATH and no GPU in this process, on any machine.

    A test that then gives the fake explicitly reads the fake's GPUs as a process without
    GPUs names them: a GPU machine's own (an H100 split in two) would rename them.
    """
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("TFSHARD_NVIDIA_SMI", raising=False)
    fake.hide_this_process_gpus(monkeypatch)


_calls = fake.calls


def _monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _wait_for(predicate: Callable[[], bool], seconds: float = 120.0) -> None:
    """Waits until `predicate()`; `seconds` only ends a wait that would never end.

    Each call of the fake starts a Python (0.1 s on a quiet machine, seconds on a busy one):
    no test may depend on how many calls fit in a given time.
    """
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


# --- the fake itself ---------------------------------------------------------------------


def test_fake_rejects_any_other_command_line(nvidia_smi_several_gpus_busy):
    done = subprocess.run(
        [str(FAKE), "-L"], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 2
    assert "no recording for the command line ['-L']" in done.stderr
    assert done.stdout == ""


def test_fake_is_executable_for_git():
    assert os.access(fake.executable(), os.X_OK)
    assert FAKE.read_text().startswith("#!/usr/bin/env python3\n")


# --- query and parse ---------------------------------------------------------------------

SEVERAL_BUSY = [
    GpuReading(0, U0, A100, 97.0, 41.0, 15012, 40960, "/device:GPU:0"),
    GpuReading(1, U1, A100, 93.0, 38.0, 14876, 40960, "/device:GPU:1"),
    GpuReading(2, U2, A100, 100.0, 52.0, 15012, 40960, "/device:GPU:2"),
    GpuReading(3, U3, A100, 91.0, 36.0, 14990, 40960, "/device:GPU:3"),
]


def test_query_reads_several_gpus(nvidia_smi_several_gpus_busy):
    assert utilization.query() == SEVERAL_BUSY
    assert _calls(nvidia_smi_several_gpus_busy) == 1


def test_query_reads_units_and_header_lines(nvidia_smi_units_and_header):
    assert utilization.query() == SEVERAL_BUSY


def test_query_turns_na_and_not_supported_into_none(nvidia_smi_not_supported_fields):
    gt710, k80 = utilization.query()
    assert gt710 == GpuReading(
        index=0,
        uuid="GPU-0b1c2d3e-4f5a-6b7c-8d9e-0f1a2b3c4d5e",
        name="NVIDIA GeForce GT 710",
        utilization_gpu=None,
        utilization_memory=None,
        memory_used_mib=412,
        memory_total_mib=2048,
        device=None,
    )
    # Two models, default FASTEST_FIRST order: which is GPU:0 is not knowable.
    assert (k80.utilization_gpu, k80.utilization_memory, k80.memory_used_mib) == (None,) * 3
    assert k80.memory_total_mib == 11441


def test_query_mig_enabled_gpus_have_no_utilization(nvidia_smi_mig_enabled):
    readings = utilization.query()
    assert [r.utilization_gpu for r in readings] == [None, None]
    assert [r.memory_used_mib for r in readings] == [87, 2195]


def test_parse_skips_blank_and_repeated_header_lines():
    text = (SCENARIOS / "several_gpus_busy_with_units_and_header.txt").read_text()
    header = text.splitlines()[0]
    assert utilization.parse(f"\n{text}\n{header}\n", environ={}) == SEVERAL_BUSY


def test_parse_keeps_a_comma_in_a_product_name():
    [reading] = utilization.parse("0, GPU-1, Board, Rev 2, 5, 6, 7, 8", environ={})
    assert (reading.name, reading.utilization_gpu, reading.memory_total_mib) == (
        "Board, Rev 2",
        5.0,
        8,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("GPU 0: NVIDIA A100 (UUID: GPU-1)", r"line 1 has 1 comma-separated fields, expected 7"),
        ("0, GPU-1, A100, 93, 41, 15012", r"line 1 has 6 comma-separated fields"),
        ("x, GPU-1, A100, 93, 41, 15012, 40960", r"line 1 has GPU index 'x'"),
        ("0, GPU-1, A100, busy, 41, 15012, 40960", r"utilization.gpu 'busy', expected a number"),
        ("0, GPU-1, A100, 93, 41, 15 GiB, 40960", r"memory.used '15 GiB'"),
        (
            "0, GPU-1, A100, 93, 41, 1, 2\n0, GPU-1, A100, 93, 41, 1, 2",
            r"line 2 repeats GPU index 0: .*; pass the output of one",
        ),
    ],
)
def test_parse_rejects_text_it_cannot_read(text, message):
    with pytest.raises(ArgumentError, match=message) as caught:
        utilization.parse(text, environ={})
    assert isinstance(caught.value, ValueError)


# --- nvidia-smi faults -------------------------------------------------------------------


def test_missing_driver_says_what_to_install(no_nvidia_driver):
    with pytest.raises(
        UtilizationError, match=r"no NVIDIA driver found: `nvidia-smi` is not on PATH\. Install"
    ) as caught:
        utilization.query()
    assert "TFSHARD_NVIDIA_SMI" in str(caught.value)
    assert isinstance(caught.value, TfshardError) and isinstance(caught.value, RuntimeError)


def test_path_can_be_overridden_by_argument_and_environment(
    no_nvidia_driver, monkeypatch, tmp_path
):
    fake.executable()
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", "several_gpus_busy")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert utilization.query(nvidia_smi=FAKE) == SEVERAL_BUSY
    monkeypatch.setenv("TFSHARD_NVIDIA_SMI", str(FAKE))
    assert utilization.query() == SEVERAL_BUSY
    monkeypatch.setenv("TFSHARD_NVIDIA_SMI", str(tmp_path / "nope"))
    with pytest.raises(UtilizationError, match=r"\$TFSHARD_NVIDIA_SMI is '.*nope', which is not"):
        utilization.query()
    with pytest.raises(UtilizationError, match=r"the nvidia_smi argument is '.*nope', which"):
        utilization.query(nvidia_smi=tmp_path / "nope")


def test_nvidia_smi_that_cannot_start_is_a_clear_error(no_nvidia_driver, tmp_path):
    broken = tmp_path / "nvidia-smi"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    with pytest.raises(UtilizationError, match=r"could not run `.*nvidia-smi --query-gpu=.*`: "):
        utilization.query(nvidia_smi=broken)


def test_failing_nvidia_smi_quotes_its_stderr(nvidia_smi_driver_library_mismatch):
    with pytest.raises(
        UtilizationError,
        match=r"failed with exit status 18; the kernel module and the user-space driver differ"
        r".*reboot.*stderr: 'Failed to initialize NVML: Driver/library version mismatch",
    ):
        utilization.query()


def test_no_devices_is_an_error_that_quotes_stdout(nvidia_smi_no_devices):
    with pytest.raises(
        UtilizationError, match=r"exit status 6\. .*stdout: 'No devices were found'"
    ):
        utilization.query()


def test_hung_nvidia_smi_is_killed(nvidia_smi_driver_hangs):
    start = time.monotonic()
    with pytest.raises(
        UtilizationError, match=r"did not answer within 0\.5 s and was killed; the driver"
    ):
        utilization.query(timeout=0.5)
    assert time.monotonic() - start < 20  # the fake hangs 30 s: it was killed, not waited for
    pid = int((nvidia_smi_driver_hangs / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_hung_nvidia_smi_is_killed_with_what_it_started(
    nvidia_smi_driver_hangs, tmp_path, process_gone
):
    # A wrapper script runs nvidia-smi as its child; killing only the wrapper left the
    # hung nvidia-smi running, one per failed call.
    wrapper = tmp_path / "wrapper" / "nvidia-smi"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\n"{FAKE}" "$@"\necho "nvidia-smi exited with $?"\n')
    wrapper.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(UtilizationError, match=r"did not answer within 2 s and was killed"):
        utilization.query(wrapper, timeout=2)
    assert time.monotonic() - start < 20  # the fake hangs 30 s: it was killed, not waited for
    assert process_gone(int((nvidia_smi_driver_hangs / "pid").read_text()))


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("garbage_list_output", r"printed output tfshard cannot read \(line 1 has 1 comma-sep"),
        ("garbage_non_numeric", r"cannot read \(line 1 has utilization.gpu 'busy'"),
    ],
)
def test_garbage_output_is_quoted(fake_nvidia_smi, scenario, message):
    fake_nvidia_smi(scenario)
    with pytest.raises(UtilizationError, match=message) as caught:
        utilization.query()
    assert "--query-gpu=index,uuid,name" in str(caught.value)
    first_line = (SCENARIOS / f"{scenario}.txt").read_text().splitlines()[0]
    assert first_line in str(caught.value)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "5"])
def test_query_rejects_a_bad_timeout(timeout):
    with pytest.raises(ArgumentError, match=r"timeout=.*; give a positive number of seconds"):
        utilization.query(timeout=timeout)


@pytest.mark.parametrize(
    ("nvidia_smi", "message"),
    [
        (3, r"nvidia_smi=3 is of type int; give the path of nvidia-smi as a str or os\.PathLike"),
        ([str(FAKE)], r"nvidia_smi=\['.*nvidia-smi'\] is of type list"),
        (os.fsencode(FAKE), r"nvidia_smi=b'.*nvidia-smi' is of type bytes; .*decoded to str"),
    ],
)
def test_query_rejects_an_executable_that_is_not_a_path(
    nvidia_smi_several_gpus_busy, nvidia_smi, message
):
    with pytest.raises(ArgumentError, match=message):
        utilization.query(nvidia_smi)
    assert not (nvidia_smi_several_gpus_busy / "calls").exists()
    assert len(utilization.query(FAKE)) == 4  # a Path is one


@pytest.mark.parametrize(
    ("text", "environ", "message"),
    [
        (None, None, r"text=None is of type NoneType; pass nvidia-smi's output as one str"),
        (b"0, GPU-1, A100, 1, 1, 1, 1", None, r"text=b'0, GPU-1.* is of type bytes; decode it"),
        (["0, GPU-1, A100, 1, 1, 1, 1"], None, r"text=\['0, GPU-1.* is of type list"),
        ("0, GPU-1, A100, 1, 1, 1, 1", ["CUDA_VISIBLE_DEVICES=0"], r"environ=\[.* of type list"),
    ],
)
def test_parse_rejects_what_is_not_text(text, environ, message):
    with pytest.raises(ArgumentError, match=message):
        utilization.parse(text, environ)


# --- which TensorFlow device is which GPU -------------------------------------------------


def test_query_maps_devices_from_this_process_environment(
    nvidia_smi_several_gpus_busy, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [r.device for r in utilization.query()] == [
        None,
        "/device:GPU:1",
        None,
        "/device:GPU:0",
    ]


@pytest.fixture
def tf_two_gpus_first_split(monkeypatch):
    """This process's TensorFlow sees two physical GPUs and splits the first in two."""
    tf = pytest.importorskip("tensorflow")
    physical = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in (0, 1)]
    split = [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * 2
    visible = list(physical)

    def kind_gpu(devices):
        return lambda device_type=None: list(devices) if device_type == "GPU" else []

    monkeypatch.setattr(tf.config, "list_physical_devices", kind_gpu(physical))
    monkeypatch.setattr(tf.config, "get_visible_devices", kind_gpu(visible))
    monkeypatch.setattr(
        tf.config,
        "get_logical_device_configuration",
        lambda device: split if device == physical[0] else None,
    )
    return visible  # a test may hide GPUs, as tf.config.set_visible_devices would


def test_query_names_every_logical_gpu_of_a_split_gpu(
    nvidia_smi_several_gpus_busy, monkeypatch, tf_two_gpus_first_split
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    readings = utilization.query()
    assert [r.devices for r in readings] == [
        (),
        ("/device:GPU:2",),
        (),
        ("/device:GPU:0", "/device:GPU:1"),
    ]
    assert [r.device for r in readings] == [None, "/device:GPU:2", None, "/device:GPU:0"]
    # Either half of the split GPU follows nvidia-smi's GPU 3.
    with Monitor(interval=60, devices=["GPU:1"]) as monitor:
        pass
    [summary] = monitor.summaries
    assert (summary.index, summary.devices) == (3, ("/device:GPU:0", "/device:GPU:1"))
    [verdict] = utilization.check(devices="GPU:0", duration=0)
    assert "(/device:GPU:0, /device:GPU:1)" in str(verdict)


def test_a_gpu_of_the_machine_running_the_tests_does_not_rename_a_scenarios_gpus(
    tf_two_gpus_first_split, monkeypatch, tmp_path
):
    # As on the H100 of 2026-11-24: this process's TensorFlow has a GPU split in two when
    # the scenario starts; the scenario's GPUs keep the names the CUDA rules give them.
    fake.install(monkeypatch, tmp_path)("several_gpus_busy")
    assert utilization.query() == SEVERAL_BUSY
    [verdict] = utilization.check(devices="GPU:2", duration=0)
    assert str(verdict).startswith(f"GPU 2 {A100} (/device:GPU:2): busy enough")


def test_query_leaves_gpus_hidden_by_set_visible_devices_unnamed(
    nvidia_smi_several_gpus_busy, monkeypatch, tf_two_gpus_first_split
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    del tf_two_gpus_first_split[0]  # tf.config.set_visible_devices(physical[1:], "GPU")
    assert [r.devices for r in utilization.query()] == [(), ("/device:GPU:0",), (), ()]
    with pytest.raises(ArgumentError, match=r"devices entry 'GPU:1' names no GPU; .*1 GPU-8f3b"):
        Monitor(devices="GPU:1").__enter__()


def test_a_reading_fills_device_from_devices_and_back():
    by_device = GpuReading(0, None, None, None, None, None, None, "/device:GPU:0")
    by_devices = GpuReading(0, None, None, None, None, None, None, devices=("/device:GPU:0",))
    assert by_device == by_devices and by_device.devices == ("/device:GPU:0",)
    with pytest.raises(ArgumentError, match=r"device='/device:GPU:1' is not the first of"):
        GpuReading(0, None, None, None, None, None, None, "/device:GPU:1", ("/device:GPU:0",))


# --- Monitor -------------------------------------------------------------------------------

# utilization_changes.txt by hand: per call, GPU 0 and GPU 1 (None is [N/A]).
CYCLE_GPU0_UTIL = [10, 60, 90, 100]
CYCLE_GPU0_MEM_UTIL = [5, 20, 35, 40]
CYCLE_GPU0_USED = [1000, 3000, 5000, 2000]
CYCLE_GPU1_UTIL = [0, None, 50, 30]


def test_monitor_summarises_each_gpu(nvidia_smi_utilization_changes):
    with Monitor(interval=0.01) as monitor:
        _wait_for(lambda: bool(monitor.summaries) and monitor.summaries[0].samples >= 5)
    gpu0, gpu1 = monitor.summaries
    calls = _calls(nvidia_smi_utilization_changes)
    # Call 1 is the probe on entry, before the body; calls 2..n are the samples.
    assert gpu0.samples == gpu1.samples == calls - 1 >= 6
    seen = [(call - 1) % 4 for call in range(2, calls + 1)]
    util0 = [CYCLE_GPU0_UTIL[i] for i in seen]
    assert gpu0.utilization_gpu_mean == pytest.approx(statistics.mean(util0))
    assert (gpu0.utilization_gpu_min, gpu0.utilization_gpu_max) == (min(util0), max(util0))
    mem0 = [CYCLE_GPU0_MEM_UTIL[i] for i in seen]
    assert gpu0.utilization_memory_mean == pytest.approx(statistics.mean(mem0))
    assert gpu0.utilization_memory_max == max(mem0)
    assert gpu0.memory_used_peak_mib == max(CYCLE_GPU0_USED[i] for i in seen) == 5000
    assert gpu0.memory_total_mib == 40960
    util1 = [CYCLE_GPU1_UTIL[i] for i in seen if CYCLE_GPU1_UTIL[i] is not None]
    assert gpu1.utilization_gpu_mean == pytest.approx(statistics.mean(util1))
    assert (gpu1.index, gpu1.uuid, gpu1.name, gpu1.device) == (1, U1, A100, "/device:GPU:1")


def test_monitor_takes_one_sample_on_exit_of_a_short_body(nvidia_smi_utilization_changes):
    with Monitor(interval=60) as monitor:
        pass
    # The probe saw sample 0; the exit sample is sample 1 of the cycle.
    assert [(s.samples, s.utilization_gpu_mean) for s in monitor.summaries] == [
        (1, 60.0),
        (1, None),
    ]
    summary = monitor.summaries[1]
    assert (summary.utilization_gpu_min, summary.utilization_gpu_max) == (None, None)


def test_monitor_thread_ends_when_the_body_raises(nvidia_smi_utilization_changes):
    with pytest.raises(KeyError, match="from the body"), Monitor(interval=0.01) as monitor:
        assert len(_monitor_threads()) == 1
        _wait_for(lambda: bool(monitor.summaries))
        raise KeyError("from the body")
    assert _monitor_threads() == []
    assert monitor.summaries[0].samples >= 1  # what was sampled stays readable


def test_monitor_raises_a_sampling_failure_on_exit(nvidia_smi_utilization_changes, monkeypatch):
    with (
        pytest.raises(
            UtilizationError,
            match=r"sampling GPU utilisation failed after \d+ readings: .*version mismatch",
        ),
        Monitor(interval=0.01) as monitor,
    ):
        _wait_for(lambda: bool(monitor.summaries))
        monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", "driver_library_mismatch")
        _wait_for(lambda: _monitor_threads() == [])  # the thread stops at its first failure
    assert monitor.summaries[0].samples >= 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_monitor_keeps_the_body_error_and_notes_the_sampling_failure(
    nvidia_smi_utilization_changes, monkeypatch
):
    with pytest.raises(ZeroDivisionError) as caught, Monitor(interval=0.01) as monitor:
        _wait_for(lambda: bool(monitor.summaries))
        monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", "driver_library_mismatch")
        _wait_for(lambda: _monitor_threads() == [])
        _ = 1 / 0
    assert any("sampling also failed" in note for note in caught.value.__notes__)


def test_monitor_fails_on_entry_without_a_driver(no_nvidia_driver):
    body_ran = False
    with pytest.raises(UtilizationError, match="no NVIDIA driver found"), Monitor():
        body_ran = True
    assert not body_ran


@pytest.mark.parametrize(
    ("devices", "environ", "expected"),
    [
        ([1], {}, [1]),
        ("2", {}, [2]),
        (["GPU-d4e2", 0], {}, [0, 3]),
        (U1, {}, [1]),
        ("GPU:1", {}, [1]),
        (["/device:GPU:0", "gpu:1"], {"CUDA_VISIBLE_DEVICES": "3,2"}, [2, 3]),
        ("/job:localhost/replica:0/task:0/device:GPU:0", {"CUDA_VISIBLE_DEVICES": "2"}, [2]),
        (np.int64(1), {}, [1]),  # a NumPy integer is an index, as 1 is
        ([np.uint8(3), np.int32(0)], {}, [0, 3]),
    ],
)
def test_monitor_follows_only_the_given_devices(
    nvidia_smi_several_gpus_busy, monkeypatch, devices, environ, expected
):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with Monitor(interval=60, devices=devices) as monitor:
        pass
    assert [s.index for s in monitor.summaries] == expected


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([7], r"devices entry 7 names no GPU; nvidia-smi sees: 0 GPU-8f3a"),
        ("GPU-8f3", r"devices entry 'GPU-8f3' names several GPUs"),
        ("GPU:0", r"devices entry 'GPU:0' names no GPU; .*\(no TF device\)"),  # hidden by CUDA
        ("cuda:0", r"cannot read device spec 'cuda:0'"),
        ("/job:worker/task:1/device:GPU:0", r"cannot read device spec '/job:worker"),
    ],
)
def test_monitor_rejects_devices_that_name_no_gpu(
    nvidia_smi_several_gpus_busy, monkeypatch, devices, message
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ArgumentError, match=message), Monitor(devices=devices):
        pytest.fail("the body must not run")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": -1}, r"interval=-1; give a positive number of seconds"),
        ({"interval": 0}, r"interval=0; give a positive"),
        ({"interval": float("inf")}, r"interval=inf"),
        ({"timeout": 0}, r"timeout=0"),
        ({"devices": [1.5]}, r"devices=\[1\.5\] holds 1\.5 of type float; give nvidia-smi "),
        ({"devices": True}, r"devices=True is of type bool; give nvidia-smi indices"),
        ({"devices": [False]}, r"holds False of type bool"),
        ({"devices": []}, r"devices=\[\] follows no GPU; pass None"),
        ({"devices": 1.5}, r"devices=1\.5 is of type float; give nvidia-smi indices \(0\)"),
        # bytes are no sequence of indices (b"0" is not GPU 48)
        ({"devices": b"0"}, r"devices=b'0' is of type bytes; give nvidia-smi indices"),
        ({"devices": [b"0"]}, r"devices=\[b'0'\] holds b'0' of type bytes"),
        ({"devices": {0: "GPU:0"}}, r"devices=\{0: 'GPU:0'\} is of type dict"),
        ({"nvidia_smi": 3}, r"nvidia_smi=3 is of type int; give the path of nvidia-smi"),
    ],
)
def test_monitor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        Monitor(**kwargs)


def test_monitor_cannot_be_entered_twice_at_once(nvidia_smi_several_gpus_busy):
    monitor = Monitor(interval=60)
    with monitor, pytest.raises(UtilizationError, match="already running"), monitor:
        pass
    with monitor:  # and can run again afterwards
        pass
    assert monitor.summaries[0].samples == 1


# --- check -----------------------------------------------------------------------------------


def test_check_busy_gpus_with_a_function(nvidia_smi_several_gpus_busy):
    calls = []
    verdicts = utilization.check(calls.append, "x", duration=0.05, interval=0.01)
    assert len(calls) >= 2 and set(calls) == {"x"}  # a warm-up call, then the measured ones
    assert [v.busy for v in verdicts] == [True] * 4
    assert [v.summary.utilization_gpu_mean for v in verdicts] == [97.0, 93.0, 100.0, 91.0]
    first = verdicts[0]
    assert "mean utilisation 97.0 % meets the 90 % threshold (min 97 %, max 97 %" in first.reason
    assert "tfshard.parallelize" in first.hint
    text = str(first)
    assert text.startswith(f"GPU 0 {A100} (/device:GPU:0): busy enough to scale out\n")
    assert "hint: " in text


def test_check_not_busy_gpu_gets_a_batch_hint(nvidia_smi_one_gpu_idle):
    busy, idle = utilization.check(duration=0.02, interval=0.01)
    assert busy.busy and not idle.busy
    assert "mean utilisation 3.0 % is below the 90 % threshold" in idle.reason
    assert "raise the per-device batch size" in idle.hint
    assert "not busy enough to scale out" in str(idle)
    [only] = utilization.check(duration=0.02, interval=0.01, devices=1, threshold=2)
    assert only.busy and only.summary.index == 1


def test_check_bursty_gpu_gets_an_input_pipeline_hint(nvidia_smi_utilization_changes):
    state = nvidia_smi_utilization_changes

    def step() -> None:
        # Returns after four more nvidia-smi calls, so the measured step sees at least four
        # consecutive samples of the cycle 10, 60, 90, 100: max 100, mean at most 75.
        start = _calls(state)
        _wait_for(lambda: _calls(state) >= start + 4)

    gpu0, _ = utilization.check(step, duration=0, interval=0.01)
    assert not gpu0.busy and gpu0.summary.utilization_gpu_max == 100
    assert "move input preprocessing off the critical path" in gpu0.hint
    assert "keep logs and metrics on the device" in gpu0.hint


def test_check_gpu_without_utilization_is_not_called_busy(nvidia_smi_mig_enabled):
    verdicts = utilization.check(duration=0.01, interval=0.01)
    assert [v.busy for v in verdicts] == [False, False]
    assert "reports no utilisation" in verdicts[0].reason
    assert "DCGM" in verdicts[0].hint


def test_check_fails_before_running_fn_without_a_driver(no_nvidia_driver):
    calls = []
    with pytest.raises(UtilizationError, match="no NVIDIA driver found"):
        utilization.check(calls.append, 1, duration=0.01)
    assert calls == []


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"threshold": -1}, r"threshold=-1; give a percentage from 0 to 100"),
        ((), {"threshold": 100.5}, r"threshold=100\.5"),
        ((), {"duration": -0.1}, r"duration=-0\.1; give the seconds to measure, >= 0"),
        ((), {"duration": True}, r"duration=True; give the seconds to measure"),
        ((), {"threshold": "90"}, r"threshold='90'; give a percentage"),
        ((), {"interval": -1}, r"interval=-1"),
        ((3,), {}, r"fn=3 is not callable"),
        ((None, 1), {}, r"arguments \(1,\) were given without fn"),
    ],
)
def test_check_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        utilization.check(*args, **kwargs)


# --- recorded on a real H100 (scenarios/RECORDED.md) -----------------------------------------

H100 = "NVIDIA H100 80GB HBM3"
H100_UUID = "GPU-34648018-ada4-d632-4133-0e940ada8395"


@pytest.mark.parametrize(
    ("scenario", "util", "mem_util", "used"),
    [("h100_idle", 0, 0, 0), ("h100_busy", 100, 9, 1651)],
)
def test_query_reads_a_real_h100(fake_nvidia_smi, scenario, util, mem_util, used):
    fake_nvidia_smi(scenario)
    [gpu] = utilization.query()
    assert (gpu.index, gpu.uuid, gpu.name) == (0, H100_UUID, H100)
    assert (gpu.utilization_gpu, gpu.utilization_memory) == (util, mem_util)
    assert (gpu.memory_used_mib, gpu.memory_total_mib) == (used, 81559)
    assert gpu.device == "/device:GPU:0"


def test_parse_reads_a_real_h100_table_with_units_and_header():
    text = (fake.SCENARIOS / "h100_idle_with_units_and_header.txt").read_text()
    assert utilization.parse(text) == utilization.parse(
        (fake.SCENARIOS / "h100_idle.txt").read_text()
    )


def test_check_a_real_h100_ramp_is_not_steadily_busy(fake_nvidia_smi):
    # Recorded: 13 idle samples, 16 at 100 %, one at 4 %, 10 idle; each call reads the next.
    state = fake_nvidia_smi("h100_ramp")

    def ramp() -> None:
        start = _calls(state)
        _wait_for(lambda: _calls(state) >= start + 39)

    [gpu] = utilization.check(ramp, duration=0, interval=0.001)
    assert not gpu.busy
    assert (gpu.summary.utilization_gpu_min, gpu.summary.utilization_gpu_max) == (0, 100)
    assert 0 < gpu.summary.utilization_gpu_mean < 90
    assert gpu.summary.memory_used_peak_mib == 1651


# --- the table -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("readings", "threshold", "message"),
    [
        (None, 90, r"readings=None is of type NoneType; pass a list of GpuReading"),
        ("0, GPU-1, A100, 1, 1, 1, 1", 90, r"readings='0, GPU-1.* is of type str; pass a list"),
        ([{"index": 0}], 90, r"readings holds \{'index': 0\} of type dict; pass a list"),
        ([], "x", r"threshold='x'; give a percentage from 0 to 100"),
        ([], 500, r"threshold=500; give a percentage from 0 to 100"),  # the bar is a percentage
        ([], -1, r"threshold=-1; give a percentage"),
        ([], True, r"threshold=True; give a percentage"),
    ],
)
def test_format_table_rejects_what_it_cannot_show(readings, threshold, message):
    with pytest.raises(ArgumentError, match=message):
        utilization.format_table(readings, threshold)


def test_format_table_takes_any_iterable_of_readings():
    reading = GpuReading(0, U0, A100, 93.0, 41.0, 15012, 40960, "/device:GPU:0")
    assert utilization.format_table(iter([reading])) == utilization.format_table((reading,))


def test_format_table_shows_a_dash_for_a_gpu_tensorflow_does_not_see():
    reading = GpuReading(3, None, None, None, 12.0, 1, 2)
    assert utilization.format_table([reading], threshold=50).splitlines()[1].split() == [
        "3",
        "-",
        "?",
        "n/a",
        "12",
        "1",
        "/",
        "2",
        "n/a",
    ]


def test_format_table_aligns_columns_and_marks_the_threshold():
    readings = [
        GpuReading(0, U0, A100, 93.0, 41.0, 15012, 40960, "/device:GPU:0"),
        GpuReading(1, U1, A100, 7.5, 3.0, 812, 40960, devices=("/device:GPU:1", "/device:GPU:2")),
    ]
    assert utilization.format_table(readings, threshold=50).splitlines() == [
        "gpu  tf device                     name                   util %  mem util %  "
        "memory MiB     vs 50 %",
        "  0  /device:GPU:0                 NVIDIA A100-SXM4-40GB      93          41  "
        "15012 / 40960  ok",
        "  1  /device:GPU:1, /device:GPU:2  NVIDIA A100-SXM4-40GB     7.5           3  "
        "812 / 40960    below",
    ]
