"""Pallas KDA kernels on a sharded mesh (8 fake CPU devices): `kernels/shard.py`'s `over_mesh` maps them over
rows and heads with no extra arguments.

Export for TPU lowers every Mosaic call inside a `shard_map` (XLA cannot partition one: the unwrapped
kernel fails to export, which the first test checks so that it can fail); interpret mode gives the
single-device numbers on a data x tensor mesh; the whole train step with `kernel=pallas_segment` and
`parallel=fsdp_tensor` exports for TPU.
"""
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack.kernels import shard
from lingpack.kernels.kda import api, pallas_segment
from tests.kernels.kda_cases import make_inputs, segments_from_lengths

IMPLS = ["pallas_segment", "pallas_varlen"]
ROOT = Path(__file__).resolve().parents[2]


def data_tensor_mesh(data=4, tensor=2):
    return Mesh(np.asarray(jax.devices()[:data * tensor]).reshape(data, tensor), ("data", "tensor"))


def sharded_shapes(mesh, B, T, H, K, V, dtype):
    tile = NamedSharding(mesh, P("data", None, "tensor", None))
    return [jax.ShapeDtypeStruct((B, T, H, K), dtype, sharding=tile)] * 2 + [
        jax.ShapeDtypeStruct((B, T, H, V), dtype, sharding=tile),
        jax.ShapeDtypeStruct((B, T, H, K), jnp.float32, sharding=tile),
        jax.ShapeDtypeStruct((B, T, H), jnp.float32, sharding=NamedSharding(mesh, P("data", None, "tensor"))),
        jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))]


def test_mapped_axes_follow_divisibility_and_the_row_and_head_axes():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2, 1), ("data", "fsdp", "tensor", "context"))
    x = lambda B, H: jax.ShapeDtypeStruct((B, 64, H, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
    assert shard.mapped_axes(x(4, 4))[1:] == (("data", "fsdp"), ("tensor",))
    assert shard.mapped_axes(x(2, 3))[1:] == (("data",), ())          # fsdp and tensor do not divide
    assert shard.mapped_axes(jnp.zeros((2, 64, 2, 8)))[0].empty      # no mesh: the kernel runs as is


@pytest.mark.parametrize("impl", IMPLS)
def test_fwd_and_grad_export_for_tpu_on_data_x_tensor_mesh(impl):
    """T=4096, H=8, K=V=128 bf16 over data=4 x tensor=2: each Mosaic call sees 1 row and 4 heads."""
    mesh = data_tensor_mesh()
    args = sharded_shapes(mesh, 4, 4096, 8, 128, 128, jnp.bfloat16)

    def forward(q, k, v, g, beta, seg, impl=impl):
        return api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, max_segs=16, output_final_state=True,
                             interpret=False)

    def loss(*a):
        o, s = forward(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    export = lambda f: jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    design = impl.removeprefix("pallas_")
    for module, kernels in ((export(forward), {"fwd"}), (export(jax.grad(loss, argnums=(0, 1, 2, 3, 4))),
                                                         {"fwd", "states", "bwd"})):
        assert {f"kda_{design}_{k}" for k in kernels} == set(re.findall(rf"kda_{design}_\w+", module))
        assert 'manual_axes={"data", "tensor"}' in module and "tensor<1x4096x4x128xbf16>" in module
    if impl == "pallas_segment":   # the same kernel without the wrapper cannot be partitioned by XLA
        api.IMPLS["pallas_unwrapped"] = pallas_segment.pallas_segment_kda
        api.CHUNKED.add("pallas_unwrapped")
        try:
            with pytest.raises(NotImplementedError, match="shard_map"):
                export(lambda *a: forward(*a, impl="pallas_unwrapped"))
        finally:
            del api.IMPLS["pallas_unwrapped"]
            api.CHUNKED.discard("pallas_unwrapped")


@pytest.mark.parametrize("impl", ["pallas_segment", pytest.param("pallas_varlen", marks=pytest.mark.slow)])
def test_interpret_numerics_on_sharded_mesh_equal_single_device(impl):
    """Fused gate (per-head A_log, dt_bias: their gradients sum over row shards), L2 norm, initial state, packed
    rows with padding: outputs and every gradient equal the unsharded numbers."""
    B, T, H, K = 4, 40, 2, 16
    rng = np.random.default_rng(0)
    q, k, v, g_raw, beta = make_inputs(rng, B, T, H, K, K)
    h0 = rng.standard_normal((B, H, K, K)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = rng.standard_normal(H * K).astype(np.float32)
    seg = segments_from_lengths([[17, 1, 16], [T], [3, 30], []], T)
    w_o = rng.standard_normal(v.shape).astype(np.float32)

    def loss(q, k, v, g, beta, h0, A_log, dt_bias, seg, impl=impl):
        o, s = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=16, max_segs=8,
                             initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                             dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, interpret=True)
        return jnp.sum(o * w_o) + jnp.sum(s * s), (o, s)

    args = (q, k, v, g_raw, beta, h0, A_log, dt_bias, seg)
    grad = jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True)
    # `chunked` (XLA, equal to the Pallas kernels on one device by test_kda_pallas) compiles in a fraction of the time
    (_, (o_ref, s_ref)), grads_ref = jax.jit(functools.partial(grad, impl="chunked"))(*args)
    mesh = data_tensor_mesh()
    specs = [P("data", None, "tensor")] * 5 + [P("data", "tensor"), P("tensor"), P("tensor"), P("data")]
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    (_, (o, s)), grads = jax.jit(grad)(*placed)
    assert tuple(o.sharding.spec)[:3] == ("data", None, "tensor")   # the output stays sharded like the inputs
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), atol=1e-5, rtol=1e-5)
    for name, got, want in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"], grads, grads_ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-4, err_msg=name)
        assert np.abs(np.asarray(want)).max() > 0, name


