"""The layout is the architecture: packages import only from layers below them, no module
imports itself back through others, and the pieces that must stay light stay light.

Imports are read with ``ast`` from the source (top-level and function-level ones alike,
``if TYPE_CHECKING:`` blocks aside), so a lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "rayflex"

# Lowest first. A module may import from its own package or from a package of a lower
# layer; ``rayflex`` itself (the public re-exports) counts as the api layer.
LAYERS: list[set[str]] = [
    {"errors", "constants"},
    {"mesh", "local_ray", "schemes", "field_rules"},
    {"config", "models", "storage"},
    {"planning", "data", "telemetry"},
    {"checkpoint"},  # the checkpoint path: checkpointer, uploads, DCP I/O, manifest, replicas in host memory
    {"worker"},
    {"group"},
    {"faults"},
    {"control"},
    {"api"},
    {"cli", "testing"},
    {"chaos"},  # `python -m rayflex.chaos`: the chaos runs' command
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(module: str) -> set[str]:
    """The rayflex modules ``module`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "rayflex")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "rayflex":
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(module)
    return {m for m in found if m in MODULES}


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "api"


def test_every_module_belongs_to_a_layer():
    unknown = sorted({part_of(m) for m in MODULES} - set(LAYER_OF))
    assert not unknown, f"add these packages to a layer in LAYERS: {unknown}"


def test_no_import_goes_up_a_layer():
    upward = []
    for module in sorted(MODULES):
        here = part_of(module)
        for target in sorted(imports_of(module)):
            there = part_of(target)
            if there != here and LAYER_OF[there] >= LAYER_OF[here]:
                upward.append(f"{module} -> {target} ({here} is layer {LAYER_OF[here]}, "
                              f"{there} layer {LAYER_OF[there]})")
    assert not upward, "imports from a higher (or the same) layer:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = {m: imports_of(m) for m in MODULES}
    # A package's __init__ that re-exports a submodule is not a circle with it.
    for m, targets in graph.items():
        graph[m] = {t for t in targets if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
    circles, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("module", ["rayflex.mesh.plan", "rayflex.mesh.rules", "rayflex.control.controller",
                                    "rayflex.planning.comm_profile", "rayflex.config"])
def test_control_plane_modules_do_not_import_torch(module):
    """The controller plans meshes and placements without torch (a 0-CPU actor that starts fast)."""
    if module not in MODULES:
        pytest.skip(f"{module} does not exist yet")
    seen, todo, heavy = set(), [module], []
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        tree = ast.parse(MODULES[m].read_text())
        for node in tree.body:  # module-level imports only: these run when the module loads
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
                heavy.append(m)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                heavy.append(m)
        todo.extend(t for t in imports_of(m) if t in MODULES and _module_level(m, t))
    assert not heavy, f"{module} imports torch at load time through {sorted(set(heavy))}"


def _module_level(module: str, target: str) -> bool:
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == target or target.startswith(node.module + ".")):
            return True
        if isinstance(node, ast.Import) and any(a.name == target for a in node.names):
            return True
    return False


def test_the_worker_actor_shell_forwards_every_public_method():
    """``TrainWorkerActor`` (torch-free) exposes exactly TrainWorker's public methods."""
    import inspect

    from rayflex.worker.actor import ACTOR_METHODS, TrainWorkerActor
    from rayflex.worker.train_worker import TrainWorker

    public = {n for n, f in inspect.getmembers(TrainWorker, inspect.isfunction) if not n.startswith("_")}
    assert set(ACTOR_METHODS) == public
    assert all(callable(getattr(TrainWorkerActor, n)) for n in ACTOR_METHODS)


def _torch_imports(module: str) -> set[str]:
    """Every torch module ``module`` imports, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found.add(node.module)
    return found


def test_the_checkpoint_package_owns_the_checkpoint_path():
    """``rayflex.storage`` is object-store I/O only (no torch); DCP is spoken inside
    ``rayflex.checkpoint`` alone (and by the chaos replay, which checks its files)."""
    storage_torch = {m: _torch_imports(m) for m in MODULES if part_of(m) == "storage" and _torch_imports(m)}
    assert not storage_torch, f"storage modules that import torch: {storage_torch}"
    dcp_outside = sorted(m for m in MODULES if part_of(m) not in ("checkpoint", "testing")
                         and any(t.startswith("torch.distributed.checkpoint") for t in _torch_imports(m)))
    assert not dcp_outside, f"DCP spoken outside rayflex.checkpoint: {dcp_outside}"


def test_no_state_handler_imports_another():
    """Each state's handler returns the next state; what two of them share (ending an
    attempt, acting on a decision, naming lost nodes) lives in a module of its own."""
    from rayflex.control.controller import HANDLERS

    handlers = {fn.__module__ for fn in HANDLERS.values()}
    crossing = sorted(f"{m} -> {t}" for m in handlers for t in imports_of(m) & handlers)
    assert len(handlers) == len(HANDLERS) and not crossing, crossing


# A class describes a mesh's degrees when it declares any of these as fields.
DEGREES = {"pp", "dp", "tp", "dp_shard", "dp_replicate"}
# The one mesh type, and the classes that may hold degrees without being a mesh: the user's
# request (ParallelConfig), a rank's coordinates in a mesh, and the event that records the
# chosen mesh flat for the readers of events.jsonl.
MAY_DECLARE_DEGREES = {"rayflex.mesh.plan.MeshPlan", "rayflex.config.ParallelConfig", "rayflex.mesh.plan.MeshCoords",
                       "rayflex.telemetry.events.PlanChosen"}


def test_one_mesh_type():
    """Config, planners, capacity model, controller and workers share ``MeshPlan``: no other
    class spells a mesh's pp/dp/tp degrees (the planners' shapes, capacity's candidate
    layouts, the rules' request and batch split once did)."""
    declaring = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                fields = {st.target.id for st in node.body
                          if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
                if fields & DEGREES:
                    declaring.add(f"{module}.{node.name}")
    assert declaring == MAY_DECLARE_DEGREES, sorted(declaring ^ MAY_DECLARE_DEGREES)
