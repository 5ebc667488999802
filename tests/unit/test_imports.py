"""The package's import graph: no cycle anywhere, and the layers import only what is below.

Every module of megatron_mesh/ is parsed (ast, nothing is imported): each `import` and
`from ... import` statement, at module level, inside a function or in an
`if TYPE_CHECKING:` block (it never runs, but a type named there is a dependency all the
same: a circle through annotations is a circle), is an edge to the project module it names
(`from pkg import name` goes to pkg.name when that is a module, else to pkg).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_mesh"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            up = here[:len(here) - node.level + 1]
            base = ".".join(up + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:  # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its body, `if TYPE_CHECKING:`
    blocks included)."""
    graph = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(node, module, path.name == "__init__.py", mods))
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_finder_sees_cycles_through_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import megatron_mesh.a.thing\n")
    graph = import_graph(module_files(pkg))
    assert find_cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(module_files(pkg))) is None


def test_finder_sees_cycles_through_type_checking_imports(tmp_path):
    """An import for annotations only never runs, but the module still depends on the other:
    a circle through `if TYPE_CHECKING:` is a circle."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("import dataclasses\n")
    (pkg / "parser.py").write_text("from .moe import add_args\n")
    for imports in ("from .parser import Config", "import megatron_mesh.parser"):
        (pkg / "moe.py").write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    f"    {imports}\n")
        assert find_cycle(import_graph(module_files(pkg))) == [
            f"{PACKAGE}.moe", f"{PACKAGE}.parser", f"{PACKAGE}.moe"]
    # the type in a leaf both import: no circle
    (pkg / "moe.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from .config import Config\n")
    assert find_cycle(import_graph(module_files(pkg))) is None


def test_no_import_cycle_in_the_package():
    """No circle, counting the imports of `if TYPE_CHECKING:` blocks."""
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module, allowed", [
    ("layer_plan", set()),  # the leaf: nothing of the project
    ("masks.zigzag", set()),  # the zigzag rule: a leaf too
    ("cost_models.tile_calls", {"layer_plan"}),  # the grouped kernel calls of a tile
    ("cost_models.memory", {"layer_plan", "cost_models.tile_calls"}),  # it counts the largest call
    ("cost_models.plan", {"layer_plan", "cost_models.memory"}),  # a plan sits above the memory model
    ("cost_models.traffic", {"layer_plan", "cost_models.plan"}),  # its defaults: mesh_attention's plan
    # the sparse exchange's model: the rows a mask's blocks use and the calls the tiles
    # group them into (the masks and calls are below it)
    ("cost_models.sparse", {"layer_plan", "cost_models.memory", "cost_models.traffic",
                            "cost_models.tile_calls", "calls.groups",
                            "calls.layout", "calls.needed_rows", "masks.placed_documents",
                            "masks.window", "masks.document_placement"}),
])
def test_layers_import_only_what_is_below(module, allowed):
    graph = import_graph(module_files())
    imported = {m.removeprefix(PACKAGE + ".") for m in graph[f"{PACKAGE}.{module}"]}
    assert imported <= allowed, f"{module} imports {sorted(imported - allowed)}"


# folder -> folders (and top-level modules) of the package it must never import: the layers
# in the order data flows (masks -> calls -> schedules -> attention -> inference; calls/
# lays a mask on the ranks as blocks and kernel calls, between the masks and the kernels,
# which take its calls), the models beside them (only the sparse exchange's model,
# cost_models/sparse.py, reads masks and calls: the rows a mask's blocks use; never the other
# way); masks, kernels and runtime side by side, sharing only the leaf common/;
# megatron-core's side above them: its adapter (megatron/), training/, then generation on
# megatron-core (inference/megatron/, a folder of its own inside
# inference/: `_folder` tells it apart)
SUBFOLDERS = {"inference.megatron"}
ABOVE = {"schedules", "checks", "attention", "inference", "inference.megatron", "planner",
         "emulation", "megatron", "training"}
NEVER = {
    "common": ABOVE | {"masks", "calls", "kernels", "runtime", "cost_models"},
    "masks": ABOVE | {"calls", "kernels", "runtime", "cost_models"},
    "calls": ABOVE | {"kernels", "runtime", "cost_models"},
    "kernels": ABOVE | {"masks", "runtime"},
    "cost_models": {"schedules", "runtime", "kernels", "attention", "inference",
               "inference.megatron", "megatron", "training"},
    "runtime": ABOVE | {"masks", "calls", "kernels"},
    "schedules": {"attention", "inference", "inference.megatron", "planner", "megatron",
                  "training"},
    "planner": {"inference", "inference.megatron", "megatron", "training"},
    "emulation": {"inference", "inference.megatron", "megatron", "training"},
    "inference": {"inference.megatron", "megatron", "training", "emulation"},
    "megatron": {"inference", "inference.megatron", "training", "emulation"},
    "training": {"inference", "inference.megatron", "emulation", "generate"},
    "inference.megatron": {"emulation", "cli", "pretrain_gpt", "generate"},
}


def _folder(module: str) -> str:
    """The folder (or top-level module) of the package a module sits in; a folder of
    SUBFOLDERS is one of its own."""
    parts = module.split(".")[1:]
    if ".".join(parts[:2]) in SUBFOLDERS:
        return ".".join(parts[:2])
    return parts[0] if parts else ""


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_folders_keep_their_layer(folder):
    """Every module of a folder imports none of the folders `NEVER` names for it."""
    graph = import_graph(module_files())
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if _folder(m) == folder
                 for t in targets if _folder(t) in NEVER[folder])
    assert not bad, bad


def test_only_the_sparse_model_reads_masks():
    """Of cost_models/, only the sparse exchange's model imports masks/ (its bytes are the rows a
    mask's blocks use); the other models price a plan from its shape alone."""
    graph = import_graph(module_files())
    readers = sorted(m for m, targets in graph.items() if _folder(m) == "cost_models"
                     and any(_folder(t) == "masks" for t in targets))
    assert readers == [f"{PACKAGE}.cost_models.sparse"], readers


