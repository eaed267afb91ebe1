"""Rows stay split over every batch axis from the embedding to the loss (parallel/layout.py, models/moe.py).

The compiled train step of a small Ling3 on every conf/parallel layout (and, slow, on the batch-axis mixes of
the flagship's meshes with a scanned KDA/MLA/MoE stack and flash attention): no all-gather or all-reduce
whose result carries the global [rows, T] or the MoE's global [rows * T (* k)] token rows, no "Involuntary
full rematerialization" from XLA's SPMD partitioner (its C++ log on fd 2), and under `data` the per-device
FLOPs and temporaries about 1/8 of one device's. Compile only; nothing runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from pathlib import Path

import jax
import pytest
import yaml

from lingpack import backend
from lingpack.plan import chips, hlo
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.models.mtp import MTPConfig
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram

ROOT = Path(__file__).resolve().parents[2]
ROWS, T = 8, 128
# the default suite's model: a dense KDA layer and an MLA + MoE layer (about 4 s of CPU to compile per mesh)
SMALL = Ling3Config(vocab_size=256, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                    kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16, attention_block_size=16,
                    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                    moe=MoEConfig(num_experts=8, top_k=2, expert_dim=16, n_groups=2, topk_groups=1), mtp_num_layers=0,
                    vocab_chunk_size=64)   # the chunked head, vocabulary-parallel where `tensor` splits it
# slow: layers 1-4 (MLA KDA MLA KDA, MoE) in the layer scan, flash attention, an MoE MTP layer
STACKED = dataclasses.replace(SMALL, num_layers=5, attention_impl="flash", mtp_num_layers=1, mtp=MTPConfig(use_moe=True))
MIXES = {"fsdp8": dict(data=1, fsdp=8), "expert8": dict(data=1, expert=8), "fsdp2-expert4": dict(data=1, fsdp=2, expert=4),
         "data2-tensor2-expert2": dict(data=2, tensor=2, expert=2)}
CONF = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "conf/parallel").glob("*.yaml")) if p.stem != "single"}


@functools.lru_cache(maxsize=None)
def compile_step(model: Ling3Config, axes: tuple, devices: int = 8):
    """(compiled train step, what XLA printed on fd 2 while compiling it); `axes` as sorted (name, size) pairs."""
    program = TrainProgram.build(model, LossConfig(megatron_dp_size=2), OptimConfig(decay_steps=10),
                                 ParallelConfig(**dict(axes)), TrainConfig(), rows=ROWS, seq_length=T,
                                 devices=jax.devices()[:devices])
    lowered = program.lower()
    with tempfile.TemporaryFile(mode="w+") as log:   # XLA's partitioner logs from C++ straight to fd 2
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            compiled = lowered.compile()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return compiled, log.read()


def batch_collectives(compiled) -> list[str]:
    """Gathers / reductions whose result has the global rows x T leading dims, or rows x T (x k) token rows."""
    ops, _ = hlo.collective_ops(compiled.as_text())
    tokens = {ROWS * T, ROWS * T * SMALL.moe.top_k}
    return sorted({f"{op.kind} {op.shape}" for op in ops if op.group_size != 1 and op.kind in ("all-gather", "all-reduce")
                   and any(dims[:2] == (ROWS, T) or dims[:1] and dims[0] in tokens for dims in op.dims)})


def _key(axes: dict) -> tuple:
    return tuple(sorted(axes.items()))


CASES = [pytest.param(SMALL, axes, id=name) for name, axes in CONF.items()]
CASES += [pytest.param(STACKED, axes, id=f"stacked-{name}", marks=pytest.mark.slow)
          for name, axes in {**CONF, **MIXES}.items()]


@pytest.mark.parametrize("model, axes", CASES)
def test_rows_stay_split(model, axes):
    compiled, log = compile_step(model, _key(axes))
    assert "Involuntary full rematerialization" not in log, log[-3000:]
    assert batch_collectives(compiled) == []


def test_per_device_work_falls_with_the_batch_axis():
    one, _ = compile_step(SMALL, _key(dict(data=1)), devices=1)
    eight, _ = compile_step(SMALL, _key(CONF["data"]))
    flops = [c.cost_analysis()["flops"] for c in (one, eight)]
    temp = [c.memory_analysis().temp_size_in_bytes for c in (one, eight)]
    assert flops[1] * 8 < 1.25 * flops[0], flops   # a global MoE dispatch left ~1/3 of one device's work per device
    assert temp[1] * 8 < 1.5 * temp[0], temp
    # rows over `data` alone: nothing is gathered (a kernel layout that hides the rows axis behind another,
    # e.g. chunk-major KDA, made the partitioner gather its per-chunk arrays, which batch_collectives misses)
    gathered = [f"{op.kind} {op.shape}" for op in hlo.collective_ops(eight.as_text())[0]
                if op.kind == "all-gather" and op.group_size != 1]
    assert gathered == [], gathered


def compile_step_tpu(devices: list, axes: dict):
    """The SMALL train step compiled by XLA:TPU for `devices` (a libtpu topology), traced for TPU."""
    with backend.target("tpu"):
        program = TrainProgram.build(SMALL, LossConfig(megatron_dp_size=2), OptimConfig(decay_steps=10),
                                     ParallelConfig(**axes), TrainConfig(), rows=ROWS, seq_length=T, devices=devices)
        return program.lower().compile()


@pytest.mark.slow
def test_per_device_work_falls_with_the_batch_axis_on_xla_tpu():
    """The same as XLA:TPU plans it, 8 chips of v5p (data=8) against one (about 40 CPU s of compiles): per-device
    FLOPs x 8 measured 1.03x one chip's, nothing all-gathered, no global rows collective. Temporaries x 8
    measured 3.96x one chip's: at these widths (emb 32, one 128-token row per device) XLA:TPU's temporaries
    are mostly not row-proportional, so the bound is 4.5x (rows left global would give ~8x), where XLA:CPU's
    -O0 plan allows 1.5x."""
    one = compile_step_tpu(chips.tpu_devices(chips.chip("v5p"), 1), dict(data=1))
    eight = compile_step_tpu(chips.tpu_devices(chips.chip("v5p"), 8),
                             CONF["data"])
    flops = [c.cost_analysis()["flops"] for c in (one, eight)]
    temp = [c.memory_analysis().temp_size_in_bytes for c in (one, eight)]
    assert flops[1] * 8 < 1.25 * flops[0], flops
    assert temp[1] * 8 < 4.5 * temp[0], temp
    gathered = [f"{op.kind} {op.shape}" for op in hlo.collective_ops(eight.as_text())[0]
                if op.kind == "all-gather" and op.group_size != 1]
    assert gathered == [] and batch_collectives(eight) == [], gathered
