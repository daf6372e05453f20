"""The public surface changes only on purpose, and the modules import each other one way."""

import ast
import importlib
import pathlib
import subprocess
import sys
import types

import children

import tfshard

PACKAGE = pathlib.Path(tfshard.__file__).parent

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
    # A long job's outputs on disk (issue 31): what f.write(ds, path) wrote, and its error.
    "load",
    "WriteError",
    # Where a shard is, inside the function (issue 30).
    "shard_index",
    "row_index",
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
    # A write that the disk refused is still an OSError, with its errno.
    assert issubclass(tfshard.WriteError, tfshard.TfshardError)
    assert issubclass(tfshard.WriteError, OSError)
    assert issubclass(tfshard.ShardError, tfshard.TfshardError)


def test_importing_tfshard_does_not_import_tensorflow():
    out = children.python("import sys, tfshard; print('tensorflow' in sys.modules)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_python_m_tfshard_utilization_imports_no_tensorflow():
    # The command line runs where TensorFlow may be broken or slow to start (a GPU node
    # being checked), so neither the core nor its command line may pull it in.
    code = (
        "import sys, tfshard.utilization.__main__\n"
        "print('tensorflow' in sys.modules, 'tfshard.parallel' in sys.modules)"
    )
    out = children.python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name, from the files on disk."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules a file imports: at its top or inside a function (a lazy import counts).

    Imports under ``if TYPE_CHECKING:`` are left out: they never run.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..y import z
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                # `from tfshard import _gpu_ids` imports a module; `from tfshard.errors
                # import ArgumentError` imports tfshard.errors.
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found - {name}


def test_no_module_imports_one_that_imports_it_back_even_lazily():
    # STYLE.md: data flows one way, with no lazy cycles. A cycle broken by an import inside
    # a function still ties two modules into one; this finds it from the source.
    modules = _modules()
    graph = {
        name: sorted(dep for dep in _imports(name, path, modules) if dep in modules)
        for name, path in modules.items()
    }
    done: set[str] = set()

    def walk(name: str, stack: list[str]) -> None:
        if name in stack:
            cycle = stack[stack.index(name) :] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in graph[name]:
            walk(dep, [*stack, name])
        done.add(name)

    for name in graph:
        walk(name, [])


def test_the_utilization_core_never_imports_its_command_line():
    # gpustat's rule: `python -m tfshard.utilization` runs utilization/__main__.py, which
    # imports the core; no file of the core imports the command line, not even lazily.
    modules = _modules()
    cli = "tfshard.utilization.__main__"
    assert "tfshard.utilization" in _imports(cli, modules[cli], modules)
    core = [n for n in modules if n.startswith("tfshard.utilization") and n != cli]
    assert core
    for name in core:
        imported = _imports(name, modules[name], modules)
        assert not [m for m in imported if m.endswith("__main__")], modules[name]


def test_every_module_imports_first_with_nothing_of_tfshard_loaded():
    # An import cycle breaks only when the import starts at a particular module, so each
    # module is imported first in turn, after every tfshard module is unloaded. TensorFlow
    # stays loaded in between: a fresh interpreter per module would spend two minutes
    # starting TensorFlow again, and a cycle lies in the order of tfshard's own imports.
    code = (
        "import importlib, sys, traceback\n"
        "import tensorflow\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'tfshard']:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        print(name, traceback.format_exc())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *_modules()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PACKAGE.parent,
        env=children.environ(TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert done.returncode == 0 and not done.stdout, done.stdout + done.stderr[-2000:]


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
    result = children.python(code, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == shown.strip()
