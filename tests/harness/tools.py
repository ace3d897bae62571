"""Import a command-line tool (tools/NAME.py, not a package) as a module, to call its main()
in-process from tests."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

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
