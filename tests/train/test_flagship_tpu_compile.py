"""The flagship train step compiled by XLA:TPU (libtpu on this host, no TPU attached), Mosaic kernels included.

tests/train/test_flagship_export.py exports the step (lowering only); here XLA:TPU compiles it for a TPU
topology, so Mosaic compiles every kernel inside it and `memory_analysis()` is what a TPU would allocate.
The whole flagship on 64 v5p chips is slow (its XLA:TPU compile takes 6-8 min on a 2-core host: experiments/plan).
"""
import jax
import pytest

from lingpack import backend
from lingpack.kernels import mosaic
from lingpack.plan import chips, cost, measure
from lingpack.train import flops
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram
from tests.train.test_flagship_export import KDA, SPLASH, T, flagship


def compile_flagship(generation: str, count: int, *, rows: int, num_layers=None, **mesh):
    devices = chips.tpu_devices(chips.chip(generation), count)   # the standard slice of `count` chips
    parallel = ParallelConfig(**{"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1, **mesh})
    # default precision, as a run compiles it (conftest asks "highest" for CPU numerics; Mosaic refuses an fp32
    # contraction of bf16 operands)
    with backend.target("tpu"), jax.default_matmul_precision("default"):
        program = TrainProgram.build(flagship("pallas_segment", num_layers), LossConfig(),
                                     OptimConfig(decay_steps=1000), parallel, TrainConfig(), rows=rows,
                                     seq_length=T, devices=devices)
        return program.lower().compile(), parallel, devices


def check_compiled(compiled, generation: str) -> None:
    """Every KDA and splash kernel compiled by Mosaic within its VMEM; the step fits the chip's HBM."""
    wanted = KDA["pallas_segment"] | SPLASH   # XLA:TPU's own ragged_dot custom calls are not checked here
    kernels = [k for k in mosaic.kernels(compiled.as_text()) if any(w in k.name for w in wanted)]
    names = {k.name for k in kernels}
    for want in wanted:
        assert any(want in n for n in names), (want, sorted(names))
    capacity = mosaic.VMEM_BYTES[generation]
    assert all(0 < k.vmem_used <= (k.vmem_limit or capacity) <= capacity for k in kernels)
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert 0 < peak <= chips.chip(generation).hbm_bytes, peak / 2**30


@pytest.mark.slow
def test_whole_flagship_step_compiles_for_64_v5p_chips():
    """conf/model/ling3_flagship.yaml as configured (24 layers, kernel=pallas_segment, splash), T=8192, 64
    rows on fsdp=8 x expert=8 of a v5p:4x4x4 slice: it compiles, fits, and its FLOPs are within 10% of the model's."""
    compiled, parallel, devices = compile_flagship("v5p", 64, rows=64, fsdp=8, expert=8)
    check_compiled(compiled, "v5p")
    # its FLOPs as the planner costs them (loop trips and the mixer cond's layer shares in, Megablox at the rows
    # it runs) within 10% of train/flops.py's count plus the forward that remat and the chunked heads recompute
    model, tokens = flagship("pallas_segment"), 64 * T / 64
    planned = cost.program_cost(compiled.as_text(), chips.chip("v5p"), branch_weights=measure.branch_weights(model),
                                kernel_share=measure.megablox_share(model, parallel, tokens, devices))
    analytic = (flops.flops_per_token(model, T) * tokens
                + measure.remat_flops(model, T, tokens, model.moe.expert_parallel_chunks))
    assert planned["flops"] == pytest.approx(analytic, rel=0.10), planned["flops"] / analytic


GENERATIONS = ("v5e", "v5p", "v6e")   # 8 chips each: v5e / v6e 2x4, v5p 2x2x2


@pytest.mark.slow
@pytest.mark.parametrize("generation", GENERATIONS)
def test_two_layer_flagship_step_compiles_for_8_chips(generation):
    """The flagship's first two layers (KDA + dense, KDA + MoE) and its MTP layer (MLA + MoE: splash), T=8192,
    8 rows on fsdp=8 (no expert parallelism: v5e's XLA:TPU refuses the ragged all-to-all). On v5p: 389 CPU s of compile on the 2-core host,
    10.9 GiB per device, so not in the default suite."""
    compiled, _, _ = compile_flagship(generation, 8, rows=8, num_layers=2, fsdp=8)
    check_compiled(compiled, generation)
