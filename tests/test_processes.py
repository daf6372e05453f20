"""Tests of tfshard.processes: one worker process per device.

Each worker is a spawned Python that imports TensorFlow (seconds each), so the
cases that start workers are few and use two workers. The worker functions
live at the top level of this module: the workers import it to find them.
"""

import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import children
import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import processes
from tfshard.errors import ArgumentError, DeviceError, TfshardError

_log = logging.getLogger(__name__)


_SPAWN_ENV = ("CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH", "PYTHONPATH")


def _report(arg, *, scale):
    return {
        "value": arg * scale,
        "pid": os.getpid(),
        "environ": {name: os.environ.get(name) for name in _SPAWN_ENV},
    }


def _fail_when_partner_sleeps(role, *, pid_dir):
    """Worker "sleep" ignores SIGTERM and sleeps; worker "fail" raises once it sleeps."""
    if role == "sleep":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (pid_dir / "sleeper").write_text(str(os.getpid()))
        time.sleep(600)
        return "woke up"
    deadline = time.monotonic() + 60
    while not (pid_dir / "sleeper").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError(f"bad sample in shard {role}")


def _sleep(arg):
    time.sleep(600)


def _exit_abruptly(arg):
    if arg == "die":
        os._exit(3)
    time.sleep(600)


def _start_grandchild(then, *, pid_dir, ignore_term=False):
    """Starts a process that outlives this worker unless its group is ended, then `then`."""
    command = ["sleep", "60"]
    if ignore_term:  # an ignored signal stays ignored across exec
        command = ["sh", "-c", "trap '' TERM; exec sleep 60"]
    child = subprocess.Popen(command)
    (pid_dir / f"grandchild-{os.getpid()}").write_text(str(child.pid))
    if then == "hang":
        time.sleep(600)
    return child.pid


class _Started(list):
    """The pids of the workers a run started, in order: run_per_device's `on_start`."""

    def __call__(self, index, pid):
        assert index == len(self), (index, self)
        self.append(pid)


@pytest.fixture
def worker_pids():
    """Records the workers a test starts: pass it as ``on_start=worker_pids``."""
    return _Started()


