"""The import graph of `app/`: no circle, no import that runs up the layers, and the library never
imports the command line (arguments.py, pretrain_gpt2.py) or the tests (tests/harness/). Imports
inside functions count too.

The layers, lowest first (docs/architecture.md draws the same picture). A module may import its
own layer or any layer below it; a new module must be placed in a layer here.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

LAYERS = [
    ["app.utils"],
    ["app.config"],
    ["app.mpu"],
    ["app.data", "app.optim", "app.kernels", "app.launch"],
    ["app.model", "app.pipeline"],
    ["app.checkpoint"],
    ["app.training.telemetry", "app.training.loss", "app.training.data_loading",
     "app.training.state"],
    ["app.training.checkpointing"],
    ["app.training.resilience"],
    ["app.training.planning", "app.training.engines"],
    ["app.training.trainer"],
    ["app.training.run", "app.inference"],
    ["app.training.pretrain"],
]

OUTSIDE_THE_LIBRARY = ("arguments", "pretrain_gpt2", "pretrain_gpt", "tests")
"""Top-level names that app/ must never import: the command line and the tests' harness."""


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, found = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None and module in ("app", "app.training"):
        return len(LAYERS)  # package markers: allowed to import nothing
    assert found is not None, f"{module} is in no layer of {__file__}; add it to LAYERS"
    return found


def imports_of(path: pathlib.Path, module: str) -> set:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a.b import c` depends on a.b.c when that is a module, else on a.b
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph():
    modules = {module_name(p): p for p in (ROOT / "app").rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path, name):
            if imported.split(".")[0] in OUTSIDE_THE_LIBRARY:
                targets.add(imported)
            # the longest known module that the import names (a.b.c may be a name in a.b)
            candidates = [m for m in modules if imported == m or imported.startswith(m + ".")]
            if candidates:
                target = max(candidates, key=len)
                if target != name:
                    targets.add(target)
        edges[name] = targets
    return edges


def test_library_never_imports_the_command_line_or_the_tests():
    """The product runs without arguments/, pretrain_gpt2.py and tests/ (the test harness)."""
    bad = {m: sorted(t for t in ts if t.split(".")[0] in OUTSIDE_THE_LIBRARY)
           for m, ts in graph().items()}
    assert not {m: t for m, t in bad.items() if t}


def test_conversion_and_inference_do_not_import_training():
    """The checkpoint format lives in app.checkpoint and process start-up in app.launch, so
    converting, generating and serving never pull in the training loop or its engines."""
    leaks = sorted(f"{m} imports {t}" for m, ts in graph().items() for t in ts
                   if m.split(".")[:2] in (["app", "checkpoint"], ["app", "inference"],
                                           ["app", "launch"])
                   and t.startswith("app.training"))
    assert not leaks, "\n".join(leaks)


def test_no_import_runs_up_the_layers():
    upward = []
    for module, targets in graph().items():
        for target in targets:
            if target.split(".")[0] != "app":
                continue
            if target in ("app", "app.training"):
                continue
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} "
                              f"(layer {layer_of(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circle():
    full = graph()
    edges = {m: {t for t in ts if t in full} for m, ts in full.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_app_name_that_tools_and_benchmarks_import_exists():
    """tools/, bench/, examples/ and the top-level scripts import from app/ (bench/ also from
    tests/harness/; also inside functions, which only run in a benchmark or a CLI); each imported
    name must still exist, so moving a function cannot silently break a script no test runs."""
    import importlib
    missing = []
    files = [p for d in ("tools", "bench", "examples") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "arguments.py", ROOT / "pretrain_gpt2.py", ROOT / "pretrain_gpt.py"]
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and (node.module.split(".")[0] == "app"
                         or node.module.startswith("tests.harness")) and not node.level):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                       f"{node.module}.{alias.name}")
    assert not missing, "imported names that do not exist:\n" + "\n".join(missing)


def test_tests_share_code_only_through_the_harness():
    """A test module imports the code under test and tests/harness, never another test module
    or a conftest (fixtures reach tests through pytest, helpers through tests/harness), and the
    harness imports no test module either: so moving or deleting a test breaks no other."""
    shared = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "data" in path.relative_to(ROOT).parts[1:2]:
            continue  # recorders of fixtures (tests/data/*/record.py) run by hand
        for name in imports_of(path, module_name(path)):
            parts = name.split(".")
            if parts[0] == "conftest" or (parts[0] == "tests" and len(parts) > 1
                                          and parts[1] in ("unit", "integration", "distributed",
                                                           "conftest")):
                shared.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not shared, "\n".join(shared)
