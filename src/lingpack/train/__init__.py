"""Training: Megatron loss semantics (loss.py), AdamW + schedule (optim.py), sharded accumulation step
(step.py, sharding.py), Orbax checkpoints (checkpoint.py) and the loop (loop.py).

Public API (imported lazily so `import lingpack.train.configs` stays light): the configs
LossConfig, OptimConfig, ParallelConfig, CheckpointConfig, TrainConfig, and `train`, TrainResult,
NonFiniteLossError, METRIC_NAMES.
"""

_EXPORTS = {
    "LossConfig": "lingpack.train.configs",
    "OptimConfig": "lingpack.train.configs",
    "ParallelConfig": "lingpack.train.configs",
    "CheckpointConfig": "lingpack.train.configs",
    "TrainConfig": "lingpack.train.configs",
    "from_dict": "lingpack.train.configs",
    "train": "lingpack.train.loop",
    "TrainResult": "lingpack.train.loop",
    "NonFiniteLossError": "lingpack.train.loop",
    "METRIC_NAMES": "lingpack.train.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lingpack.train' has no attribute {name!r}")
