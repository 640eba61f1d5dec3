"""The import layering of autotuner/, read from the source with ``ast`` (nothing is imported).

* Nothing below the entry points imports one: an entry point is a command line (``python -m ...``), and
  library code that imports it depends on a CLI's arguments, exit codes and side effects.
* The results side (autotuner/results, autotuner/report) imports nothing of Megatron or torch.nn, also
  through what it imports: a report or a comparison is made on a machine without the model stack.
* Each part imports only the parts below it (:data:`PARTS`, docs/extending.md's "The package's parts"): a
  change to the model set-up cannot need a change to the runner, an op cannot reach into a launcher.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1]

# The command lines; they may import anything, nothing else may import them.
ENTRY_POINTS = {
    "autotuner.main",
    "autotuner.calibrate",
    "autotuner.compare",
    "autotuner.report.__main__",
    "autotuner.capture.__main__",
    "autotuner.nsys_read",
    "autotuner.launcher_agreement",
    "autotuner.predict.__main__",
    "autotuner.tune",
}
RESULTS_SIDE = ("autotuner.results", "autotuner.report")
# The parts, top to bottom (a module is in the first part one of whose prefixes it is under): a part may
# import its own modules and those of the parts after it. The structured config knows the launchers' and
# the sampler's settings, so it sits beside the launchers. The results side is used by the parts above
# the ops and may import only the base, the op tree (ops_test.places: names and places, no torch),
# which tells the report which ops make up a layer, and the names of ranges and phases (ops.naming, no
# torch either), which the report's columns and the ranges in a trace share. The predictor reads results
# rows and calibrations, counts parameters from the model config and may run real steps (launchers and
# below): it sits just under the entry points.
PARTS = (
    ("entry", tuple(sorted(ENTRY_POINTS))),
    ("predict", ("autotuner.predict",)),
    ("launchers", ("autotuner.launchers", "autotuner.config")),
    ("capture", ("autotuner.capture",)),
    ("runner", ("autotuner.runner", "autotuner.measure")),
    ("ops", ("autotuner.ops", "autotuner.ops_test", "autotuner.op_mapping")),
    ("model", ("autotuner.model",)),
    ("base", ("autotuner.errors", "autotuner.notices", "autotuner.cli", "autotuner")),
)
RESULTS_USERS = ("entry", "predict", "launchers", "capture", "runner")
RESULTS_MAY_IMPORT = (
    "autotuner.errors",
    "autotuner.notices",
    "autotuner.ops_test.places",
    "autotuner.ops.naming",
)
MODEL_STACK = ("megatron", "torch.nn")


@dataclass(frozen=True)
class Import:
    name: str  # a module, or a module's attribute (``autotuner.results.load_rows``)
    line: int
    top_level: bool  # runs when the module is imported (not inside a function)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import the module can run, lazy ones included; ``if TYPE_CHECKING:`` blocks left out (they
    never run). ``from a import b`` gives both ``a`` and ``a.b`` (b may be a submodule)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def walk(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    walk(other, top_level)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, child.lineno, top_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                found.append(Import(base, child.lineno, top_level))
                found.extend(Import(f"{base}.{alias.name}", child.lineno, top_level) for alias in child.names)
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            walk(child, top_level and not inner)

    walk(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "autotuner").rglob("*.py"))}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def entry_point_imports(root: Path, entry_points: set[str]) -> list[str]:
    """``module:line imports entry`` for each import of an entry point by a module that is not one."""
    found = []
    for name, path in modules(root).items():
        if name in entry_points:
            continue
        for imp in imports_of(path, root):
            if imp.name in entry_points:
                found.append(f"{name}:{imp.line} imports {imp.name}")
    return found


def model_stack_imports(root: Path) -> list[str]:
    """``module -> ... -> import`` for each way a results-side module reaches Megatron or torch.nn: its own
    imports (lazy ones too: a call runs them), then what importing those modules runs, transitively."""
    known = modules(root)
    found = []
    for start in (name for name in known if _within(name, RESULTS_SIDE)):
        chains = {start: [start]}
        queue = [(start, imp) for imp in imports_of(known[start], root)]
        while queue:
            holder, imp = queue.pop()
            if _within(imp.name, MODEL_STACK):
                found.append(" -> ".join([*chains[holder], f"{imp.name} (line {imp.line})"]))
                continue
            # importing a.b.c runs a, a.b and a.b.c: each of ours that is a module
            parts = imp.name.split(".")
            for depth in range(1, len(parts) + 1):
                target = ".".join(parts[:depth])
                if target in known and target not in chains:
                    chains[target] = [*chains[holder], target]
                    queue += [(target, i) for i in imports_of(known[target], root) if i.top_level]
    return found


def part_of(name: str) -> str | None:
    if _within(name, RESULTS_SIDE) and name not in ENTRY_POINTS:
        return "results"
    for part, prefixes in PARTS:
        if name in prefixes if part in ("entry", "base") else _within(name, prefixes):
            return part
    return None  # not ours


def upward_imports(root: Path) -> list[str]:
    """``module:line imports other`` for each import of a part above the importer's (:data:`PARTS`)."""
    order = [part for part, _ in PARTS]
    found = []
    for name, path in modules(root).items():
        mine = part_of(name)
        for imp in imports_of(path, root):
            theirs = part_of(imp.name)
            if theirs is None or theirs == mine:
                continue
            if mine == "results":
                allowed = imp.name == "autotuner" or _within(imp.name, RESULTS_MAY_IMPORT)
            elif theirs == "results":
                allowed = mine in RESULTS_USERS
            else:
                allowed = order.index(theirs) > order.index(mine)
            if not allowed:
                found.append(f"{name}:{imp.line} imports {imp.name}")
    return found


