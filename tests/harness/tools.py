"""Import a command-line tool (tools/NAME.py, not a package) as a module, to call its main()
in-process from tests."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name: str) -> ModuleType:
    """The module of tools/{name}.py (executed once per call)."""
    path = os.path.join(ROOT, "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no tool {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(name: str, argv: List[str]) -> None:
    """tools/{name}.py's main(argv) in this process, for tests whose point is what the tool
    writes, not its command line; an AssertionError names the arguments unless it returns 0."""
    code = load_tool(name).main([str(a) for a in argv])
    assert code == 0, f"tools/{name}.py {' '.join(map(str, argv))} returned {code}"
