"""The train step traced as a GPU run traces it (`lingpack.backend.target("gpu")`) lowers for CUDA.

Each test builds the run's real step (`TrainProgram`: forward, backward, AdamW, the expert-bias update,
micro-batches) from the config files run.py composes (`kernel=chunked`, the model's `attention_impl:
auto`) on an 8-device `fsdp=2 x tensor=2 x expert=2` mesh. Every Pallas kernel of the step must be the
Triton attention kernel (pallas_triton) inside its shard_map: no TPU custom call, and no pallas_call in
interpret mode anywhere in the traced jaxpr (`lingpack.plan.hlo.pallas_kernels`). With `attention_impl:
splash` the same trace is a ConfigError (tests/test_backend.py); tests/kernels/test_attention_triton.py
shows that both checks can fail.

The default suite exports the flagship's real widths at 2 layers (each mixer and FFN kind once, and the MTP
layer; tracing is the cost, nothing compiles); the whole flagship and ling3_small are the `slow` cases.
"""
from pathlib import Path

import pytest
import yaml

from lingpack.plan import hlo
from lingpack import config as config_lib
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram
from tests.kernels.triton_cases import TRITON_GRAD_NAMES, triton_operand_types

ROOT = Path(__file__).resolve().parents[2]
MESH = dict(data=1, fsdp=2, tensor=2, expert=2, context=1)
ALL_AXES = 'manual_axes={"data", "fsdp", "tensor", "expert", "context"}'


def program(model_name: str, *, rows: int = 8, seq_length: int, micro_batches: int = 2, **model_overrides):
    """The step of `model=<model_name> kernel=chunked [model.<key>=<value> ...]` on the mesh above."""
    kernel = config_lib.make(config_lib.KernelConfig, yaml.safe_load((ROOT / "conf/kernel/chunked.yaml").read_text()),
                             "kernel")
    values = {**yaml.safe_load((ROOT / f"conf/model/{model_name}.yaml").read_text()), **model_overrides}
    model = config_lib.model_config(values, kernel, values["vocab_size"])
    return model, TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=1000), ParallelConfig(**MESH),
                                     TrainConfig(micro_batches=micro_batches), rows=rows, seq_length=seq_length)


def check_kernels(kernels: dict, module: str) -> None:
    """Every kernel of the step is a Triton call (counted by name in the module), none Mosaic or interpreted."""
    assert kernels["interpret"] == {}, f"Pallas kernels traced in interpret mode: {kernels['interpret']}"
    assert kernels["mosaic"] == {} and "tpu_custom_call" not in module
    assert set(kernels["triton"]) == set(hlo.triton_calls(module)) == TRITON_GRAD_NAMES
    assert ALL_AXES in module


def local_q(model, rows: int, seq_length: int, micro_batches: int = 2) -> str:
    """The attention q one shard sees: the micro-batch's rows over fsdp x expert, MLA heads over tensor."""
    B = rows // micro_batches // (MESH["fsdp"] * MESH["expert"])
    H = model.mla.num_heads // MESH["tensor"]
    return f"tensor<{B}x{seq_length}x{H}x{model.mla.qk_head_dim}xbf16>"


def export_checked(model_name: str, seq_length: int, **model_overrides):
    model, step = program(model_name, seq_length=seq_length, **model_overrides)
    exported, kernels = step.export("gpu", with_kernels=True)
    assert exported.platforms == ("cuda",) and (model.attention_impl, model.kda_impl) == ("auto", "chunked")
    module = exported.mlir_module()
    check_kernels(kernels, module)
    assert local_q(model, 8, seq_length) in triton_operand_types(module)
    return model, module


def test_flagship_widths_export_for_cuda_with_triton_attention_only():
    """Flagship widths at 2 layers (a KDA layer with the dense FFN, an MLA layer with the MoE; cycle 2) and the
    MTP layer, T=8192, 2 micro-batches of 4 rows: every attention kernel sees 1 row and 8 of the 16 heads."""
    model, _ = export_checked("ling3_flagship", 8192, num_layers=2, inhomogeneous_layer_cycle_interval=2)
    assert model.layer_kinds() == [("kda", "dense"), ("mla", "moe")]
    assert local_q(model, 8, 8192) == "tensor<1x8192x8x192xbf16>"


@pytest.mark.slow
def test_flagship_step_exports_for_cuda_on_fsdp_tensor_expert():
    """The whole flagship (24 layers, the layer scan), T=8192: the issue's bar of 0 TPU and 0 interpret calls."""
    model, module = export_checked("ling3_flagship", 8192)
    assert model.scanned_layers() == range(1, 24) and "stablehlo.case" in module   # MLA under the scan's cond


@pytest.mark.slow
def test_ling3_small_step_exports_for_cuda_on_fsdp_tensor_expert():
    export_checked("ling3_small", 4096)


@pytest.mark.slow
def test_the_step_check_sees_an_emulated_kernel():
    """The check can fail: the Pallas TPU KDA kernel with `kernel.interpret=true` traced for GPU is reported."""
    import dataclasses
    model, _ = program("ling3_flagship", seq_length=1024, num_layers=2, inhomogeneous_layer_cycle_interval=2)
    model = dataclasses.replace(model, kda_impl="pallas_segment", kda_interpret=True)
    step = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=1000), ParallelConfig(**MESH),
                              TrainConfig(micro_batches=2), rows=8, seq_length=1024)
    exported, kernels = step.export("gpu", with_kernels=True)
    assert set(kernels["interpret"]) == {"kda_segment_fwd", "kda_segment_states", "kda_segment_bwd"}
    with pytest.raises(AssertionError, match="interpret mode"):
        check_kernels(kernels, exported.mlir_module())
