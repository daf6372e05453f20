"""The public surface changes only on purpose."""

import importlib
import os
import pathlib
import subprocess
import sys
import types

import tfshard

CONTRACT = {
    # ../shared/DESIGN.md, "Public contract"
    "num_gpus",
    "cpu",
    "gpu",
    "try_gpu",
    "try_all_gpus",
    "list_devices",
    "resolve_device",
    "ContextMap",
    "virtual_devices",
    "to_device",
    "pin",
    "parallelize",
    "TfshardError",
    "utilization",
    # Context maps made active, the wrapper type, and the error family.
    "use_contexts",
    "set_contexts",
    "active_contexts",
    "ShardedFunction",
    "ArgumentError",
    "ContextMapError",
    "DeviceError",
    "DeviceSetupError",
    "ShardError",
    "UtilizationError",
    # Beyond one graph: clusters (issue 8) and one process per device.
    "connect",
    "processes",
    "ClusterError",
    "WorkerError",
    # A copy of the weights per device (issue 13): apply_gradients, Replicas.
    "replicas",
    # What ran where and when in one call (issue 24): f.timeline(x) returns one.
    "Timeline",
}


def test_all_is_the_documented_contract():
    assert isinstance(tfshard.__all__, tuple)
    assert set(tfshard.__all__) == CONTRACT


def test_every_public_name_resolves_to_what_its_module_defines():
    for name in tfshard.__all__:
        value = getattr(tfshard, name)
        if isinstance(value, types.ModuleType):  # processes, replicas, utilization
            assert value is importlib.import_module(f"tfshard.{name}"), name
        else:
            home = importlib.import_module(value.__module__)
            assert getattr(home, name) is value, name
            assert value.__module__.startswith("tfshard."), (name, value.__module__)
    assert callable(tfshard.utilization.query)


def test_errors_form_one_family():
    for name in ("ArgumentError", "ContextMapError", "DeviceError"):
        error = getattr(tfshard, name)
        assert issubclass(error, tfshard.TfshardError) and issubclass(error, ValueError)
    for name in ("DeviceSetupError", "UtilizationError", "ClusterError", "WorkerError"):
        assert issubclass(getattr(tfshard, name), RuntimeError)
    assert issubclass(tfshard.ShardError, tfshard.TfshardError)


def test_importing_tfshard_does_not_import_tensorflow():
    code = "import sys, tfshard; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_attribute():
    try:
        tfshard.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def _readme_block(after: str, language: str) -> str:
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split(after, 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_the_readme_first_snippet_runs_as_written_and_prints_its_table():
    code = _readme_block("## What it does", "python")
    shown = _readme_block("The snippet prints", "")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == shown.strip()
