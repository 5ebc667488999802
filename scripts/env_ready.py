"""Whether this checkout is installed with the given extras: exit 0 if so, else 1 naming
the first thing missing (scripts/demo.sh then runs scripts/setup.sh, which installs it).

    python scripts/env_ready.py megatron,wandb

Ready means: `megatron_mesh` imports from this checkout (the editable install), and every
requirement setup.py lists (install_requires and the extras' requirements) is installed at
a version it allows. Reads installed versions only: it imports no heavy package.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements(extras: list[str]) -> list[str]:
    """setup.py's install_requires and the requirements of `extras`, as written there."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("install_requires", "extras_require"):
            found[node.arg] = ast.literal_eval(node.value)
    out = list(found.get("install_requires", []))
    table = found.get("extras_require", {})
    for extra in extras:
        if extra not in table:
            raise SystemExit(f"unknown extra {extra!r}; setup.py has {', '.join(sorted(table))}")
        out += table[extra]
    return out


def missing(extras: list[str]) -> str | None:
    """What is not installed as setup.py asks (None: nothing)."""
    try:
        from packaging.requirements import Requirement

        import megatron_mesh
    except ImportError as e:
        return str(e)
    here = os.path.realpath(os.path.dirname(megatron_mesh.__file__))
    if here != os.path.join(os.path.realpath(ROOT), "megatron_mesh"):
        return f"megatron_mesh imports from {here}, not from this checkout"
    for text in requirements(extras):
        req = Requirement(text)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(version, prereleases=True):
            return f"{req.name} {version} is installed; setup.py asks for {text}"
    return None


def main() -> int:
    extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
    reason = missing(extras)
    if reason is not None:
        print(f"setting up: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
