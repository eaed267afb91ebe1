"""Progressive context training: stages of (seq_length, rope_theta, steps) run as one resumable job.

    schedule = ContextSchedule(stages=(Stage(4096, 10_000, 1000), Stage(16384, 500_000, 800), ...))
    results = train_with_schedule(schedule, model_cfg, data_cfg, loss_cfg, optim_cfg, parallel_cfg,
                                  ckpt_cfg, train_cfg)

Stage i covers global steps [start_i, end_i). Every stage is a `loop.train` call into ONE checkpoint
directory with `train.steps = end_i`, the data pipeline rebuilt at the stage's `seq_length` and the
model's MLA RoPE theta switched (LWM's recipe: a larger theta for longer contexts). The loop saves a
checkpoint when a stage ends; the next stage restores it (parameters, optimizer, step) and moves the
data position to where the tokens consumed so far end at the new length: batch ceil(consumed / (B x
seq_length)) of the new Megatron sample index (the same global batch size B in every stage). A restart
reads the latest checkpoint's step and resumes inside the stage that step belongs to, so a kill in the
middle of a stage resumes in that stage, at its own data position. One learning-rate schedule spans
all stages (`decay_steps` defaults to the total).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from lingpack.train import loop
from lingpack.train import optim as optim_lib
from lingpack.train.checkpoint import Checkpointer

log = logging.getLogger("lingpack.train")


@dataclasses.dataclass(frozen=True)
class Stage:
    seq_length: int
    steps: int
    rope_theta: float | None = None   # None: keep the model's

    def __post_init__(self):
        if self.seq_length < 2 or self.steps < 1:
            raise ValueError(f"a context stage needs seq_length >= 2 and steps >= 1; got {self}")
        if self.rope_theta is not None and self.rope_theta <= 0:
            raise ValueError(f"a context stage's rope_theta must be > 0; got {self.rope_theta}")


@dataclasses.dataclass(frozen=True)
class ContextSchedule:
    stages: tuple = ()

    def __post_init__(self):
        stages = tuple(s if isinstance(s, Stage) else Stage(**s) for s in self.stages)
        object.__setattr__(self, "stages", stages)

    @property
    def enabled(self) -> bool:
        return bool(self.stages)

    @property
    def ends(self) -> list[int]:
        """Global step at which each stage ends (exclusive)."""
        out, total = [], 0
        for stage in self.stages:
            total += stage.steps
            out.append(total)
        return out

    def stage_at(self, step: int) -> int:
        """The stage a run resumed at global `step` continues in (len(stages) when all are done)."""
        return next((i for i, end in enumerate(self.ends) if step < end), len(self.stages))

    def start_batch(self, i: int, batch_size: int) -> int:
        """The first data batch of stage i: where the tokens of stages 0..i-1 end at stage i's length."""
        consumed = sum(s.steps * s.seq_length * batch_size for s in self.stages[:i])
        return math.ceil(consumed / (batch_size * self.stages[i].seq_length))


def with_rope_theta(model_cfg, theta: float | None):
    """`model_cfg` with its MLA RoPE theta set (Ling3Config.mla, or a config's own `rope_theta` field)."""
    if theta is None:
        return model_cfg
    if hasattr(model_cfg, "mla"):
        return dataclasses.replace(model_cfg, mla=dataclasses.replace(model_cfg.mla, rope_theta=float(theta)))
    if any(f.name == "rope_theta" for f in dataclasses.fields(model_cfg)):
        return dataclasses.replace(model_cfg, rope_theta=float(theta))
    raise ValueError(f"context schedule sets rope_theta={theta}, but {type(model_cfg).__name__} has no RoPE theta")


def train_with_schedule(schedule: ContextSchedule, model_cfg, data_cfg, loss_cfg, optim_cfg, parallel_cfg, ckpt_cfg,
                        train_cfg, **train_kwargs) -> list:
    """Runs the remaining stages; returns their `loop.TrainResult`s (stops early when one was preempted).
    `train_kwargs` (metrics_callback, on_start) go to every stage's `loop.train`."""
    if not ckpt_cfg.enabled:
        raise ValueError("a context schedule hands the state from stage to stage through checkpoints: set "
                         "checkpoint.enabled=true")
    total = schedule.ends[-1]
    optim_cfg = optim_lib.resolve(optim_cfg, total)   # one LR schedule over all stages
    checkpointer = Checkpointer(ckpt_cfg)
    latest = ckpt_cfg.resume_step or checkpointer.latest_step() or 0
    checkpointer.close()
    results = []
    for i in range(schedule.stage_at(latest), len(schedule.stages)):
        stage, start = schedule.stages[i], schedule.ends[i] - schedule.stages[i].steps
        first_batch = schedule.start_batch(i, data_cfg.global_batch_size)
        log.info("context stage %d/%d: seq_length %d, rope_theta %s, steps %d..%d, data from batch %d", i + 1,
                 len(schedule.stages), stage.seq_length, stage.rope_theta, start, schedule.ends[i], first_batch)

        def data_position(step, data_state, start=start, first_batch=first_batch):
            # the checkpoint that ended the previous stage holds that stage's data position: move it
            return dict(data_state, next_index=first_batch) if step == start else data_state

        result = loop.train(with_rope_theta(model_cfg, stage.rope_theta),
                            dataclasses.replace(data_cfg, seq_length=stage.seq_length), loss_cfg, optim_cfg,
                            parallel_cfg, ckpt_cfg, dataclasses.replace(train_cfg, steps=schedule.ends[i]),
                            data_state_on_resume=data_position, **train_kwargs)
        results.append(result)
        if result.preempted:
            break
    return results
