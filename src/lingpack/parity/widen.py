"""The reference's outside code in float64: a copy of an installed module whose float32 upcasts are float64.

transformers' KimiLinear and DeepseekV3 modules and FLA's torch gate compute their numerically sensitive parts
(norm statistics, softmax, the KDA gate and recurrence, the router) in float32 whatever the input dtype:
`x.to(torch.float32)`, `x.float()`, `softmax(..., dtype=torch.float32)`. Those are precision choices
(float32 because bf16 is not enough); for a float64 reference they must follow the wider dtype, or every
norm would round to float32 and parity could not go below ~1e-7.

`module(name)` (or `module_at(path, name)` for a file) loads the installed module's own source and changes
exactly two kinds of node before running it as a separate module (the original stays untouched and imported
as usual):

    torch.float32, torch.float   ->  torch.float64
    <expr>.float()               ->  <expr>.double()

Nothing else changes: the code, its formulas, eps values and order of operations are the installed ones.
`changed(name)` lists each rewrite (line, before -> after) for review.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import types
from pathlib import Path

FLOAT32_NAMES = ("float32", "float")  # torch.float is torch.float32


class _Float32ToFloat64(ast.NodeTransformer):
    """Rewrites `torch.float32` / `torch.float` and `.float()` calls, recording (line, before, after)."""

    def __init__(self):
        self.changes: list[tuple[int, str, str]] = []

    def visit_Attribute(self, node: ast.Attribute):
        self.generic_visit(node)
        if node.attr in FLOAT32_NAMES and isinstance(node.value, ast.Name) and node.value.id == "torch":
            self.changes.append((node.lineno, f"torch.{node.attr}", "torch.float64"))
            return ast.copy_location(ast.Attribute(value=node.value, attr="float64", ctx=node.ctx), node)
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "float" and not node.args and not node.keywords:
            self.changes.append((node.lineno, ".float()", ".double()"))
            node.func = ast.copy_location(ast.Attribute(value=func.value, attr="double", ctx=func.ctx), func)
        return node


def widen_tree(tree: ast.AST) -> tuple[ast.AST, list[tuple[int, str, str]]]:
    """(`tree` with its float32 upcasts made float64, the rewrites made)."""
    transformer = _Float32ToFloat64()
    tree = ast.fix_missing_locations(transformer.visit(tree))
    return tree, transformer.changes


def _source(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ImportError(f"{name} is not an installed Python source module (the float64 reference reads its source)")
    return Path(spec.origin)


@functools.lru_cache(maxsize=None)
def module(name: str) -> types.ModuleType:
    """The installed module `name` run again from its source with every float32 upcast float64 (cached).

    It is registered as `<name>_float64` beside the original, in the same package, so its relative imports
    resolve to the original package's (unchanged) modules."""
    return module_at(_source(name), f"{name}_float64", name.rpartition(".")[0])


@functools.lru_cache(maxsize=None)
def module_at(path: Path, name: str, package: str = "") -> types.ModuleType:
    """The Python file `path` run as module `name` (in `package`) with every float32 upcast float64 (cached):
    for files whose package cannot be imported here (FLA's needs triton)."""
    path = Path(path)
    tree, changes = widen_tree(ast.parse(path.read_text(), str(path)))
    if not changes:
        raise ImportError(f"{path} has no float32 upcast to widen: is it still the module the reference expects?")
    widened = types.ModuleType(name)
    widened.__file__, widened.__package__ = str(path), package
    sys.modules[name] = widened   # dataclasses and pickling look classes up by their module
    exec(compile(tree, str(path), "exec"), widened.__dict__)
    return widened


def changed(path: Path | str) -> list[tuple[int, str, str]]:
    """The rewrites `module` / `module_at` make in a module (its name) or file (a Path): (line, before, after)."""
    path = path if isinstance(path, Path) else _source(path)
    return widen_tree(ast.parse(path.read_text(), str(path)))[1]
