"""The shape of the code, checked: no import circle anywhere in the project (every import
counts, including those inside functions and under TYPE_CHECKING), config imports nothing from
the engine it configures, and every package's modules and functions stay small enough to read
(STYLE.md: modules under about 400 lines, functions under about 50)."""
from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("appliance", "web", "hostcheck", "kernels")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}     # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def import_graph() -> dict[str, set[str]]:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_no_module_import_circle():
    edges = import_graph()
    assert "appliance.engine.sched.scheduler" in edges  # the graph is the project's
    assert find_cycle(edges) is None


def test_no_package_import_circle_in_the_engine():
    """The engine's subpackages (sched, cache, spec, output, runners) import each other one way."""
    def pkg(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:3]) if m.startswith("appliance.engine.") and len(parts) > 3 else m

    packages: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        packages.setdefault(pkg(m), set()).update(pkg(d) for d in deps if pkg(d) != pkg(m))
    assert find_cycle(packages) is None


def test_config_imports_nothing_from_the_engine():
    """config.py is read by everything (the CLI, web, bench, the engine itself); what it needs of
    the engine's concerns (the chat templates' names and loading) lives outside appliance/engine/."""
    edges = import_graph()
    assert "appliance.config" in edges
    engine = sorted(m for m in edges["appliance.config"]
                    if m == "appliance.engine" or m.startswith("appliance.engine."))
    assert not engine, f"appliance.config imports {', '.join(engine)}"


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_are_short(path: Path):
    tree = ast.parse(path.read_text())
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: {', '.join(long)}"
