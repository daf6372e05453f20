"""Smoke tests of the example scripts in examples/, on tiny inputs.

Most tests import the scripts and call their functions (and `main`, under
`flagsaver`) in this process, on the 4 logical CPU devices conftest.py made.
A few run the scripts as a user does, in subprocesses started together so
their TensorFlow imports overlap: ``--help``, a bad flag, a bad device, and
check_utilization without nvidia-smi.
"""

import ast
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import children
import numerics
import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver

import tfshard

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = (
    "parallel_map",
    "matmul_scaling",
    "data_parallel_training",
    "per_device_processes",
    "check_utilization",
    "replicated_inference",
    "write_embeddings",
)
THREE = ["cpu:0", "cpu:1", "cpu:2"]


EXPECTED_FLAGS = {
    "parallel_map": (
        "devices",
        "contexts",
        "virtual_devices",
        "num_samples",
        "batch_size",
        "weights",
        "progress",
        "repeats",
    ),
    "matmul_scaling": ("devices", "contexts", "virtual_devices", "size", "repeats"),
    "data_parallel_training": (
        "devices",
        "contexts",
        "virtual_devices",
        "epochs",
        "minibatch_size",
        "num_examples",
        "features",
        "learning_rate",
        "plot",
    ),
    "per_device_processes": (
        "devices",
        "contexts",
        "virtual_devices",
        "learning_rates",
        "steps",
        "timeout",
    ),
    "check_utilization": (
        "gpu",
        "matrix_size",
        "products",
        "threshold",
        "duration",
        "interval",
        "nvidia_smi",
    ),  # fmt: skip
    "replicated_inference": (
        "devices",
        "contexts",
        "virtual_devices",
        "repeats",
        "model",
        "batch",
        "width",
    ),
    "write_embeddings": ("virtual_devices", "rows", "path", "overwrite", "batch_size", "progress"),
}


@pytest.fixture(scope="module")
def ex():
    """The example scripts, imported for this module's tests and unloaded after them.

    The scripts define their flags in absl's process-wide FLAGS, where scripts
    imported by other test modules (benchmarks/) define flags of the same names
    (--plot, --devices). So flags of those names are set aside while these
    tests run and put back afterwards, and the examples' own flags and modules
    are removed.
    """
    values = flags.FLAGS
    names = {name for expected in EXPECTED_FLAGS.values() for name in expected}
    aside = {}
    for name in names & set(values):
        module = values.find_module_defining_flag(name)
        aside[name] = (values[name], module, values.find_module_id_defining_flag(name))
        delattr(values, name)
    if not values.is_parsed():
        values.mark_as_parsed()
    # Workers of per_device_processes import the script by name: keep the
    # directory on sys.path while they are spawned.
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))
        try:
            modules = {name: importlib.import_module(name) for name in ("_common", *SCRIPTS)}
            yield types.SimpleNamespace(**modules)
        finally:
            for name in names & set(values):
                delattr(values, name)
            for name in ("_common", *SCRIPTS):
                sys.modules.pop(name, None)
            for name, (flag, module, module_id) in aside.items():
                values[name] = flag
                if module is not None:
                    values.register_flag_by_module(module, flag)
                if module_id is not None:
                    values.register_flag_by_module_id(module_id, flag)


@pytest.fixture(autouse=True)
def saved_flags(ex):
    """Flag values changed by a test are restored after it."""
    with flagsaver.flagsaver():
        yield


# --------------------------------------------------------------- the CLI


def _run(script, *args, env=None):
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / f"{script}.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=children.environ(env),
    )


