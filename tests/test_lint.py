"""The formatters and Snakemake's linter stay clean (part of the README's test command)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT

BIN = Path(sys.executable).parent
SNAKEMAKE_FILES = ["Snakefile", *sorted(str(p) for p in (REPO_ROOT / "rules").glob("*.smk"))]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True)


def test_ruff_check_is_clean():
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_snakefmt_is_clean():
    result = _run(str(BIN / "snakefmt"), "--check", *SNAKEMAKE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_snakemake_lint_is_clean():
    result = _run(str(BIN / "snakemake"), "--lint", "--workflow-profile", "none")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lints for" not in result.stdout + result.stderr, result.stdout + result.stderr
