"""The developer tools under perf/ (scripts, not a package), loaded as modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_PERF = Path(__file__).resolve().parents[1] / "perf"


def load(name: str) -> ModuleType:
    """perf/<name>.py as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, _PERF / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
