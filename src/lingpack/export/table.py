"""Which checkpoint leaves make which transformers tensor: the table both the exporter and `model.init_from` use.

Built on an abstract model (`nnx.eval_shape`: no weight is allocated), from `parity/convert.py`'s mapping:
each transformers tensor names the state leaves it is made of (`("params", "layers", "0", "mlp", ...)`, the
checkpoint's own paths; a scanned stack is one leaf for all its layers, with the layer's stack index), a
function from those leaves to the tensor and its inverse. Ling3's own modeling file (`remote/`) puts the rope
rows of its RoPE MLA layers in DeepSeek-V3's feature order (`convert.deepseek_v3_rows`); the table applies
that permutation for `layout="ling3"` and undoes it on import.
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
from flax import nnx

from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.parity import convert

LeafKey = tuple  # ("params" | "rest", *path) as the checkpoint's state tree spells it (list indices as strings)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str                       # transformers parameter name
    leaves: tuple                   # (LeafKey, stack index) per source
    shapes: tuple                   # the source slices' shapes
    dtype: np.dtype                 # the sources' dtype
    to_hf: typing.Callable          # (*arrays) -> tensor
    from_hf: typing.Callable        # (tensor, shapes) -> arrays
    rows: np.ndarray | None = None  # output-row permutation (RoPE MLA in the ling3 layout)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes) * 4   # written as float32

    def make(self, arrays: list[np.ndarray]) -> np.ndarray:
        out = self.to_hf(*arrays)
        return np.ascontiguousarray(out if self.rows is None else out[self.rows])

    def split(self, tensor: np.ndarray) -> list[np.ndarray]:
        if self.rows is not None:
            tensor = tensor[np.argsort(self.rows)]
        return self.from_hf(tensor, list(self.shapes))


def abstract_model(cfg: Ling3Config) -> Ling3:
    return nnx.eval_shape(lambda: Ling3(cfg, rngs=nnx.Rngs(0)))


def _leaf_keys(model: Ling3) -> dict[int, LeafKey]:
    keys = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            collection = "params" if isinstance(node, nnx.Param) else "rest"
            keys[id(node)] = (collection, *map(str, path))
    return keys


def _rows(cfg: Ling3Config, name: str, layout: str) -> np.ndarray | None:
    """The DeepSeek-V3 row order of a RoPE MLA projection (None where rows stay as they are)."""
    if layout != "ling3" or cfg.mla.rope_type != "rope" or ".self_attn." not in name:
        return None
    q_rows, kv_a_rows = convert.deepseek_v3_rows(cfg.mla)
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        rows = q_rows
    elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        rows = kv_a_rows
    else:
        return None
    return None if np.array_equal(rows, np.arange(len(rows))) else rows


def entries(cfg: Ling3Config, *, mtp: bool, layout: str) -> list[Entry]:
    """Every transformers tensor of `cfg`'s model (`layout`: "kimi_linear" or "ling3"), grouped so that tensors
    made of the same leaves (one scanned stack: that parameter of every layer) are neighbours."""
    model = abstract_model(cfg)
    keys, mla_layers = _leaf_keys(model), {i for i, (m, _) in enumerate(cfg.layer_kinds()) if m == "mla"}
    out = []
    for name, located, to_hf, from_hf in convert.tensor_sources(model, mtp=mtp):
        leaves = tuple((keys[id(var)], tuple(index)) for var, index in located)
        shapes = tuple(tuple(var.shape[len(index):]) for var, index in located)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        is_mla = name.startswith("mtp.") or (layer is not None and int(layer) in mla_layers)
        rows = _rows(cfg, name, layout) if is_mla else None
        out.append(Entry(name, leaves, shapes, np.dtype(located[0][0].dtype), to_hf, from_hf, rows))
    order = {}
    for e in out:   # first appearance of each leaf set, so stacks stay together
        order.setdefault(tuple(k for k, _ in e.leaves), len(order))
    return sorted(out, key=lambda e: order[tuple(k for k, _ in e.leaves)])


def shards(table: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive entries cut into files of at most `max_shard_bytes` (a larger tensor gets a file alone)."""
    files, current, size = [], [], 0
    for e in table:
        if current and size + e.nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    return files + ([current] if current else [])


def _part(tree: dict, part: str):
    """The key of `tree` spelling `part` (a pure dict may key a list index as int, a checkpoint as string)."""
    return int(part) if part not in tree and part.isdigit() and int(part) in tree else part


def get_path(tree: dict, key: LeafKey):
    for part in key:
        tree = tree[_part(tree, part)]
    return tree


def set_path(tree: dict, key: LeafKey, value) -> None:
    for part in key[:-1]:
        tree = tree.setdefault(_part(tree, part), {})
    tree[_part(tree, key[-1])] = value
