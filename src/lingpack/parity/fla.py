"""FLA's pure-torch KDA gate functions, loaded without FLA's package import (which needs triton)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def fla_gate_functions() -> dict:
    """FLA's torch reference gates `naive_kda_gate`, `naive_kda_lowerbound_gate` (fla/ops/kda/gate.py).

    That file imports triton at the top, so only these two functions' source is taken (by `ast`) and run
    with torch and torch.nn.functional, the only names they use."""
    import torch
    spec = importlib.util.find_spec("fla")
    if spec is None:
        raise ImportError("FLA (PyPI fla-core) is not installed; it provides the KDA gate oracle: pip install fla-core")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "gate.py"
    tree = ast.parse(path.read_text())
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    if {f.name for f in functions} != wanted:
        raise ImportError(f"{path} no longer defines {sorted(wanted)}")
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}
