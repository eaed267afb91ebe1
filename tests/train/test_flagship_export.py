"""The flagship train step (conf/model/ling3_flagship.yaml, T=8192) exported for TPU on pod-slice meshes.

Each test builds the run's real step (`TrainProgram`: forward, backward, AdamW, the expert-bias update,
micro-batches, the layer stack) from the config files run.py composes, traces it as a TPU run traces
it (`lingpack.backend.target("tpu")`, `kernel.interpret` left unset) and exports it with `jax.export`.
Every Pallas kernel must lower through Mosaic inside its shard_map: the Mosaic calls are counted by
kernel name in the module, and none may run in interpret mode (`lingpack.plan.hlo.pallas_kernels` of the
traced step). The unwrapped splash call failed this export ("Mosaic kernels cannot be automatically
partitioned"), see tests/kernels/test_splash_sharded.py.

One mesh runs in the default suite at 9 of the 24 layers (the dense layer and two cycles of the layer
scan: every deeper layer is one more trip of the same scan; tracing is the cost, nothing compiles); the
mesh matrix, at all 24 layers, is `slow` (run it under `flock /tmp/lingpack-bigmem.lock`).
"""
import re
from pathlib import Path

import pytest
import yaml

from lingpack import config as config_lib
from lingpack.plan import hlo
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram

ROOT = Path(__file__).resolve().parents[2]
T = 8192
KDA = {"pallas_segment": {"kda_segment_fwd", "kda_segment_states", "kda_segment_bwd"},
       "pallas_varlen": {"kda_varlen_fwd", "kda_varlen_states", "kda_varlen_bwd"}}
SPLASH = {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
          "splash_mha_dkv_segmented_no_residuals"}
ALL_AXES = 'manual_axes={"data", "fsdp", "tensor", "expert", "context"}'


def _yaml(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / f"conf/{group}/{name}.yaml").read_text())


def flagship(kernel: str, num_layers: int | None = None):
    """The flagship model as run.py resolves `model=ling3_flagship kernel=<kernel> [model.num_layers=N]`."""
    kernel_cfg = config_lib.make(config_lib.KernelConfig, _yaml("kernel", kernel), "kernel")
    model_values = _yaml("model", "ling3_flagship")
    model_values["num_layers"] = num_layers or model_values["num_layers"]
    return config_lib.model_config(model_values, kernel_cfg, model_values["vocab_size"])


def export_step(kernel: str, micro_batches: int = 2, rows: int = 8, num_layers: int | None = None, **mesh):
    model = flagship(kernel, num_layers)
    parallel = ParallelConfig(**{"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1, **mesh})
    program = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=1000), parallel,
                                 TrainConfig(micro_batches=micro_batches), rows=rows, seq_length=T)
    exported, kernels = program.export("tpu", with_kernels=True)
    return model, exported.mlir_module(), kernels


def check_kernels(module: str, kernels: dict, kda: str, attention: bool = True) -> None:
    """Every kernel of the step is a Mosaic call (counted by name in the module), none interpreted."""
    want = KDA[kda] | (SPLASH if attention else set())
    assert kernels["interpret"] == {}, f"Pallas kernels traced in interpret mode: {kernels['interpret']}"
    megablox = {"kernel"}   # the MoE's grouped matmuls on TPU (Megablox gmm / tgmm: unnamed, so named by their body)
    assert set(kernels["mosaic"]) - megablox == want
    calls = hlo.mosaic_calls(module)
    assert set(calls) - megablox == want and all(n >= 1 for n in calls.values())


def test_flagship_step_exports_for_tpu_on_fsdp_tensor_expert():
    """The mesh the unwrapped splash failed on: fsdp=2 x tensor=2 x expert=2, kernel=pallas_segment, 2
    micro-batches of 4 rows; every kernel sees 1 row and 8 of the 16 heads (splash: a mask for 8 heads)."""
    model, module, kernels = export_step("pallas_segment", num_layers=9, fsdp=2, tensor=2, expert=2)
    assert model.attention_impl == "auto" and model.scanned_layers() == range(1, 9)   # auto: splash on TPU
    check_kernels(module, kernels, "pallas_segment")
    assert set(re.findall(r"manual_axes=\{[^}]*\}", module)) >= {ALL_AXES}
    mla = model.mla
    assert f"tensor<1x{T}x8x{mla.qk_head_dim}xbf16>" in module      # splash's q on one shard
    assert f"tensor<1x{T}x{8 * model.kda.head_dim}xbf16>" in module  # KDA's q tiles [B, T, H*K] on one shard


@pytest.mark.slow
@pytest.mark.parametrize("kernel,mesh", [
    ("pallas_segment", dict(fsdp=2, tensor=2, expert=2)),
    ("pallas_varlen", dict(fsdp=2, tensor=2, expert=2)),
    ("pallas_segment", dict(data=2, fsdp=4)),
    ("pallas_varlen", dict(data=2, fsdp=4)),
    ("pallas_segment", dict(fsdp=8)),
])
def test_flagship_step_exports_for_tpu_mesh_matrix(kernel, mesh):
    _, module, kernels = export_step(kernel, **mesh)
    check_kernels(module, kernels, kernel)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,strategy,mesh", [
    ("pallas_segment", "ring", dict(fsdp=2, expert=2, context=2)),
    ("pallas_varlen", "ring", dict(fsdp=2, expert=2, context=2)),
    ("pallas_segment", "all_gather", dict(fsdp=2, expert=2, context=2)),
    ("pallas_segment", "ulysses", dict(fsdp=2, expert=2, context=2)),
    ("pallas_segment", "usp", dict(fsdp=2, context=4, context_ulysses=2)),
])
def test_flagship_step_exports_for_tpu_with_context_parallelism(kernel, strategy, mesh):
    """Under `context` > 1 MLA takes the context-parallel path (no splash call); KDA's Pallas kernels run inside
    the KDA state passing's shard_map, mapped over the rest of the mesh."""
    rows = 4 if mesh.get("context") == 4 else 8
    _, module, kernels = export_step(kernel, rows=rows, context_strategy=strategy, **mesh)
    check_kernels(module, kernels, kernel, attention=False)