def _running(pid):
    """Whether pid runs (not gone, not a zombie); Linux's /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _assert_all_gone(pids):
    assert multiprocessing.active_children() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # Joined, so reaped: not even a zombie is left.


def test_results_come_back_in_order_each_worker_in_the_environment_placed(
    worker_pids, monkeypatch, fake_gpus
):
    # A CPU worker and two sharing (fake) GPU 1: each is spawned with what placements()
    # says, and this process's import path; this process's own environment is left as it was.
    fake_gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    devices = ["cpu", "gpu:1", "cuda1"]
    results = processes.run_per_device(
        _report, [3, 5, 7], shared={"scale": 10}, devices=devices, timeout=120,
        on_start=worker_pids,
    )
    assert [r["value"] for r in results] == [30, 50, 70]
    path = processes.child_environ()["PYTHONPATH"]
    assert path.endswith(os.pathsep + "/elsewhere")
    want = [
        {"TF_FORCE_GPU_ALLOW_GROWTH": None, **p.environ, "PYTHONPATH": path}
        for p in processes.placements(3, devices)
    ]
    assert [r["environ"] for r in results] == want
    assert [w["CUDA_VISIBLE_DEVICES"] for w in want] == ["", "6", "6"]
    assert [w["TF_FORCE_GPU_ALLOW_GROWTH"] for w in want] == [None, "true", "true"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert os.environ["PYTHONPATH"] == "/elsewhere"
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in os.environ
    # Each is its own process, and on_start heard of each as it started, in order.
    assert [r["pid"] for r in results] == worker_pids
    assert os.getpid() not in worker_pids
    _assert_all_gone(worker_pids)


def test_failing_worker_reports_device_and_traceback_and_others_stop(worker_pids, tmp_path):
    # The sleeper ignores SIGTERM, so stopping it takes the SIGKILL after the grace.
    expected = (
        r"worker 0 of 2 on cpu \(CUDA_VISIBLE_DEVICES=''\) failed: ValueError: bad sample "
        "in shard fail; the other workers were stopped"
    )
    with pytest.raises(processes.WorkerError, match=expected) as caught:
        processes.run_per_device(
            _fail_when_partner_sleeps,
            ["fail", "sleep"],
            shared={"pid_dir": tmp_path},
            devices=["cpu", "cpu"],
            timeout=120,
            grace=0.5,
            on_start=worker_pids,
        )
    error = caught.value
    assert isinstance(error, TfshardError)
    assert (error.index, error.device) == (0, "cpu")
    assert "in _fail_when_partner_sleeps" in error.traceback
    assert "Worker traceback:" in str(error)
    sleeper = int((tmp_path / "sleeper").read_text())
    assert sleeper in worker_pids
    _assert_all_gone(worker_pids)


def test_workers_past_the_timeout_are_stopped(worker_pids):
    start = time.monotonic()
    with pytest.raises(processes.WorkerError, match=r"did not finish within timeout=2 s"):
        processes.run_per_device(
            _sleep, [0, 1], devices=["cpu", "cpu"], timeout=2, grace=5, on_start=worker_pids
        )
    assert time.monotonic() - start < 2 + 2 * 5  # the workers sleep 600 s: not waited for
    assert len(worker_pids) == 2
    _assert_all_gone(worker_pids)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_processes_a_worker_started_end_with_it_on_timeout(worker_pids, tmp_path, process_gone):
    # The worker imports TensorFlow before it starts its child: seconds, or a minute on a
    # busy GPU machine. The timeout counts once on_start returns, and on_start waits for the
    # child, so the timeout passes with the worker hanging after starting it, however long
    # the imports took.
    def once_its_child_runs(index, pid):
        worker_pids(index, pid)
        while not any(tmp_path.glob("grandchild-*")):
            assert _running(pid), "the worker died before its child ran"
            time.sleep(0.05)

    with pytest.raises(processes.WorkerError, match=r"did not finish within timeout=1 s"):
        processes.run_per_device(
            _start_grandchild,
            ["hang"],
            shared={"pid_dir": tmp_path},
            devices=["cpu"],
            timeout=1,
            on_start=once_its_child_runs,
        )
    [pid_file] = tmp_path.glob("grandchild-*")
    assert process_gone(int(pid_file.read_text()))
    _assert_all_gone(worker_pids)


def test_processes_a_worker_started_end_after_a_normal_exit(worker_pids, tmp_path, process_gone):
    # One child ignores SIGTERM, so ending it takes the SIGKILL after the grace.
    grandchildren = processes.run_per_device(
        _start_grandchild,
        ["return", "return"],
        shared={"pid_dir": tmp_path, "ignore_term": True},
        devices=["cpu", "cpu"],
        timeout=120,
        grace=0.5,
        on_start=worker_pids,
    )
    assert all(process_gone(pid, seconds=5) for pid in grandchildren)
    _assert_all_gone(worker_pids)


def test_worker_that_exits_without_a_result_is_reported(worker_pids):
    with pytest.raises(
        processes.WorkerError,
        match=r"worker 1 of 2 on cpu \(CUDA_VISIBLE_DEVICES=''\) exited with code 3 before "
        "reporting a result",
    ):
        processes.run_per_device(
            _exit_abruptly, ["sleep", "die"], devices=["cpu", "cpu"], timeout=120,
            on_start=worker_pids,
        )
    _assert_all_gone(worker_pids)


# A script the tests run as a terminal runs a job in the foreground, and press Ctrl-C in.
# Its workers live in it (a spawned worker imports the script to find `work`), each
# with a child of its own; with "ignore", workers and children ignore SIGTERM (a worker
# notes each SIGTERM in a file "term-<index>" and sleeps on).
INTERRUPTED_RUN = """
import os, signal, subprocess, sys, time
from pathlib import Path

def work(index, *, pid_dir, ignore_term):
    command = ["sleep", "600"]
    if ignore_term:
        signal.signal(signal.SIGTERM, lambda *_: Path(pid_dir, f"term-{index}").touch())
        command = ["sh", "-c", "trap '' TERM; exec sleep 600"]
    child = subprocess.Popen(command)
    part = Path(pid_dir, f"part-{index}")  # renamed when whole: the test reads it meanwhile
    part.write_text(f"{os.getpid()} {child.pid}")
    part.replace(Path(pid_dir, f"worker-{index}"))
    time.sleep(600)

if __name__ == "__main__":
    from tfshard import processes

    pid_dir, ignore_term, grace = sys.argv[1], sys.argv[2] == "ignore", float(sys.argv[3])
    try:
        processes.run_per_device(
            work, [0, 1], shared={"pid_dir": pid_dir, "ignore_term": ignore_term},
            devices=["cpu", "cpu"], grace=grace,
        )
    except KeyboardInterrupt:
        print(f"interrupted at {time.monotonic()}", flush=True)  # the clock all processes share
        raise
