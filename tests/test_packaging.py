"""The package layout: every component folder is installed under the asyncrl name."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _declared():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["package-dir"], set(setuptools["packages"])


def test_every_package_folder_is_declared() -> None:
    package_dir, packages = _declared()
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]))
    assert found == packages, f"undeclared: {sorted(found - packages)}, missing: {sorted(packages - found)}"


def test_no_bare_top_level_component_imports() -> None:
    # `import sched` would load the standard library module, not ours.
    bare = ("sched", "rollout", "learner", "gateway", "envs", "distill", "configs")
    offenders = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue  # virtual environments (.venv, .venv-vllm) and other tools' hidden folders
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if any(stripped.startswith((f"import {b}", f"from {b}.", f"from {b} ")) for b in bare):
                offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert not offenders, offenders
