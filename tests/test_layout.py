"""The package is laid out by pipeline stage: one subpackage per stage on a small shared core,
and a stage imports only the core and earlier stages (lazy imports inside functions included);
no modules import each other in a circle, run-time imports inside functions counted too."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "eaglepipe"
# Earliest first: a module may import its own stage and any stage before it.
STAGES = (
    "core",
    "data",
    "plan",
    "server",
    "regenerate",
    "prepare",
    "extract",
    "validate",
    "drafter",
    "prompt_bench",
    "ops",
)


def imported_stages(path: Path, root: Path = REPO_ROOT) -> list[tuple[int, str]]:
    """(line, stage) for every eaglepipe import in the module, resolved from relative form."""
    package = list(path.relative_to(root).with_suffix("").parts)[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = base + (node.module.split(".") if node.module else [])
            else:
                module = (node.module or "").split(".")
            if module[0] != "eaglepipe":
                continue
            if len(module) > 1:
                found.append((node.lineno, module[1]))
            else:  # from eaglepipe import X (a stage, or a name such as __version__)
                found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "eaglepipe" and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
    return [(line, stage) for line, stage in found if stage in STAGES]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in its body (inside functions too,
    and `importlib.import_module("...")` with a literal name); `from P import m` counts as
    importing module P.m where that is a module, else P."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found & modules - {module_name(path, root)}


def import_circles(root: Path = REPO_ROOT) -> list[list[str]]:
    """The strongly connected components of more than one module in eaglepipe's import graph."""
    paths = {module_name(path, root): path for path in (root / "eaglepipe").rglob("*.py")}
    graph = {name: imported_modules(path, root, set(paths)) for name, path in paths.items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for target in graph[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        return seen

    reach = {name: reachable(name) for name in graph}
    circles = {
        tuple(sorted({name} | {other for other in reach[name] if name in reach[other]}))
        for name in graph
        if name in reach[name]
    }
    return sorted(list(circle) for circle in circles)


def test_every_module_lives_in_a_stage_package():
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert flat == []
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(STAGES)


def test_no_stage_imports_a_later_stage():
    backwards = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue
        stage = parts[0]
        for line, target in imported_stages(path):
            if STAGES.index(target) > STAGES.index(stage):
                backwards.append(f"{path.relative_to(REPO_ROOT)}:{line} ({stage} -> {target})")
    assert backwards == []


def test_the_rule_catches_a_backward_import(tmp_path):
    """The checker itself: a lazy import of a later stage from the core is reported."""
    module = tmp_path / "eaglepipe" / "core" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..extract.client import ExtractionClient\n")
    assert imported_stages(module, root=tmp_path) == [(2, "extract")]


def test_no_modules_import_each_other_in_a_circle():
    assert import_circles() == []


def test_the_circle_check_sees_imports_inside_functions(tmp_path):
    """The checker itself: two modules that import each other only at run time, through a
    relative `from . import` and `importlib.import_module`, are one circle; a third that only
    imports them is not in it."""
    package = tmp_path / "eaglepipe" / "stage"
    package.mkdir(parents=True)
    (tmp_path / "eaglepipe" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text(
        "import importlib\n\ndef g():\n    importlib.import_module('eaglepipe.stage.a')\n"
    )
    (package / "c.py").write_text("from .a import f\nfrom .b import g\n")
    assert import_circles(tmp_path) == [["eaglepipe.stage.a", "eaglepipe.stage.b"]]


def private_imports(root: Path = REPO_ROOT) -> list[str]:
    """`module:line name` for every private name (`_x`, not `__x__`) a module of eaglepipe takes
    from another eaglepipe module."""
    found = []
    for path in sorted((root / "eaglepipe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not node.level and not (node.module or "").startswith("eaglepipe"):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.endswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {alias.name}")
    return found


def test_no_module_takes_another_modules_private_names():
    assert private_imports() == []


def test_the_private_name_check_sees_relative_imports(tmp_path):
    module = tmp_path / "eaglepipe" / "plan" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("from .. import __version__\nfrom .provenance import _memo, shards\n")
    assert private_imports(tmp_path) == ["eaglepipe/plan/probe.py:2 _memo"]