def test_each_part_imports_only_the_parts_below_it() -> None:
    assert upward_imports(SOURCE) == []


def test_nothing_below_the_entry_points_imports_them() -> None:
    assert ENTRY_POINTS <= set(modules(SOURCE)), "an entry point was renamed: update ENTRY_POINTS"
    assert entry_point_imports(SOURCE, ENTRY_POINTS) == []


def test_the_results_side_imports_nothing_of_megatron_or_torch_nn() -> None:
    assert model_stack_imports(SOURCE) == []


# --- the checks find what they look for (a made-up tree) ------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "autotuner" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.fixture
def bad_tree(tmp_path: Path) -> Path:
    return _tree(
        tmp_path,
        {
            "__init__.py": "",
            "main.py": "import autotuner.lib\n",
            "lib.py": "def load():\n    from autotuner import main\n",
            "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autotuner.main\n",
            "model.py": "import megatron.core\n",
            "lazy.py": "def build():\n    from torch import nn\n",
            "results/__init__.py": "from . import rows\n",
            "results/rows.py": "from autotuner import model\n",
            "report/__init__.py": "from autotuner.lazy import build\n",
        },
    )


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    tree = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "model/build.py": "from autotuner.ops.instrument import wrap\nfrom autotuner.errors import E\n",
            "ops/instrument.py": "from autotuner.model import build\n",
            "results/__init__.py": "import autotuner.runner\nfrom autotuner.ops_test.places import t\n",
            "runner/__init__.py": "from autotuner.results import load_rows\n",
        },
    )
    assert upward_imports(tree) == [
        "autotuner.model.build:1 imports autotuner.ops.instrument",
        "autotuner.model.build:1 imports autotuner.ops.instrument.wrap",
        "autotuner.results:1 imports autotuner.runner",
    ]


def test_the_checks_find_what_they_look_for(bad_tree: Path) -> None:
    assert entry_point_imports(bad_tree, {"autotuner.main"}) == ["autotuner.lib:2 imports autotuner.main"]
    found = model_stack_imports(bad_tree)
    assert "autotuner.results.rows -> autotuner.model -> megatron.core (line 1)" in found
    # a lazy import of a module the report imports does not run on import: not followed
    assert not any("torch.nn" in chain for chain in found), found


def _all_imports(tree: Path) -> Iterator[Import]:
    for path in modules(tree).values():
        yield from imports_of(path, tree)


def test_relative_imports_resolve_against_their_package(bad_tree: Path) -> None:
    names = {imp.name for imp in _all_imports(bad_tree)}
    assert "autotuner.results.rows" in names and "autotuner.main" not in {
        imp.name for imp in imports_of(bad_tree / "autotuner" / "typed.py", bad_tree)
    }
