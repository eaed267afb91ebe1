"""FLA's pure-torch KDA oracles, loaded without FLA's package import (which needs triton)."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


def _fla_file(*parts: str) -> Path:
    spec = importlib.util.find_spec("fla")
    if spec is None:
        raise ImportError("FLA (PyPI fla-core) is not installed; it provides the KDA oracles: pip install fla-core")
    return Path(spec.submodule_search_locations[0]).joinpath(*parts)


def fla_naive_kda(float64: bool = False):
    """FLA's `fla/ops/kda/naive.py` as a module of its own (`naive_recurrent_kda`, `naive_chunk_kda`): a file that
    imports only torch, loaded by path so that FLA's package `__init__` (which imports triton) never runs.
    `float64`: its float32 upcasts made float64 (`parity/widen.py`)."""
    path = _fla_file("ops", "kda", "naive.py")
    if float64:
        from lingpack.parity.widen import module_at
        return module_at(path, "fla_kda_naive_float64")
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def fla_gate_functions(float64: bool = False) -> dict:
    """FLA's torch reference gates `naive_kda_gate`, `naive_kda_lowerbound_gate` (fla/ops/kda/gate.py).

    That file imports triton at the top, so only these two functions' source is taken (by `ast`) and run
    with torch and torch.nn.functional, the only names they use. `float64`: their float32 upcasts (`.float()`,
    the default `output_dtype=torch.float32`) made float64 (`parity/widen.py`)."""
    import torch
    path = _fla_file("ops", "kda", "gate.py")
    tree = ast.parse(path.read_text())
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    if {f.name for f in functions} != wanted:
        raise ImportError(f"{path} no longer defines {sorted(wanted)}")
    module = ast.Module(body=functions, type_ignores=[])
    if float64:
        from lingpack.parity.widen import widen_tree
        module, changes = widen_tree(module)
        if not changes:
            raise ImportError(f"{path}: the gates no longer upcast to float32; the float64 reference needs a review")
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(compile(module, str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}