"""


def _group_members(groups):
    """The pids of the processes, zombies aside, whose process group is in `groups`."""
    members = set()
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in groups and fields[0] != "Z":
            members.add(int(stat_path.parent.name))
    return members


@contextlib.contextmanager
def _run_in_a_terminal(tmp_path, workers):
    """Runs INTERRUPTED_RUN as a terminal's foreground job until both workers' children run.

    Yields the parent (a Popen whose stdout and stderr go to files) and the pids of every
    process then in the process groups involved: the parent's (the parent, and
    multiprocessing's resource tracker, which the terminal's Ctrl-C reaches too) and each
    worker's (the worker and its child). What is left of them at the end is SIGKILLed,
    so a failing test leaves nothing running.
    """
    script = tmp_path / "interrupted_run.py"
    script.write_text(INTERRUPTED_RUN)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = children.environ()  # this checkout's tfshard, in every process
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        parent = subprocess.Popen(
            [sys.executable, str(script), str(pid_dir), workers, str(_SCRIPT_GRACE_S)],
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,  # its own group, as a terminal gives a job
            preexec_fn=children.as_in_a_terminal,
        )
    pids = set()
    try:
        deadline = time.monotonic() + 60  # two workers importing TensorFlow: seconds
        while len(list(pid_dir.glob("worker-*"))) < 2:
            assert parent.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline, "the workers did not start within 60 s"
            time.sleep(0.05)
        workers = {int(f.read_text().split()[0]) for f in pid_dir.glob("worker-*")}
        pids = _group_members({parent.pid} | workers)
        grandchildren = {int(f.read_text().split()[1]) for f in pid_dir.glob("worker-*")}
        assert workers | grandchildren <= pids
        yield parent, pids
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ctrl_c(parent):
    """Presses Ctrl-C: SIGINT to the terminal's foreground process group, the parent's."""
    os.killpg(parent.pid, signal.SIGINT)
    return time.monotonic()


def _exit_after_ctrl_c(parent, tmp_path, pressed, limit):
    """Waits up to `limit` s for the parent to exit after the Ctrl-C pressed at `pressed`.

    Returns:
      The seconds from the Ctrl-C to the call's KeyboardInterrupt, logged with the
      seconds to the parent's exit (``--log-cli-level=INFO`` shows them).
    """
    try:
        parent.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        out = (tmp_path / "stdout").read_text()
        raised = f"{float(out.split()[2]) - pressed:.2f} s" if out else "never"
        pytest.fail(
            f"the parent did not exit within {limit} s of the Ctrl-C; the call raised "
            f"KeyboardInterrupt after {raised}"
        )
    exited = time.monotonic() - pressed
    out = (tmp_path / "stdout").read_text()
    assert out.startswith("interrupted at"), (out, (tmp_path / "stderr").read_text()[-3000:])
    raised = float(out.split()[2]) - pressed
    _log.info(
        "Ctrl-C: the call raised after %.3f s, the parent exited after %.3f s", raised, exited
    )
    return raised


# The grace the script gives its workers, and the bound on every wait for what a Ctrl-C
# ends: far apart, so a call that waited out the grace fails however busy the machine is,
# and one that did not passes (quiet, the call raises within a second of the Ctrl-C and the
# parent's interpreter and TensorFlow shut down in 0.5-2 s; far longer beside busy loops).
_SCRIPT_GRACE_S = 600
_EXIT_LIMIT_S = 90.0


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process groups from /proc")
def test_one_ctrl_c_stops_cooperative_workers_at_once(tmp_path, process_gone):
    # The workers die of SIGTERM, their children too: the call does not wait out the grace
    # (nor, before, for init to reap the children, 1.1-2.0 s on a quiet machine).
    with _run_in_a_terminal(tmp_path, "cooperative") as (parent, pids):
        assert len(pids) >= 6  # parent, resource tracker, two workers, their two children
        pressed = _ctrl_c(parent)
        _exit_after_ctrl_c(parent, tmp_path, pressed, _EXIT_LIMIT_S)
        assert parent.returncode == -signal.SIGINT
        assert [pid for pid in pids if not process_gone(pid, seconds=_EXIT_LIMIT_S)] == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process groups from /proc")
def test_a_second_ctrl_c_kills_workers_that_ignore_sigterm_at_once(tmp_path, process_gone):
    # The first Ctrl-C sends SIGTERM, which workers and children ignore, and waits out the
    # grace; the second kills every group then. Before, the second broke out of the wait,
    # and the parent hung at exit joining workers that still ran.
    with _run_in_a_terminal(tmp_path, "ignore") as (parent, pids):
        _ctrl_c(parent)
        terms = [tmp_path / "pids" / f"term-{i}" for i in range(2)]
        deadline = time.monotonic() + _EXIT_LIMIT_S
        while not all(term.exists() for term in terms):  # each worker got its SIGTERM
            assert time.monotonic() < deadline, "the first Ctrl-C sent no SIGTERM"
            time.sleep(0.05)
        assert parent.poll() is None  # waiting out the grace, for workers that ignore SIGTERM
        pressed = _ctrl_c(parent)
        _exit_after_ctrl_c(parent, tmp_path, pressed, _EXIT_LIMIT_S)
        assert parent.returncode == -signal.SIGINT
        assert [pid for pid in pids if not process_gone(pid, seconds=_EXIT_LIMIT_S)] == []


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (),
            dict(devices=["cpu"]),
            ArgumentError,
            "devices has 1 entries but per_device_args has 2",
        ),
        (
            (),
            dict(devices=["gpu:99", "cpu"]),
            DeviceError,
            r"devices\[0\]='gpu:99': this process has",
        ),
        ((), dict(devices=["tpu:0", "cpu"]), DeviceError, "is not a local device for a worker"),
        ((), dict(devices="cpu"), ArgumentError, r"devices='cpu': pass a list with one device"),
        ((), dict(devices=0), ArgumentError, r"devices=0: pass a list"),
        (
            (),
            dict(devices=[1.0, "cpu"]),
            ArgumentError,
            r"devices\[0\]=1\.0 is a float; give a GPU",
        ),
        ((), dict(devices=[True, "cpu"]), ArgumentError, r"devices\[0\]=True is a bool"),
        ((), dict(devices=[None, "cpu"]), ArgumentError, r"devices\[0\]=None is a NoneType"),
        ((), dict(devices=[-1, "cpu"]), ArgumentError, r"devices\[0\]=-1: a GPU index is >= 0"),
        ((), dict(timeout=0), ArgumentError, r"timeout=0: give a finite number of seconds > 0"),
        ((), dict(timeout=-5), ArgumentError, r"timeout=-5: give a finite number"),
        ((), dict(timeout=float("nan")), ArgumentError, r"timeout=nan: give a finite number"),
        ((), dict(timeout=float("inf")), ArgumentError, r"timeout=inf: give a finite number"),
        (
            (),
            dict(timeout="5"),
            ArgumentError,
            r"timeout='5' is a str; give the seconds as a number",
        ),
        ((), dict(timeout=True), ArgumentError, r"timeout=True is a bool; give the seconds"),
        ((), dict(grace=-1), ArgumentError, r"grace=-1: give the seconds a worker gets to exit"),
        ((), dict(grace=float("inf")), ArgumentError, r"grace=inf: .*a finite number >= 0"),
        ((), dict(grace="5"), ArgumentError, r"grace='5': give the seconds"),
        ((), dict(grace=None), ArgumentError, r"grace=None: give the seconds"),
        (
            (),
            dict(shared=["steps", 3]),
            ArgumentError,
            r"shared=\['steps', 3\] is a list; pass a dict",
        ),
        ((), dict(shared="steps=3"), ArgumentError, r"shared='steps=3' is a str; pass a dict"),
        (
            (),
            dict(shared={1: 2}),
            ArgumentError,
            r"shared has keys \[1\]; its keys are keyword-arg",
        ),
        ((), dict(shared={"a-b": 2}), ArgumentError, r"shared has keys \['a-b'\]"),
        (
            ("fn", [0, 1]),
            {},
            ArgumentError,
            r"fn='fn' is not callable; pass a function defined at the top",
        ),
        ((_sleep, "ab"), {}, ArgumentError, r"per_device_args='ab' is a str; pass a list with one"),
        ((), dict(on_start=5), ArgumentError, r"on_start=5 is not callable; pass a function"),
        ((_sleep, range(2).__iter__()), {}, ArgumentError, r"is a range_iterator; pass a list"),
        (
            (_sleep, []),
            {},
            ArgumentError,
            r"per_device_args is empty; give one argument per worker",
        ),
    ],
)
def test_bad_arguments_fail_before_any_worker_starts(worker_pids, args, kwargs, error, match):
    args = args or (_sleep, [0, 1])
    with pytest.raises(error, match=match):
        processes.run_per_device(*args, **{"on_start": worker_pids, **kwargs})
    assert worker_pids == []


@pytest.mark.parametrize(
    ("count", "devices", "match"),
    [
        (0, None, r"count=0: give the number of workers, an int >= 1"),
        (True, None, r"count=True: give the number of workers"),
        (2.0, None, r"count=2\.0: give the number of workers"),
        (2, ["cpu"], r"devices has 1 entries but count is 2; give one device per worker"),
        (1, "cpu", r"devices='cpu': pass a list with one device per worker"),
    ],
)
def test_placements_name_a_bad_count_or_devices(count, devices, match):
    with pytest.raises(ArgumentError, match=match):
        processes.placements(count, devices)


@pytest.mark.parametrize("count", [np.int64(2), np.uint8(2)])
def test_placements_take_a_numpy_count(count):
    assert processes.placements(count, ["cpu", "cpu"]) == processes.placements(2, ["cpu", "cpu"])


def test_devices_may_be_tensorflow_device_objects(monkeypatch, fake_gpus):
    fake_gpus(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = [tf.config.LogicalDevice("/device:GPU:1", "GPU"), tf.DeviceSpec.from_string("/cpu:0")]
    assert [p.visible for p in processes.placements(2, devices)] == ["1", ""]


def test_unpicklable_function_fails_in_the_parent(worker_pids):
    with pytest.raises(ArgumentError, match="must be picklable"):
        processes.run_per_device(
            lambda arg: arg, [0, 1], devices=["cpu", "cpu"], on_start=worker_pids
        )
    assert worker_pids == []  # it failed as the first worker started
    _assert_all_gone(worker_pids)


@pytest.fixture
def fake_gpus(monkeypatch):
    """Fakes this process's tf.config: physical GPUs, the visible ones, logical splits.

    Call it with the number of physical GPUs, optionally visible=[ordinals] (as
    tf.config.set_visible_devices leaves them) and splits={ordinal: [memory limits]} (as
    tfshard.virtual_devices(n, "GPU", memory_limit_mb=...) configures them). The fake's
    logical GPUs replace this process's own, so a test means the same machine on any machine.
    """

    def fake(physical, visible=None, splits=None):
        devices = [
            tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(physical)
        ]
        shown = devices if visible is None else [devices[i] for i in visible]
        configs = {
            devices[i]: [tf.config.LogicalDeviceConfiguration(memory_limit=m) for m in limits]
            for i, limits in (splits or {}).items()
        }
        count = sum(len(configs.get(d) or [None]) for d in shown)
        logical = [tf.config.LogicalDevice(f"/device:GPU:{k}", "GPU") for k in range(count)]

        def listing(devices):
            return lambda device_type=None: list(devices) if device_type == "GPU" else []

        def logical_devices(device_type=None):
            # This process's other devices, and the fake's GPUs in place of its own (a GPU
            # machine's real GPUs would otherwise resolve, and be described, as the fake's).
            found = [d for d in real_logical(device_type) if d.device_type != "GPU"]
            return found + (logical if device_type in (None, "GPU") else [])

        def details(device):
            assert device in devices, device
            return {"device_name": f"fake GPU {device.name[-1]}"}

        monkeypatch.setattr(tf.config, "list_physical_devices", listing(devices))
        monkeypatch.setattr(tf.config, "get_visible_devices", listing(shown))
        monkeypatch.setattr(tf.config, "get_logical_device_configuration", configs.get)
        monkeypatch.setattr(tf.config, "list_logical_devices", logical_devices)
        monkeypatch.setattr(tf.config.experimental, "get_device_details", details)

    real_logical = tf.config.list_logical_devices

    return fake


def _environs(placements):
    return [dict(p.environ) for p in placements]


def test_gpu_workers_see_only_their_gpu(monkeypatch, fake_gpus):
    # Placement only, no worker started: GPU i is entry i of the parent's list.
    fake_gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    placements = processes.placements(4, ["gpu:1", "cuda3", 0, "cpu"])
    assert [p.visible for p in placements] == ["3", "7", "2", ""]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [p.visible for p in processes.placements(2)] == ["0", "1"]
    with pytest.raises(DeviceError, match="5 workers but this process has 4 GPU"):
        processes.placements(5)


def test_context_names_map_workers_to_devices(monkeypatch, fake_gpus):
    fake_gpus(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TFSHARD_CONTEXTS", "dev0->cpu:0;dev1->gpu:1;dev2->gpu:5")
    placements = processes.placements(2, ["dev0", "dev1"])
    assert [p.visible for p in placements] == ["", "1"]
    with pytest.raises(DeviceError, match=r"devices\[0\]='dev2': this process has 2 GPU"):
        processes.placements(2, ["dev2", "cpu"])


def test_a_split_gpu_maps_each_logical_gpu_to_its_physical_gpu(monkeypatch, fake_gpus):
    # Two physical GPUs, the first split in two: GPU:0 and GPU:1 are physical GPU 0,
    # GPU:2 is physical GPU 1. Before, gpu:2 became CUDA_VISIBLE_DEVICES=2: no GPU at all.
    fake_gpus(2, splits={0: [1024, 2048]})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    placements = processes.placements(3, ["gpu:2", "gpu:0", "gpu:1"])
    assert [p.visible for p in placements] == ["1", "0", "0"]
    # The two workers on physical GPU 0 keep their logical GPU's memory limit.
    assert [p.memory_limit_mb for p in placements] == [None, 1024, 2048]
    assert all("TF_FORCE_GPU_ALLOW_GROWTH" not in env for env in _environs(placements))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,4")
    assert [p.visible for p in processes.placements(2, ["gpu:2", "gpu:1"])] == ["4", "6"]
    with pytest.raises(DeviceError, match=r"devices\[0\]='gpu:3': this process has 3 GPU"):
        processes.placements(1, ["gpu:3"])


def test_a_visible_subset_maps_to_the_parents_entries(monkeypatch, fake_gpus):
    # tf.config.set_visible_devices(physical[1:]) in a parent started with "4,6,7":
    # GPU:0 is physical GPU 1, entry "6".
    fake_gpus(3, visible=[1, 2])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6,7")
    placements = processes.placements(3, ["gpu:0", "gpu:1", "cpu"])
    assert _environs(placements) == [
        {"CUDA_VISIBLE_DEVICES": "6"},
        {"CUDA_VISIBLE_DEVICES": "7"},
        {"CUDA_VISIBLE_DEVICES": ""},
    ]
    assert [p.visible for p in processes.placements(2)] == ["6", "7"]


def test_workers_sharing_a_gpu_allow_memory_growth(monkeypatch, fake_gpus):
    fake_gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    placements = processes.placements(4, ["gpu:1", "gpu:0", "gpu:1", "cpu"])
    assert _environs(placements) == [
        {"CUDA_VISIBLE_DEVICES": "GPU-bbbb", "TF_FORCE_GPU_ALLOW_GROWTH": "true"},
        {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"},
        {"CUDA_VISIBLE_DEVICES": "GPU-bbbb", "TF_FORCE_GPU_ALLOW_GROWTH": "true"},
        {"CUDA_VISIBLE_DEVICES": ""},
    ]
    # Two logical GPUs of one split GPU, with no memory limit: growth too.
    fake_gpus(1, splits={0: [None, None]})
    placements = processes.placements(2, ["gpu:0", "gpu:1"])
    assert [p.environ.get("TF_FORCE_GPU_ALLOW_GROWTH") for p in placements] == ["true"] * 2


def test_a_child_finds_what_this_process_found_however_it_found_it(tmp_path, monkeypatch):
    # A module only this process's sys.path leads to (a script's sys.path.insert, pytest's
    # root), TensorFlow wherever this process found it (a venv, PYTHONPATH), and a caller's
    # own PYTHONPATH: a child gets all three, and not the interpreter's own directories.
    found = tmp_path / "found_at_run_time"
    found.mkdir()
    (found / "only_here.py").write_text("")
    monkeypatch.syspath_prepend(str(found))
    env = processes.child_environ(environ={**os.environ, "PYTHONPATH": "/elsewhere"})
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == str(found) and entries[-1] == "/elsewhere"
    assert os.path.join(os.path.realpath(sys.base_prefix), "lib") not in entries
    code = (
        "import importlib.util as u, only_here; "
        "print(u.find_spec('tensorflow').origin); print(u.find_spec('tfshard').origin)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [tf.__file__, tfshard.__file__]


def test_a_worker_gives_its_gpu_the_logical_memory_limit(monkeypatch, fake_gpus):
    fake_gpus(1)
    calls = []
    monkeypatch.setattr(
        tf.config, "set_logical_device_configuration", lambda *args: calls.append(args)
    )
    processes.limit_gpu_memory(1024)
    [(device, [config])] = calls
    assert device.name == "/physical_device:GPU:0" and config.memory_limit == 1024
