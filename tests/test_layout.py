"""The tree's shape: packages in the order data flows, each importing only those before it; no
import cycles between modules; rooms of one concept (a long module is warned, not failed).

The import graph is read from the source (every `import` / `from ... import` at any depth,
except under `if TYPE_CHECKING:`), so an import hidden inside a function counts too.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxmllm", "sharding")
MAX_LINES = 500
MAX_TRAIN_LINES = 350

# The layers, bottom to top, in the order data flows: a module may import its own layer's and
# those before it, never a later one. A layer is a package (or a top-level module) of jaxmllm;
# `sharding` stands on its own below them all.
LAYERS = (
    ("sharding",),
    ("jaxmllm.config",),
    ("jaxmllm.process",),  # the process before JAX starts: jax.distributed, XLA flags, threads
    ("jaxmllm.data",),  # records and their formats, media, text, the lengths index
    ("jaxmllm.cost",),  # the cost model and its calibration, analytic FLOPs
    ("jaxmllm.pipeline",),  # pipeline parallelism's plan: stages partitioned by the cost model
    ("jaxmllm.plan",),  # step planning: the contract, the planners
    ("jaxmllm.resolve",),  # start-up: auto sizes settled by dry runs of the planner
    ("jaxmllm.batch",),  # bucketize, routing tables, context split, counts, prompts
    ("jaxmllm.feed",),  # the grain iterator: plan -> load -> bucketize -> device
    ("jaxmllm.models",),
    ("jaxmllm.step",),  # the train step, pipeline stages, generation's programs
    ("jaxmllm.loop",),  # checkpoint, guards, ledger, metrics, timings, evaluate
    ("jaxmllm.hf",),
    ("jaxmllm.generate", "jaxmllm.init_from", "jaxmllm.train", "jaxmllm.launch", "jaxmllm"),
    ("jaxmllm.bench",),
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` (at `path`) imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in modules:  # `from a.b import c`: module a.b.c or a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")
                    up = up[: len(up) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for alias in child.names:
                    resolve(f"{base}.{alias.name}")
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer `module` belongs to (its longest matching name)."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    assert best is not None, f"{module} is in no layer of LAYERS: add it where data flows"
    return best[0]


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module from a later layer."""
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)
    )


def test_the_layer_check_finds_a_backward_import():
    graph = {"jaxmllm.data.x": {"jaxmllm.plan.y"}, "jaxmllm.plan.y": {"jaxmllm.config.z"}}
    assert backward_imports(graph) == ["jaxmllm.data.x -> jaxmllm.plan.y"]


def test_packages_import_only_earlier_layers():
    found = backward_imports(import_graph())
    assert not found, "imports from a later layer (see LAYERS): " + "; ".join(found)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (modules that import each other, directly or not): " + (
        "; ".join(" <-> ".join(c) for c in found)
    )


class ModuleSize(UserWarning):
    """A module past the size where a module usually holds two concepts."""


def long_modules(modules: dict[str, Path]) -> list[str]:
    """'path: n lines' for every module past its size (`MAX_LINES`; `train` `MAX_TRAIN_LINES`)."""
    out = []
    for name, path in sorted(modules.items()):
        lines = len(path.read_text().splitlines())
        limit = MAX_TRAIN_LINES if name == "jaxmllm.train" else MAX_LINES
        if lines > limit:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            out.append(f"{where}: {lines} lines (past {limit})")
    return out


def test_module_sizes_are_a_smell_detector_not_a_limit():
    """docs/development.md (Module size and formatting): past ~500 lines a module is usually
    two concepts; then split it by concept, or keep it whole with a reason. A warning, never a
    failure: a cap that fails drives splits by size, and one produced an import circle
    (data/media/kinds <-> data/preprocess). The section it cites is there."""
    assert "\n## Module size and formatting\n" in (ROOT / "docs" / "development.md").read_text()
    for line in long_modules(_modules()):
        warnings.warn(f"{line}: one concept, or two to split?", ModuleSize, stacklevel=1)


def test_a_long_module_is_named_with_its_size(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n")
    found = long_modules({"jaxmllm.x": long, "jaxmllm.y": short})
    assert found == [f"long.py: {MAX_LINES + 1} lines (past {MAX_LINES})"]


def test_no_code_is_kept_from_the_formatter():
    """Code is formatted as ruff formats it, never squeezed past it to pass the size limit
    (docs/development.md, Module size and formatting): no formatter-off markers in any Python
    file of the tree."""
    marks = ("fmt: " + "skip", "fmt: " + "off", "yapf: " + "disable")  # (not this file's own)
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in (*PACKAGES, "tests", "tools")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(mark in line for mark in marks)
    ]
    assert not found, f"formatter markers (remove them and run `ruff format .`): {found}"
