"""Layering: the harness, the monitor and the shared modules import without torch (they run from a light
install), and no module of specwise imports itself back through others (no cycle, hidden imports included)."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import specwise

SRC = Path(specwise.__file__).parent
TORCH_FREE_PACKAGES = ("specwise.harness", "specwise.monitor", "specwise.cli")
TORCH_FREE_MODULES = [
    "specwise",
    "specwise.errors",
    "specwise.paths",
    "specwise.specs",
    "specwise.speccounts",
    "specwise.policy",
    "specwise.identity",
    "specwise.models",
    "specwise.cli",
    "specwise.server",
    "specwise.server.protocol",
    "specwise.server.command",
    "specwise.server.policy_client",
]


def all_modules() -> list[str]:
    return ["specwise"] + [m.name for m in pkgutil.walk_packages([str(SRC)], "specwise.")]


def torch_free_modules() -> list[str]:
    return TORCH_FREE_MODULES + [
        m
        for m in all_modules()
        if (m.startswith(tuple(p + "." for p in TORCH_FREE_PACKAGES)) or m in TORCH_FREE_PACKAGES)
        and not m.endswith(".__main__")  # runs the command line when imported
    ]


def test_the_walk_finds_the_modules_it_must_check():
    mods = torch_free_modules()
    assert {"specwise.harness.report", "specwise.monitor.drift", "specwise.harness.runner"} <= set(mods)


def test_harness_and_monitor_do_not_import_torch():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in torch_free_modules())
        + "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _path(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    return SRC / rel / "__init__.py" if (SRC / rel).is_dir() else SRC / rel.with_suffix(".py")


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module → the specwise modules it imports anywhere in its text (function bodies too; TYPE_CHECKING blocks only
    with `type_only`)."""
    known = set(all_modules())
    graph: dict[str, set[str]] = {}
    for mod in known:
        tree = ast.parse(_path(mod).read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        out: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
                ]
            else:
                continue
            if not type_only and _type_checking_only(node, parents):
                continue
            out |= {n for n in names if n in known and n != mod}
        graph[mod] = out
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_even_through_type_only_imports():
    """A type-only cycle (generate.py importing ServerState back from app.py, once) is a layering smell too."""
    cycle = find_cycle(import_graph(type_only=True))
    assert cycle is None, "import cycle (type-only imports included): " + " → ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_specwise_modules():
    graph = import_graph()
    assert graph["specwise.harness.evaluate"] >= {"specwise.harness.analyze"}  # the graph sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle)


SHARED = {
    "specwise",
    "specwise.errors",
    "specwise.specs",
    "specwise.speccounts",
    "specwise.paths",
    "specwise.policy",
    "specwise.identity",
    "specwise.models",
}
# What each layer may import besides itself and the shared modules (docs/ARCHITECTURE.md): a layer, or one module.
ALLOWED = {
    "shared": set(),
    "engine": set(),
    "harness": {"engine"},  # only the in-process backend, lazily: the import test above keeps torch out
    "monitor": {  # run files, the KS test, the machine's background
        "specwise.harness.results",
        "specwise.harness.provenance",
        "specwise.harness.statistics",
        "specwise.harness.background",
    },
    "server": {"engine", "monitor", "specwise.harness.analyze"},  # --policy-from RUN.db
    "cli": {"engine", "harness", "monitor", "server"},
}


def layer(module: str) -> str:
    if module in SHARED:
        return "shared"
    if module in ("specwise.cli", "specwise.__main__") or module.startswith("specwise.cli."):
        return "cli"
    return module.split(".")[1]


def allowed(module: str, other: str) -> bool:
    rules = ALLOWED[layer(module)]
    return layer(other) in {layer(module), "shared"} or layer(other) in rules or other in rules


def test_packages_import_only_what_their_layer_allows():
    bad = sorted(f"{m} → {o}" for m, outs in import_graph().items() for o in outs if not allowed(m, o))
    assert not bad, bad
    assert {o for o in import_graph()["specwise.harness.engine_backend"] if layer(o) == "engine"}  # the rule sees edges
    assert not allowed("specwise.server.app", "specwise.harness.report")  # one module allowed, not its package
    assert not allowed("specwise.policy", "specwise.engine.scheduler")


def test_the_harness_imports_the_engine_only_inside_functions():
    """Lazily, where the in-process backend is built: importing the harness must not need torch."""
    for mod in torch_free_modules():
        tree = ast.parse(_path(mod).read_text())
        for node in tree.body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.startswith(("specwise.engine", "torch"))], (mod, names)
