"""The package is laid out by pipeline stage: one subpackage per stage on a small shared core,
and a stage imports only the core and earlier stages (lazy imports inside functions included)."""

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
