"""Weights out (checkpoint leaves -> safetensors shards) and in (safetensors -> a model's state), lazily.

Export memory: tensors are written shard file by shard file. For each file the exporter restores, from the
Orbax checkpoint, only the leaves that file's tensors are made of (a partial restore, host numpy arrays, no
device), keeps them while the next file still needs them and drops them otherwise; the table orders tensors
so that those of one leaf are neighbours. Peak host memory is one file's tensors plus the leaves they come
from (for scanned layers a leaf is one parameter of every layer in the stack), never the whole model twice.
Import reads one tensor at a time from the safetensors files (`safe_open`).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from lingpack.export.table import Entry, get_path, set_path, shards

log = logging.getLogger("lingpack.export")

INDEX = "model.safetensors.index.json"


class CheckpointLeaves:
    """`read(keys) -> {key: np.ndarray}` from the `state` item of an Orbax checkpoint step directory."""

    def __init__(self, step_dir: str):
        import orbax.checkpoint as ocp
        self.path = os.path.join(step_dir, "state")
        self._ocp, self._checkpointer = ocp, ocp.PyTreeCheckpointer()

    def read(self, keys) -> dict:
        item, restore_args = {}, {}
        for key in keys:
            set_path(item, key, 0)   # a placeholder: partial_restore reads only the paths named
            set_path(restore_args, key, self._ocp.RestoreArgs(restore_type=np.ndarray))
        restored = self._checkpointer.restore(self.path, args=self._ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True))
        return {key: np.asarray(get_path(restored, key)) for key in keys}


class StateLeaves:
    """The same from in-memory pure dicts {"params": ..., "rest": ...} (a model's state)."""

    def __init__(self, tree: dict):
        self.tree = tree

    def read(self, keys) -> dict:
        return {key: np.asarray(get_path(self.tree, key)) for key in keys}


def _as_float32(array: np.ndarray) -> np.ndarray:
    return array if array.dtype == np.float32 else array.astype(np.float32)   # bf16 / fp64 masters -> fp32 files


def write_shards(table: list[Entry], leaves, out_dir: str, max_shard_bytes: int) -> dict:
    """Write `table`'s tensors as `model.safetensors` (one file) or `model-0000i-of-0000n.safetensors` + the index;
    returns {"files": n, "tensors": count, "bytes": total}."""
    from safetensors.numpy import save_file
    files = shards(table, max_shard_bytes)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    held, weight_map, total = {}, {}, 0
    for file_name, file_entries in zip(names, files):
        needed = {key for e in file_entries for key, _ in e.leaves}
        held = {k: v for k, v in held.items() if k in needed}           # leaves no longer needed are dropped
        missing = sorted(needed - set(held))
        if missing:
            held.update(leaves.read(missing))
        tensors = {}
        for e in file_entries:
            arrays = [_as_float32(held[key][index]) for key, index in e.leaves]
            tensors[e.name] = e.make(arrays)
            weight_map[e.name] = file_name
        total += sum(t.nbytes for t in tensors.values())
        save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
        log.debug("wrote %s (%d tensors)", file_name, len(tensors))
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, INDEX), "w", encoding="utf-8") as stream:
            json.dump(index, stream, indent=2)
            stream.write("\n")
    return {"files": len(files), "tensors": len(weight_map), "bytes": total}


def tensor_files(directory: str) -> dict[str, str]:
    """{tensor name: safetensors file path} of a transformers model directory (sharded or not)."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as stream:
            weight_map = json.load(stream)["weight_map"]
        return {name: os.path.join(directory, f) for name, f in weight_map.items()}
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{directory}: neither model.safetensors nor {INDEX}; is it a transformers model "
                                "directory saved with safetensors?")
    from safetensors import safe_open
    with safe_open(single, framework="np") as f:
        return {name: single for name in f.keys()}


def read_into(table: list[Entry], directory: str, tree: dict) -> list[str]:
    """Write every table tensor found in `directory` into the pure-dict state `tree` (numpy leaves, in place,
    each cast to the leaf's dtype); returns the table names the directory lacks."""
    from safetensors import safe_open
    files = tensor_files(directory)
    missing, handles = [], {}
    try:
        for e in table:
            if e.name not in files:
                missing.append(e.name)
                continue
            path = files[e.name]
            if path not in handles:
                handles[path] = safe_open(path, framework="np").__enter__()
            tensor = handles[path].get_tensor(e.name)
            expected = e.make([np.zeros(s, np.float32) for s in e.shapes]).shape   # shapes only
            if tuple(tensor.shape) != tuple(expected):
                raise ValueError(f"{directory}: {e.name} has shape {tuple(tensor.shape)}, this run's model needs "
                                 f"{tuple(expected)}")
            for (key, index), part in zip(e.leaves, e.split(tensor)):
                leaf = get_path(tree, key)
                leaf[index] = part.astype(leaf.dtype)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return missing
