"""The package's import structure (library, connectors and harness): layers import downwards
only and no module imports itself back through others, counting imports inside functions (not ``if TYPE_CHECKING:`` blocks,
which never run).

Layers, lowest first (a module may import its own layer or lower ones):

0. base: torch-free helpers every layer uses (checks, polling, undo, lifetime, bounded JSON,
   socket framing, child processes) and the ``kvconnect`` package root (``__version__``, lazy
   exports);
1. vmm: the VMM drivers;
2. tensor: ExtensibleTensor, pointer views, mapped memory, POSIX-fd handle exchange (``ipc``);
3. layout: configs, plans, page formats, presets;
4. views: the committed-extent helpers, the page-sharing rule and the peer layout built on
   them;
5. kv_cache: ExtensibleKVCache (built on views) and sizing;
6. connectors and the vLLM integration (``kvconnect.vllm``);
7. harness: its shared root modules (config, control, report, ...);
8. harness.worker: a worker process;
9. harness.run: the two ways to run workers, ``harness.coordinator`` (local) and
   ``harness.multihost``, which never import each other, and the root modules only they use
   (display, rundir);
10. harness.command: ``kvconnect-validate`` itself (cli, arguments, resources, std_streams).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvconnect
import kvconnect.connectors
import kvconnect.harness

KVCONNECT = Path(kvconnect.__file__).parent
CONNECTORS = Path(kvconnect.connectors.__file__).parent
HARNESS = Path(kvconnect.harness.__file__).parent
LAYERS = ("base", "vmm", "tensor", "layout", "views", "kv_cache", "connectors", "harness",
          "harness.worker", "harness.run", "harness.command")
#: module (or package prefix) -> layer; the longest matching prefix wins
LAYER_OF = {
    "kvconnect": "base", "kvconnect.checks": "base", "kvconnect.polling": "base",
    "kvconnect.undo": "base", "kvconnect.lifetime": "base", "kvconnect.bounded_json": "base",
    "kvconnect.framing": "base", "kvconnect.child": "base", "kvconnect.errors": "base",
    "kvconnect.units": "base",
    "kvconnect.vmm": "vmm",
    "kvconnect._pointer_view": "tensor", "kvconnect.tensor": "tensor", "kvconnect.ipc": "tensor",
    "kvconnect.mapped_memory": "tensor",
    "kvconnect.layout": "layout",
    "kvconnect.views": "views", "kvconnect.peer_layout": "views",
    "kvconnect.cache_source": "views",
    "kvconnect.kv_cache": "kv_cache", "kvconnect.sizing": "kv_cache",
    "kvconnect.connectors": "connectors", "kvconnect.vllm": "connectors",
    "kvconnect.harness": "harness", "kvconnect.harness.worker": "harness.worker",
    "kvconnect.harness.coordinator": "harness.run", "kvconnect.harness.multihost": "harness.run",
    "kvconnect.harness.display": "harness.run", "kvconnect.harness.rundir": "harness.run",
    **{f"kvconnect.harness.{m}": "harness.command"
       for m in ("cli", "arguments", "resources", "std_streams", "conformance")},
}
#: the sub-packages of the layer ``harness.run``: neither imports the other
RUN_PACKAGES = ("kvconnect.harness.coordinator", "kvconnect.harness.multihost")


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in (("kvconnect", KVCONNECT), ("kvconnect.connectors", CONNECTORS),
                          ("kvconnect.harness", HARNESS)):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _layer(module: str) -> str:
    prefix = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[prefix]


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) \
                    and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """kvconnect modules ``module`` imports (module level or in functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("kvconnect"):
                continue
            for alias in node.names:  # "from pkg import submodule" imports the submodule
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvconnect"))
    out.discard(module)
    return out


MODULES = _modules()
GRAPH = {m: _imports(m, p, MODULES) for m, p in MODULES.items()}


def test_the_parser_sees_the_imports() -> None:
    assert "kvconnect.views" in GRAPH["kvconnect.kv_cache"]
    assert "kvconnect.connectors.nixl.registration" in GRAPH["kvconnect.connectors.nixl.worker"]
    assert "kvconnect.vmm.cuda" in GRAPH["kvconnect.vmm.hip"]
    assert "kvconnect.harness.control" in GRAPH["kvconnect.harness.worker.process"]
    assert "kvconnect.harness.worker.decode" in GRAPH["kvconnect.harness.coordinator.launch"]
    assert {_layer(m) for m in MODULES} == set(LAYERS)


def test_imports_point_down_the_layers() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{m} ({_layer(m)}) imports {d} ({_layer(d)})"
                    for m, deps in GRAPH.items() for d in deps
                    if rank[_layer(d)] > rank[_layer(m)])
    assert upward == []


def test_coordinator_and_multihost_never_import_each_other() -> None:
    def run_package(module: str) -> str | None:
        return next((p for p in RUN_PACKAGES if module == p or module.startswith(p + ".")), None)

    crossing = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                      if run_package(m) and run_package(d) and run_package(m) != run_package(d))
    assert crossing == []


def test_no_import_cycle() -> None:
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(m):], m]))
        if m in done:
            return
        for dep in sorted(GRAPH.get(m, ())):
            visit(dep, [*stack, m])
        done.add(m)

    for m in sorted(GRAPH):
        visit(m, [])


#: the folders, lowest first: kvconnect/ (core), connectors/ (installed as
#: kvconnect.connectors) and harness/ (kvconnect.harness)
FOLDERS = ("kvconnect", "kvconnect.connectors", "kvconnect.harness")
def _folder(module: str) -> int:
    return max(i for i, f in enumerate(FOLDERS) if module == f or module.startswith(f + "."))


def test_folders_import_downwards() -> None:
    """No module of kvconnect/ imports connectors/ or harness/, and no module of connectors/
    imports harness/ (relative and function-level imports included): the folders say the
    floor (vLLM's patched connectors and the fast path live in connectors/vllm/)."""
    upward = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                    if _folder(d) > _folder(m))
    assert upward == []