# Runs examples/timeline.py with the given flags as if matplotlib were not installed.
_WITHOUT_MATPLOTLIB = f"""\
import runpy, sys
sys.modules["matplotlib"] = None  # import matplotlib -> ImportError
sys.argv[0] = {str(EXAMPLES / "timeline.py")!r}
sys.path.insert(0, {str(EXAMPLES)!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every subprocess run of the module, started at once; name -> (rc, stdout, stderr)."""
    empty_path = str(tmp_path_factory.mktemp("empty_path"))
    no_driver = children.environ(without=("TFSHARD_NVIDIA_SMI",), PATH=empty_path)
    started = {"help": _run("parallel_map", "--help")}
    started["zero_virtual_devices"] = _run("parallel_map", "--virtual_devices=0")
    started["unknown_device"] = _run("matmul_scaling", "--devices=cpu:0,gpu:9", "--size=8")
    started["no_nvidia_smi"] = _run(
        "check_utilization", "--duration=0", "--matrix_size=8", env=no_driver
    )
    copied = tmp_path_factory.mktemp("copied")
    for name in ("parallel_map.py", "_common.py", "_mlp.py"):  # as its docstring says
        (copied / name).write_text((EXAMPLES / name).read_text())
    started["copied"] = subprocess.Popen(
        [sys.executable, "parallel_map.py", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=copied,
        env=children.environ(),
    )
    # timeline.py (imported by test_timeline; its --rows is write_embeddings') where
    # matplotlib is not installed.
    started["plot_without_matplotlib"] = subprocess.Popen(
        [sys.executable, "-c", _WITHOUT_MATPLOTLIB, "--plot=t.png", "--rows=8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path_factory.mktemp("plot"),
        env=children.environ(),
    )
    no_cluster = children.environ(without=("TF_CONFIG",))
    started["no_cluster"] = _run("cluster_map", env=no_cluster)
    quiet = children.environ(no_driver, without=("TF_CPP_MIN_LOG_LEVEL",))
    started["no_driver_log"] = _run("matmul_scaling", "--size=8", "--repeats=1", env=quiet)
    return children.finished(started)


def _user_lines(stderr):
    """stderr without TensorFlow's C++ log lines, which the scripts cannot silence."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip()
        and not line.startswith(("WARNING: All log messages", "I0000", "E0000", "W0000"))
        and "rebuild TensorFlow with the appropriate compiler flags" not in line
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_a_key_flag_with_a_help_string(ex, script):
    # Key flags of a module are what its --help lists.
    module = getattr(ex, script)
    listed = {flag.name: flag.help for flag in flags.FLAGS.get_key_flags_for_module(module)}
    assert set(listed) == set(EXPECTED_FLAGS[script])
    assert all(text and text.strip() for text in listed.values()), listed


def test_help_lists_the_flags(cli_runs):
    code, stdout, stderr = cli_runs["help"]
    assert code == 1, stderr  # absl's --help exits with 1
    listed = {}
    for line in stdout.splitlines():
        if line.startswith("  --"):  # "  --[no]flag: help", continued at 4 spaces
            name, _, text = line[4:].partition(":")
            listed[name.removeprefix("[no]")] = text.strip()
    assert set(listed) == set(EXPECTED_FLAGS["parallel_map"])
    assert all(listed.values()), listed
    assert stdout.startswith("Embed N samples with a small MLP")


def _helpers(script):
    """The examples/ modules `script` imports (_common.py, _mlp.py), as file names."""
    tree = ast.parse((EXAMPLES / script).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return sorted(f"{name}.py" for name in names if (EXAMPLES / f"{name}.py").exists())


def test_each_script_and_the_readme_say_what_to_copy_with_it():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    readme = (REPO / "README.md").read_text()
    start = readme.index("To copy one elsewhere, copy `examples/_common.py`")
    sentence = " ".join(readme[start : readme.index("`make run`", start)].split())
    with_mlp = sentence.partition("`examples/_mlp.py` too for ")[2].partition(":")[0]
    for script in scripts:
        helpers = _helpers(script)
        assert helpers[:1] == ["_common.py"] and set(helpers) <= {"_common.py", "_mlp.py"}
        doc = " ".join(ast.get_docstring(ast.parse((EXAMPLES / script).read_text())).split())
        named = " and ".join(f"``{name}``" for name in helpers)
        assert f"Copy it with {named} (in examples/), which it imports." in doc, script
        assert (f"`{script}`" in with_mlp) == ("_mlp.py" in helpers), script


def test_a_script_copied_with_what_its_docstring_names_runs(cli_runs):
    code, stdout, stderr = cli_runs["copied"]
    assert code == 1, stderr[-2000:]  # absl's --help exits with 1
    assert "ModuleNotFoundError" not in stderr
    assert stdout.startswith("Embed N samples with a small MLP") and "  --devices" in stdout


def test_bad_flag_value_stops_with_one_line(cli_runs):
    code, _, stderr = cli_runs["zero_virtual_devices"]
    assert code == 1
    assert "Traceback" not in stderr
    assert _user_lines(stderr)[0].startswith(
        "FATAL Flags parsing error: flag --virtual_devices=0: 0 is not a positive integer"
    )


def test_no_cuinit_noise_on_a_machine_without_a_driver(cli_runs):
    code, _, stderr = cli_runs["no_driver_log"]
    assert code == 0, stderr[-2000:]
    assert "cuInit" not in stderr and "E0000" not in stderr


def test_tf_logs_stay_where_a_driver_is_installed(ex, monkeypatch, tmp_path):
    driver = tmp_path / "nvidia-smi"
    driver.write_text("#!/bin/sh\n")
    driver.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ex._common.quiet_without_gpu({}) is False
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    # A machine with a driver also has /proc/driver/nvidia; this half is of one without.
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p != "/proc/driver/nvidia" and exists(p))
    environ = {}
    assert ex._common.quiet_without_gpu(environ) is True and environ["TF_CPP_MIN_LOG_LEVEL"] == "3"
    assert ex._common.quiet_without_gpu({"TF_CPP_MIN_LOG_LEVEL": "0"}) is False


def test_unknown_device_stops_with_one_line(cli_runs):
    code, _, stderr = cli_runs["unknown_device"]
    assert code == 1
    assert "Traceback" not in stderr
    lines = _user_lines(stderr)
    assert len(lines) == 1
    assert lines[0].startswith("error: device 'gpu:9' (/device:GPU:9) does not exist")


def test_timeline_plot_without_matplotlib_is_refused_before_any_work(cli_runs):
    code, stdout, stderr = cli_runs["plot_without_matplotlib"]
    assert code == 1
    assert stdout == ""  # not even the device set-up's note: nothing ran
    assert _user_lines(stderr) == [
        "error: --plot needs matplotlib, which is not installed: pip install "
        "'tfshard[plot]' (or pip install matplotlib), or drop --plot"
    ]


def test_cluster_map_without_a_cluster_names_the_flags(cli_runs):
    code, _, stderr = cli_runs["no_cluster"]
    assert code == 1
    assert "Traceback" not in stderr
    lines = _user_lines(stderr)
    assert len(lines) == 1
    assert lines[0].startswith(
        "error: no cluster given and TF_CONFIG is not set: pass --cluster=host1:2222,host2:2222 "
    )
    assert "--start_local_workers=2" in lines[0] and "tfshard.connect" not in lines[0]


def test_check_utilization_without_nvidia_smi_says_so_and_fails(cli_runs):
    code, stdout, stderr = cli_runs["no_nvidia_smi"]
    assert code == 2
    assert stdout == ""
    lines = _user_lines(stderr)
    assert len(lines) == 1
    assert lines[0].startswith("error: no NVIDIA driver found: `nvidia-smi` is not on PATH")


# ------------------------------------------------------ shared flag checks


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(virtual_devices="0"), "0 is not a positive integer"),
        (dict(contexts="dev0=cpu:0"), "expected 'name->device'"),
        (dict(contexts="cpu0->cpu:0"), "begins with 'cpu'"),
        (dict(weights="3,x"), "'x' is not a number"),
        (dict(progress="true"), "give --batch_size too"),
        (dict(learning_rates="0.1,-1"), "a learning rate is > 0"),
        (dict(timeout="0"), "give a number of seconds > 0, or --timeout=inf for no limit"),
        (dict(timeout="nan"), "give a number of seconds > 0, or --timeout=inf for no limit"),
    ],
    ids=[
        "zero_virtual_devices",
        "malformed_contexts",
        "reserved_context_name",
        "weights_not_numbers",
        "progress_without_batch_size",
        "negative_learning_rate",
        "zero_timeout",
        "nan_timeout",
    ],
)
def test_bad_flag_values_are_rejected_with_their_reason(overrides, match):
    with pytest.raises(flags.IllegalFlagValueError, match=match), flagsaver.as_parsed(**overrides):
        pass


def test_setup_devices_resolves_context_names(ex):
    setup = ex._common.setup_devices(4, ["dev1", "dev0"], "dev0->cpu:3;dev1->cpu:1")
    assert setup.devices == ["/device:CPU:1", "/device:CPU:3"]
    assert "split the CPU into 4" in setup.note


def test_setup_devices_refuses_a_device_named_twice_in_flag_words(ex):
    with pytest.raises(tfshard.ArgumentError) as caught:
        ex._common.setup_devices(4, ["cpu:1", "cpu:0", "/device:CPU:1"])
    assert str(caught.value) == (
        "--devices=cpu:1,cpu:0,/device:CPU:1: 'cpu:1' and '/device:CPU:1' are both "
        "/device:CPU:1, and two shards on one device run one after the other; list each "
        "device once"
    )


# ----------------------------------------------------------- parallel_map


def _embed_numpy(x, params):
    hidden = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    out = hidden @ params["w2"]
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_parallel_map_equals_numpy_with_weights_and_uneven_split(ex):
    params = ex.parallel_map.make_params()
    x = ex.parallel_map.make_samples(37)
    f = ex.parallel_map.build(THREE, weights=[2, 1, 1])
    assert f.plan(37) == [19, 9, 9]
    result = ex.parallel_map.measure(f, x, params, repeats=1)
    numerics.assert_close(result.outputs, _embed_numpy(x, params))
    assert result.max_abs_diff < 1e-6
    assert result.seconds > 0 and result.one_device_seconds > 0


def test_parallel_map_dataset_path_and_streaming_search(ex):
    params = ex.parallel_map.make_params()
    x = ex.parallel_map.make_samples(29)
    f = ex.parallel_map.build(THREE)
    result = ex.parallel_map.measure(f, x, params, batch_size=8, repeats=1)
    reference = _embed_numpy(x, params)
    numerics.assert_close(result.outputs, reference)
    cosine = reference @ reference[5]
    cosine[5] = -np.inf
    index, value = ex.parallel_map.most_similar(f, x, params, batch_size=8, query=5)
    assert index == int(np.argmax(cosine))
    assert value == pytest.approx(float(cosine.max()), abs=1e-5)


def test_parallel_map_main_prints_plan_throughput_and_speedup(ex, capsys):
    with flagsaver.as_parsed(
        virtual_devices="4",
        contexts="dev0->cpu:2;dev1->cpu:0",
        devices="dev0,dev1",
        num_samples="40",
        batch_size="16",
        progress="true",
        repeats="1",
    ):
        ex.parallel_map.main(["parallel_map.py"])
    captured = capsys.readouterr()
    out = captured.out
    assert "--virtual_devices=4: split the CPU into 4 logical devices" in out
    assert "devices: /device:CPU:2, /device:CPU:0\n" in out
    assert "as a tf.data.Dataset in global batches of 16" in out
    assert "embed: 16 rows on 2 devices, per sample, gathered on /device:CPU:2" in out
    assert "samples/s on 2 device(s)" in out
    assert f"x over one device (ideal 2x: 2 logical CPU devices on {os.cpu_count()} cores" in out
    assert "outputs match the one-device run's" in out
    assert "streamed with embed.iterate: the sample most like sample 0 is" in out
    assert "embed: batch 3/3  40 samples" in captured.err  # --progress


def test_parallel_map_main_wrong_weights_length_is_one_line(ex):
    overrides = dict(virtual_devices="4", devices="cpu:0,cpu:1", weights="1,2,3")
    with flagsaver.as_parsed(**overrides), pytest.raises(SystemExit) as caught:
        ex.parallel_map.main(["parallel_map.py"])
    message = str(caught.value.code)
    assert message.startswith("error: weights has 3 entries but devices has 2")
    assert "\n" not in message


# ---------------------------------------------------------- matmul_scaling


def test_matmul_scaling_runs_the_same_products_both_ways(ex):
    result = ex.matmul_scaling.measure(THREE, size=24, repeats=1)
    assert result.devices == tuple(f"/device:CPU:{i}" for i in range(3))
    assert result.max_abs_diff < 1e-4
    text = ex.matmul_scaling.report(result, 24)
    assert "3 products of 24x24 float32 matrices" in text
    assert f"3 logical CPU devices on {os.cpu_count()} cores (os.cpu_count())" in text


def test_matmul_scaling_products_are_correct(ex):
    a, b = ex.matmul_scaling.make_inputs(3, 16)
    products = tfshard.parallelize(ex.matmul_scaling.matmul, devices=THREE, per_sample=False)(a, b)
    numerics.assert_close(products.numpy(), a @ b)


# -------------------------------------------------- data_parallel_training


def _train_numpy(ex, x, y, epochs, minibatch_size, learning_rate):
    w, b = np.zeros(x.shape[1], np.float64), 0.0
    for epoch in range(epochs):
        for rows in ex.data_parallel_training.minibatches(len(x), minibatch_size, epoch):
            xb, yb = x[rows].astype(np.float64), y[rows]
            error = 1.0 / (1.0 + np.exp(-(xb @ w + b))) - yb
            w -= learning_rate * xb.T @ error / len(rows)
            b -= learning_rate * error.mean()
    return w, b


@pytest.mark.parametrize(
    ("minibatch_size", "split"),
    [(7, "7 -> 3/2/2; last 5 -> 2/2/1"), (2, "2 -> 1/1/0")],
    ids=["uneven_shards", "minibatch_smaller_than_devices"],
)
def test_data_parallel_training_equals_one_device(ex, minibatch_size, split):
    x, y = ex.data_parallel_training.make_data(40, 5)
    assert ex.data_parallel_training.split_sizes(40, minibatch_size, THREE) == split
    args = (x, y, 2, minibatch_size, 0.5)
    parallel = ex.data_parallel_training.train_data_parallel(THREE, *args)
    reference = ex.data_parallel_training.train_one_device("cpu:3", *args)
    assert ex.data_parallel_training.same_weights(parallel, reference)
    np.testing.assert_allclose(parallel.losses, reference.losses, rtol=1e-5)
    w, b = _train_numpy(ex, *args)
    np.testing.assert_allclose(parallel.w, w, rtol=1e-4, atol=1e-5)
    assert parallel.b == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert parallel.losses[1] < parallel.losses[0]


def test_data_parallel_training_main_prints_loss_curve(ex, capsys, tmp_path):
    plot = tmp_path / "loss.png"
    with flagsaver.as_parsed(
        virtual_devices="4",
        epochs="3",
        num_examples="30",
        features="4",
        minibatch_size="7",
        plot=str(plot),
    ):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            with pytest.raises(SystemExit, match="--plot needs matplotlib"):
                ex.data_parallel_training.main(["data_parallel_training.py"])
            return
        ex.data_parallel_training.main(["data_parallel_training.py"])
    out = capsys.readouterr().out
    assert "7 -> 2/2/2/1; last 2 -> 1/1/0/0" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3
    assert "weights after 3 epochs equal single-device training" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_parallel_training_plot_without_matplotlib_is_one_line(ex, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    plot = str(tmp_path / "loss.png")
    with flagsaver.as_parsed(plot=plot), pytest.raises(SystemExit) as caught:
        ex.data_parallel_training.main(["data_parallel_training.py"])
    message = str(caught.value.code)
    assert message.startswith("error: --plot needs matplotlib, which is not installed")
    assert "\n" not in message


# ---------------------------------------------------- per_device_processes


def test_per_device_processes_runs_one_trial_per_worker(ex, monkeypatch):
    rates = [0.05, 0.2]
    shared = dict(steps=5, num_examples=32, features=4)
    results = ex.per_device_processes.run_sweep(["cpu", "cpu"], rates, timeout=180, **shared)
    assert [r["learning_rate"] for r in results] == rates
    assert [r["visible"] for r in results] == ["", ""]
    assert [r["device"] for r in results] == ["/device:CPU:0", "/device:CPU:0"]
    pids = {r["pid"] for r in results}
    assert len(pids) == 2 and os.getpid() not in pids
    # The same trial in this process, on the CPU as the workers were, gives the same loss.
    monkeypatch.setattr(tfshard, "try_gpu", lambda i=0: tfshard.cpu())
    for rate, result in zip(rates, results):
        here = ex.per_device_processes.train_trial(rate, **shared)
        assert result["loss"] == pytest.approx(here["loss"], rel=1e-5)
    assert results[0]["loss"] != results[1]["loss"]


def test_per_device_processes_chooses_devices(ex):
    choose = ex.per_device_processes.choose_devices
    assert choose(["gpu:1", "cpu"], None) == (["gpu:1", "cpu"], "from --devices")
    assert choose(None, 3)[0] == ["cpu", "cpu", "cpu"]
    with pytest.raises(tfshard.ArgumentError, match="not both"):
        choose(["cpu"], 2)
    if tfshard.num_gpus() == 0:
        devices, note = choose(None, None)
        assert devices == ["cpu", "cpu"]
        assert note.startswith("no GPU found: 2 workers on the CPU")


# ------------------------------------------------------- check_utilization


# fake_nvidia_smi (tests/conftest.py): the recorded nvidia-smi first on PATH, and this
# process's own GPUs hidden from the names, so a scenario's GPUs are named as recorded.


@pytest.mark.parametrize(
    ("scenario", "gpu", "busy"),
    [("several_gpus_busy", 2, True), ("one_gpu_idle", 1, False)],
    ids=["busy_gpu", "idle_gpu"],
)
def test_check_utilization_verdict(ex, fake_nvidia_smi, scenario, gpu, busy):
    fake_nvidia_smi(scenario)
    verdicts = ex.check_utilization.run_check(gpu, 8, duration=0.2, interval=0.05)
    assert [v.summary.index for v in verdicts] == [gpu]
    assert verdicts[0].busy is busy
    assert ex.check_utilization.exit_status(verdicts) == (0 if busy else 1)


def test_check_utilization_main_exit_status_and_verdict(ex, fake_nvidia_smi, capsys):
    fake_nvidia_smi("one_gpu_idle")
    overrides = dict(gpu="1", matrix_size="8", duration="0.2", interval="0.05")
    with flagsaver.as_parsed(**overrides), pytest.raises(SystemExit) as caught:
        ex.check_utilization.main(["check_utilization.py"])
    assert caught.value.code == 1
    out = capsys.readouterr().out
    assert "GPU 1 Tesla V100-SXM2-16GB (/device:GPU:1): not busy enough to scale out" in out


def test_check_utilization_gpu_missing_from_nvidia_smi(ex, fake_nvidia_smi):
    fake_nvidia_smi("one_gpu_idle")
    with pytest.raises(tfshard.ArgumentError, match="devices entry 'GPU:5' names no GPU"):
        ex.check_utilization.run_check(5, 8, duration=0.1, interval=0.05)


@pytest.mark.parametrize("products", [1, 3])
def test_check_utilization_step_computes_the_chain_of_products(ex, products):
    step = ex.check_utilization.make_step("cpu:1", 8, products)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 8), dtype=np.float32)
    b = rng.standard_normal((8, 8), dtype=np.float32)
    for _ in range(products):
        x = np.tanh(x @ b / np.sqrt(8))
    assert step() == pytest.approx(float(x.sum()), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_before_tensorflow_loads(script):
    # --help (or a bad flag) needs none of TensorFlow, which takes seconds to import.
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(EXAMPLES / f'{script}.py')!r}, '--help']\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('tensorflow loaded:', 'tensorflow' in sys.modules, file=sys.stderr)\n"
    )
    result = children.python(code, timeout=60)
    assert "  --" in result.stdout  # the flags are listed
    assert "tensorflow loaded: False" in result.stderr, result.stderr[-2000:]


def test_replicated_inference_prints_the_bytes_crossing_before_and_after(ex, capsys):
    with flagsaver.as_parsed(virtual_devices="4", batch="5", width="16", repeats="1"):
        ex.replicated_inference.main(["replicated_inference.py"])
    out = capsys.readouterr().out
    weights = 4 * (16 * 16 + 16) * 4  # four Dense(16) layers of float32
    # Without replicas shards 1..3 each read all 8 weights from CPU:0; with them, none.
    assert out.count("(8 on /device:CPU:0)") == 3
    assert f"each call reads {3 * weights / 2**10:.1f} KiB of variables" in out  # 12.8 KiB
    assert out.count("each call reads 0 B of variables from other devices") == 1
    assert "outputs equal model(x) on one device" in out


def test_replicated_inference_builds_the_model_on_the_first_device_not_the_default(ex, capsys):
    # On a GPU machine TensorFlow's default device is GPU:0 even when --virtual_devices runs
    # the shards on the CPU (the H100 run of 2026-11-24 found the weights there); here
    # CPU:3 stands in for that default.
    with (
        tfshard.pin("/device:CPU:3"),  # a tf.device scope: the default of the ops inside
        flagsaver.as_parsed(virtual_devices="4", batch="5", width="16", repeats="1"),
    ):
        ex.replicated_inference.main(["replicated_inference.py"])
    out = capsys.readouterr().out
    assert out.count("(8 on /device:CPU:0)") == 3 and "(8 on /device:CPU:3)" not in out


# -------------------------------------------------------- write_embeddings


def test_write_embeddings_writes_what_numpy_embeds(ex, tmp_path):
    params = ex.write_embeddings.make_params()
    f = ex.write_embeddings.build(THREE)
    path = str(tmp_path / "emb")
    written = ex.write_embeddings.write_embeddings(f, params, 37, path, batch_size=8)
    assert (written.rows, written.batches, written.computed_rows) == (37, 5, 37)
    x = ex.write_embeddings.sample_rows(list(range(37)), 8)
    numerics.assert_close(np.load(tmp_path / "emb" / "output.npy"), _embed_numpy(x, params))
    assert ex.write_embeddings.check(path, params, 8) < 1e-5


def test_write_embeddings_main_writes_then_finds_it_written(ex, capsys, tmp_path):
    flags_ = dict(
        virtual_devices="4", rows="40", batch_size="16", path=str(tmp_path / "e"), progress="true"
    )
    for _ in range(2):
        with flagsaver.as_parsed(**flags_):
            ex.write_embeddings.main(["write_embeddings.py"])
    captured = capsys.readouterr()
    out = captured.out
    assert "embedding 40 samples with an MLP 256 -> 512 -> 512 into" in out
    assert "output.npy holds 40 embeddings (0.1 MiB, 3 batches); computed all of them" in out
    assert "output.npy holds 40 embeddings (0.1 MiB, 3 batches); it was written already" in out
    assert "rows match NumPy's embedding to" in out
    assert "embed: batch 3/3  40 samples" in captured.err  # --progress


def test_write_embeddings_over_another_write_says_overwrite_as_a_flag_and_it_replaces(
    ex, capsys, tmp_path
):
    # README's "Long jobs" block writes "embeddings", the script's default --path.
    path = tmp_path / "embeddings"
    other = tfshard.parallelize(lambda s: s * 2.0, devices=THREE)
    other.write(tf.data.Dataset.from_tensor_slices(np.ones([10, 4], np.float32)).batch(4), path)
    flags_ = dict(virtual_devices="4", rows="40", batch_size="16", path=str(path))
    with flagsaver.as_parsed(**flags_), pytest.raises(SystemExit) as caught:
        ex.write_embeddings.main(["write_embeddings.py"])
    message = str(caught.value.code)
    assert message == (
        f"error: embed.write(dataset, {str(path)!r}): the write there was made by the "
        "function '<lambda>', not by 'embed'; pass --overwrite to replace it, or give "
        "another --path"
    )
    with flagsaver.as_parsed(**flags_, overwrite="true"):
        ex.write_embeddings.main(["write_embeddings.py"])
    out = capsys.readouterr().out
    assert "(Ctrl-C, then run again without --overwrite: it resumes)" in out
    assert "output.npy holds 40 embeddings (0.1 MiB, 3 batches); computed all of them" in out
    params = ex.write_embeddings.make_params()
    x = ex.write_embeddings.sample_rows(list(range(40)), 16)
    numerics.assert_close(np.asarray(tfshard.load(path)), _embed_numpy(x, params))
