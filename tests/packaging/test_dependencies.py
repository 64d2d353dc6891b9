"""Every third-party module the product imports comes from a declared runtime dependency (or one
of theirs): `pip install backfill` without the dev extras must run `backfill up`. The tests
install the dev extras, so a module missing from [project].dependencies would otherwise pass
every other test and fail only for a new user."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("api", "jobs", "scheduler", "storage", "migrations", "devfleet", "backfill")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions the declared requirements install, transitively, extras included."""
    seen: set[str] = set()
    todo = [(Requirement(r), set[str]()) for r in requirements]
    while todo:
        req, _ = todo.pop()
        name = _canonical(req.name)
        extras = set(req.extras)
        key = name + "[" + ",".join(sorted(extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        seen.add(name)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            sub = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((sub, set()))
    return {s for s in seen if "[" not in s}


def _imported_modules() -> dict[str, str]:
    """Top-level module -> a file importing it, over every product module."""
    found: dict[str, str] = {}
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_comes_from_a_runtime_dependency() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = _closure(declared)
    providers = md.packages_distributions()
    missing = []
    for module, where in sorted(_imported_modules().items()):
        if module in sys.stdlib_module_names or module in PRODUCT or module == "__future__":
            continue
        dists = {_canonical(d) for d in providers.get(module, [])}
        if not dists & installed:
            missing.append(f"{module} (imported by {where}; from {sorted(dists) or 'no installed distribution'})")
    assert not missing, "imported but not a runtime dependency: " + "; ".join(missing)
