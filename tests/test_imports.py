"""The import graph of common/ and sharding/: a DAG, in layers.

Every `import` and `from ... import` of a project module counts, those inside functions too (an import inside a
function that only dodges a circle still ties the two modules together). The layers, each importing only from those
before it: common/run (the run itself: errors, ranks, logging, checkpoints, the planner) <- common/train (the model and
its passes) <- common/data (prompts, pairs) <- common/rollout (generation, rewards, environments). sharding/ (the
weight layouts of FSDP, PEFT and vLLM) imports nothing of common/.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "sharding")
LAYERS = ["common.run", "common.train", "common.data", "common.rollout"]

def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in it: `from common.run import errors` is common.run.errors (a
    module), `from common.run.errors import user_error` is common.run.errors too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..run import errors
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # import common.run.errors.x -> its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through the first module (by name) of each group of modules that reach each other (a strongly
    connected component of more than one, Tarjan's algorithm), as a path that ends where it starts."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start: None}  # breadth-first from start back to start, within the component
        frontier = [start]
        while frontier:
            nxt = []
            for node in frontier:
                for other in sorted(graph[node] & component):
                    if other == start:
                        chain = [node]
                        while seen[chain[-1]] is not None:
                            chain.append(seen[chain[-1]])
                        path = list(reversed(chain)) + [start]
                        nxt = frontier = []
                        break
                    if other not in seen:
                        seen[other] = node
                        nxt.append(other)
                if len(path) > 1:
                    break
            frontier = nxt
        cycles.append(path)
    return cycles


def layer(module: str) -> int | None:
    return next((i for i, prefix in enumerate(LAYERS) if module.startswith(prefix + ".")), None)


def test_finds_a_cycle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_package_imports_resolve_to_modules(tmp_path):
    modules = {"common.run": None, "common.run.errors": None, "common.run.logger": None, "common.train.model": None}
    source = tmp_path / "logger.py"
    source.write_text("from common.run import errors\nfrom . import errors as e\ndef f():\n"
                      "    from ..train.model import x\n    import common.run\n")
    assert imported_modules(source, "common.run.logger", modules) == {"common.run.errors", "common.train.model",
                                                                       "common.run"}


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers():
    """run <- train <- data <- rollout: a module imports from its own layer and those before it only."""
    wrong = []
    for module, imports in sorted(import_graph().items()):
        for other in sorted(imports):
            if module.startswith("sharding") and other.startswith("common"):
                wrong.append(f"{module} -> {other} (sharding/ imports nothing of common/)")
            elif layer(module) is not None and layer(other) is not None and layer(other) > layer(module):
                wrong.append(f"{module} -> {other} ({LAYERS[layer(module)]} may not import {LAYERS[layer(other)]})")
    assert not wrong, "imports against the layers " + " <- ".join(LAYERS) + ":\n" + "\n".join(wrong)