def test_train_step_with_pallas_segment_exports_for_tpu_with_fsdp_tensor():
    """The jitted train step (forward, backward, AdamW) of a small Ling3 with kernel=pallas_segment under
    conf/parallel/fsdp_tensor.yaml (data 2 x fsdp 2 x tensor 2), traced as a TPU run traces it (the backend
    target; `kernel.interpret` left unset): every KDA kernel lowers through Mosaic inside a shard_map."""
    from lingpack.models.kda import KDAConfig
    from lingpack.models.ling3 import Ling3Config
    from lingpack.models.mla import MLAConfig
    from lingpack.models.moe import MoEConfig
    from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
    from lingpack.train.program import TrainProgram

    kernel = yaml.safe_load((ROOT / "conf/kernel/pallas_segment.yaml").read_text())
    # 5 layers: layer 0 unrolled, 1-4 in the layer scan (the kernels also lower inside its loop and cond)
    model = Ling3Config(vocab_size=258, emb_dim=32, num_layers=5, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                        kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16, kda_impl=kernel["name"],
                        mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                      v_head_dim=16),
                        moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, bias_update_rate=1e-2))
    parallel = ParallelConfig(**yaml.safe_load((ROOT / "conf/parallel/fsdp_tensor.yaml").read_text()))
    program = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=3), parallel, TrainConfig(micro_batches=2),
                                 rows=16, seq_length=64)
    module = program.export("tpu").mlir_module()
    assert model.scanned_layers() == range(1, 5) and "stablehlo.case" in module  # the layer scan's cond on the mixer
    assert set(re.findall(r"kda_segment_\w+", module)) == {"kda_segment_fwd", "kda_segment_states", "kda_segment_bwd"}
    assert set(re.findall(r"manual_axes=\{[^}]*\}", module)) == {
        'manual_axes={"data", "fsdp", "tensor", "expert", "context"}'}