def _imports_torch_distributed(path: Path) -> bool:
    """Whether the module at `path` itself names torch.distributed in an import."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              and n.module and not n.level}
    return any(n.startswith("torch.distributed") for n in names)


def _chain_to(graph: dict[str, set[str]], start: str, bad: set[str]) -> list[str] | None:
    """The import chain [start, ..., b] from `start` to a module of `bad`, or None."""
    came_from = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        if module in bad:
            chain = [module]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph[module]):
            if nxt not in came_from:
                came_from[nxt] = module
                queue.append(nxt)
    return None


@pytest.mark.parametrize("folder", ["planner", "cost_models", "masks"])
def test_models_planner_and_masks_import_no_torch_distributed(folder):
    """The planner and the models price plans, the masks describe blocks: none of them
    talks to other ranks, through any chain of project imports (a package's __init__ that
    an import runs on the way is not counted: the top package re-exports the runtime)."""
    mods = module_files()
    graph = import_graph(mods)
    bad = {m for m, path in mods.items() if _imports_torch_distributed(path)}
    for module in sorted(m for m in mods if _folder(m) == folder):
        chain = _chain_to(graph, module, bad)
        assert chain is None, " -> ".join(chain)


def test_torch_distributed_finder_follows_chains(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "planner").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "planner" / "__init__.py"):
        init.write_text("")
    (pkg / "grid.py").write_text("import torch.distributed as dist\n")
    (pkg / "leaf.py").write_text("def f():\n    from .grid import dist\n")
    (pkg / "planner" / "search.py").write_text("from ..leaf import f\n")
    mods = module_files(pkg)
    bad = {m for m, path in mods.items() if _imports_torch_distributed(path)}
    assert _chain_to(import_graph(mods), f"{PACKAGE}.planner.search", bad) == [
        f"{PACKAGE}.planner.search", f"{PACKAGE}.leaf", f"{PACKAGE}.grid"]
    (pkg / "leaf.py").write_text("import torch\n")
    assert _chain_to(import_graph(module_files(pkg)), f"{PACKAGE}.planner.search", bad) is None


TOP_LEVEL = {"attention", "checks", "layer_plan", "dtypes", "cli", "pretrain_gpt", "generate",
             "preprocess", "masks", "calls", "schedules", "cost_models", "runtime", "kernels",
             "inference", "planner", "emulation", "megatron", "training", "common"}


def test_every_algorithm_module_sits_in_a_layer_folder():
    """The top of the package holds only the entry points, the leaves and the folders."""
    top = {m.removeprefix(PACKAGE + ".") for m in module_files() if m.count(".") == 1}
    assert top <= TOP_LEVEL, sorted(top - TOP_LEVEL)


def test_the_document_placer_sits_beside_the_placement_it_makes():
    """masks/document_placement.py holds what a placement is (the value, its checks and
    work); the search that makes a balanced one, run per micro-batch, sits beside it
    (masks/document_placer.py), not in the planner."""
    tree = ast.parse((ROOT / "masks" / "document_placement.py").read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert classes == {"DocumentPlacement"}, sorted(classes)
    assert "place_documents" not in functions
    graph = import_graph(module_files())
    assert f"{PACKAGE}.masks.document_placement" in graph[f"{PACKAGE}.masks.document_placer"]
    assert not (ROOT / "planner" / "document_placer.py").exists()


def test_layer_plan_imports_no_third_party_module():
    tree = ast.parse((ROOT / "layer_plan.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    assert names <= {"__future__", "dataclasses", "enum", "math"}, names


MEGATRON_FOLDERS = {"megatron", "training", "inference.megatron", "pretrain_gpt"}


def test_algorithm_layer_never_imports_megatron():
    """megatron_mesh/ minus megatron/, training/ and inference/megatron/ (and the driver's
    entry) stays free of megatron-core; the generate entry reaches it through
    inference/megatron/ only."""
    for module, path in module_files().items():
        if _folder(module) in MEGATRON_FOLDERS:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad = [n for n in names if n and n.split(".")[0] == "megatron"]
            assert not bad, f"{module} imports {bad}"


def test_no_test_module_imports_another():
    """Tests share helpers through the modules beside conftest.py (preloaded.py, reference.py,
    ...), never by importing another test file (its tier folder may not be on the path)."""
    tests = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(tests)}: {n}" for n in names
                      if n.split(".")[0].startswith("test_")]
    assert not found, found
