"""Frozen config dataclasses of the training package, one per module.

Each takes plain keyword fields only (so `Cls(**yaml_dict)` or `from_dict(Cls, d)` builds it) and
validates itself in `__post_init__`; errors name the field, the offending value and the valid values.
"""

from __future__ import annotations

import dataclasses
import typing

from lingpack.errors import ConfigError
from lingpack.precision import DTYPES

LOSS_MODES = ("megatron", "per_token")
SCHEDULES = ("cosine", "linear", "constant")
NAN_POLICIES = ("halt", "skip")
MESH_AXES = ("data", "fsdp", "tensor", "expert", "context")
CONTEXT_STRATEGIES = ("ring", "all_gather", "ulysses", "usp")

# Logical parameter axis -> mesh axis (None = replicated). `batch` / `length` name the activation axes.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "context"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("exp", "expert"),
    ("norm", None),
    ("conv", None),
)


def _choice(cls: str, name: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"{cls}.{name}={value!r} is not valid; choose one of {tuple(valid)}")


def _at_least(cls: str, name: str, value, low) -> None:
    if value is None or value < low:
        raise ValueError(f"{cls}.{name}={value!r} must be >= {low}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """How per-token cross-entropies become the optimised objective (see loss.py for the formulas).

    mode: "megatron" reproduces Megatron-LM's reduction: each micro-batch's token mean, averaged over
        micro-batches and data-parallel ranks (`calculate_per_token_loss=True`: the global per-token
        mean); "per_token": the global per-token mean of the whole step batch (MaxText's).
    megatron_dp_size: data-parallel size of the Megatron run being reproduced: the rows of each micro-batch
        split into this many contiguous groups, each averaged like one rank's micro-batch. It is a
        property of the loss, not of our mesh (any mesh gives the same numbers).
    z_loss_weight: weight of the output-logit z-loss `logsumexp(logits)^2` (per loss token; 0 = off).
    mtp_loss_scale: Megatron's `mtp_loss_scaling_factor` (the MTP loss is scale * mean over depths).
    The router's z-loss weight and expert-bias rate belong to the MoE layer (`model.moe.z_loss_coef`,
    `model.moe.bias_update_rate`, as in Megatron's TransformerConfig).
    """

    mode: str = "megatron"
    calculate_per_token_loss: bool = False
    megatron_dp_size: int = 1
    z_loss_weight: float = 0.0
    mtp_loss_scale: float = 0.1

    def __post_init__(self):
        _choice("LossConfig", "mode", self.mode, LOSS_MODES)
        _at_least("LossConfig", "megatron_dp_size", self.megatron_dp_size, 1)
        for name in ("z_loss_weight", "mtp_loss_scale"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"LossConfig.{name}={value} must be >= 0")
        if self.mode == "per_token" and self.calculate_per_token_loss:
            raise ValueError("LossConfig.calculate_per_token_loss is a switch of mode='megatron'; "
                             "mode='per_token' is already the global per-token mean: drop one of them")

    @property
    def global_token_mean(self) -> bool:
        """True when the objective is the global per-token mean (not a mean of micro-batch means)."""
        return self.mode == "per_token" or self.calculate_per_token_loss


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with Megatron's warmup + decay schedule (see optim.py).

    decay_steps: step at which the decay reaches min_lr (Megatron's lr_decay_iters, warmup included);
        None = the training length. master_dtype: dtype of the stored (master) parameters and optimizer
        moments; the forward casts to the model's own parameter dtypes (bf16 compute with fp32 master).
        float64 (with model.dtype float64) runs in JAX's x64 mode (lingpack.precision).
    clip_grad_norm: 0 disables clipping.
    """

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    decay_steps: int | None = None
    schedule: str = "cosine"
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_grad_norm: float = 1.0
    master_dtype: str = "float32"

    def __post_init__(self):
        _choice("OptimConfig", "schedule", self.schedule, SCHEDULES)
        _choice("OptimConfig", "master_dtype", self.master_dtype, DTYPES)
        _at_least("OptimConfig", "lr", self.lr, 0.0)
        _at_least("OptimConfig", "warmup_steps", self.warmup_steps, 0)
        _at_least("OptimConfig", "weight_decay", self.weight_decay, 0.0)
        _at_least("OptimConfig", "clip_grad_norm", self.clip_grad_norm, 0.0)
        _at_least("OptimConfig", "eps", self.eps, 0.0)
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"OptimConfig.min_lr={self.min_lr} must lie in [0, lr={self.lr}]")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimConfig.{name}={getattr(self, name)} must lie in [0, 1)")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps and self.schedule != "constant":
            raise ValueError(f"OptimConfig.decay_steps={self.decay_steps} must exceed warmup_steps={self.warmup_steps}"
                             " (it counts the warmup, like Megatron's lr_decay_iters)")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Mesh axis sizes; exactly one may be -1 ("the rest of the devices"). Their product = device count.

    logical_axis_rules: (logical name, mesh axis | tuple of mesh axes | None) pairs; None = DEFAULT_RULES.
    Context parallelism (context > 1: every row's T axis is split over `context` devices, parallel/):
    context_strategy: how softmax attention exchanges keys (ring | all_gather | ulysses | usp);
    context_ulysses: USP's all-to-all degree U (the ring runs over context / U), 1 otherwise;
    load_balance: zigzag-reorder every batch (device r holds chunks r and 2N-1-r of 2N) so causal
        attention work is even; rows must then divide by 2 x context (by context when off).
    cpu_devices: fake CPU devices per process (XLA's host device count, set before JAX starts; see
        lingpack/devices.py); None leaves it to XLA_FLAGS (one CPU device without it). Accelerators ignore it.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    context: int = 1
    logical_axis_rules: tuple | None = None
    context_strategy: str = "ring"
    context_ulysses: int = 1
    load_balance: bool = True
    cpu_devices: int | None = None

    def __post_init__(self):
        if self.cpu_devices is not None:
            _at_least("ParallelConfig", "cpu_devices", self.cpu_devices, 1)
        _choice("ParallelConfig", "context_strategy", self.context_strategy, CONTEXT_STRATEGIES)
        _at_least("ParallelConfig", "context_ulysses", self.context_ulysses, 1)
        if self.context_strategy != "usp" and self.context_ulysses != 1:
            raise ValueError(f"ParallelConfig.context_ulysses={self.context_ulysses} applies only to "
                             f"context_strategy='usp' (got {self.context_strategy!r}); set it to 1 or use usp")
        if self.context_strategy == "usp" and self.context > 0 and self.context % self.context_ulysses:
            raise ValueError(f"ParallelConfig.context_ulysses={self.context_ulysses} must divide context="
                             f"{self.context} (USP runs a ring over context / context_ulysses devices)")
        sizes = self.axis_sizes()
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError(f"ParallelConfig: at most one mesh axis may be -1 ('the rest'); got {sizes}")
        for name, value in sizes.items():
            if value != -1 and value < 1:
                raise ValueError(f"ParallelConfig.{name}={value} must be >= 1 or -1 ('the rest')")
        if self.logical_axis_rules is not None:
            rules = tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in self.logical_axis_rules)
            object.__setattr__(self, "logical_axis_rules", rules)
            for name, axes in rules:
                for axis in (axes if isinstance(axes, tuple) else (axes,)):
                    if axis is not None and axis not in MESH_AXES:
                        raise ValueError(f"ParallelConfig.logical_axis_rules maps {name!r} to unknown mesh axis "
                                         f"{axis!r}; valid mesh axes: {MESH_AXES}")

    def axis_sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}

    @property
    def rules(self) -> tuple:
        return DEFAULT_RULES if self.logical_axis_rules is None else self.logical_axis_rules


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing: every `save_every` steps into `directory`, keeping the newest `keep`.

    The newest checkpoint in `directory` that restores is restored on start (resume; a damaged newer one is
    set aside with a warning, train/checkpoint.py); `resume_step` restores that step or stops with one line;
    `enabled=False` turns both off.
    """

    directory: str = "checkpoints"
    save_every: int = 1000
    keep: int = 3
    async_save: bool = True
    enabled: bool = True
    resume_step: int | None = None

    def __post_init__(self):
        _at_least("CheckpointConfig", "save_every", self.save_every, 1)
        _at_least("CheckpointConfig", "keep", self.keep, 1)
        if self.resume_step is not None:
            _at_least("CheckpointConfig", "resume_step", self.resume_step, 1)
        if self.enabled and not self.directory:
            raise ValueError("CheckpointConfig.directory is empty; give a path or set enabled=False")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The loop: `steps` optimizer updates of one global batch each, split into `micro_batches`.

    nan_policy: "halt" (save a checkpoint of the last good state, then stop with an error message) or
        "skip" (drop the update, keep going). peak_flops_per_device: for the MFU estimate; None looks the
        device kind up in a small table (CPU: the measured matmul ceiling; unknown kinds report no mfu). progress_bar: tqdm on the console.
    eval_every / eval_batches: Megatron's eval_interval / eval_iters: every `eval_every` steps (0 = never)
        evaluate `eval_batches` global batches of the valid split, and once more at the end of the run;
        eval_test: also evaluate the test split at the end (when data.split gives it data). See evaluate.py.
    overflow_policy: a micro-batch with more documents than the aligned kernels' `kda_max_segs` has the
        documents that do not fit left out of the step (made padding: no loss, no gradient, never mixed);
        "warn" warns once, counts them per step (dropped_documents, dropped_tokens) and trains on; "halt"
        stops before the first update that would leave documents out (state before that batch saved).
    profile_steps: [a, b] traces loop steps a <= step < b (counted from 0: the metrics records step a + 1 .. b)
        with `jax.profiler` into `profile_dir` (TensorBoard / xprof, plus a Perfetto trace); None = off.
    """

    steps: int = 100
    micro_batches: int = 1
    log_every: int = 10
    nan_policy: str = "halt"
    seed: int = 0
    peak_flops_per_device: float | None = None
    progress_bar: bool = True
    handle_signals: bool = True
    overflow_policy: str = "warn"
    eval_every: int = 0
    eval_batches: int = 1
    eval_test: bool = True
    profile_steps: tuple | None = None
    profile_dir: str = "profile"    # config.build sets <run dir>/profile when the yaml says null

    def __post_init__(self):
        _choice("TrainConfig", "overflow_policy", self.overflow_policy, ("warn", "halt"))
        _at_least("TrainConfig", "eval_every", self.eval_every, 0)
        _at_least("TrainConfig", "eval_batches", self.eval_batches, 1)
        _at_least("TrainConfig", "steps", self.steps, 1)
        _at_least("TrainConfig", "micro_batches", self.micro_batches, 1)
        _at_least("TrainConfig", "log_every", self.log_every, 1)
        _choice("TrainConfig", "nan_policy", self.nan_policy, NAN_POLICIES)
        if self.profile_steps is not None:
            steps = self.profile_steps
            if (not isinstance(steps, (list, tuple)) or len(steps) != 2 or not all(isinstance(s, int) for s in steps)
                    or not 0 <= steps[0] < steps[1] <= self.steps):
                raise ConfigError(f"train.profile_steps={list(steps) if isinstance(steps, (list, tuple)) else steps!r} "
                                  f"must be [a, b] with 0 <= a < b <= train.steps={self.steps} (traces steps a..b-1), "
                                  "or null")
            object.__setattr__(self, "profile_steps", tuple(steps))


T = typing.TypeVar("T")


def from_dict(cls: type[T], d: typing.Mapping | None) -> T:
    """`cls(**d)` with an error naming unknown keys and the valid ones."""
    d = dict(d or {})
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for {cls.__name__}; valid keys: {valid}")
    return cls(**d)
