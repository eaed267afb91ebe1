"""The expert exchange each TPU generation gets, compiled by XLA:TPU (libtpu, from this CPU host).

- `backend.expert_exchange` reads the chip from the mesh's devices: ragged on v5p and on v5e slices of up to
  16 chips, dense on a 32-chip v5e slice, dense on CPU.
- The dispatch (forward + backward, EP=8) compiles for 32 v5e chips with the exchange the chip gets (dense:
  an all-to-all, no ragged one) and for 8 v5p chips with the ragged one, whose rows travel in units of 16 in
  the kernels' tiled layout (no relayout copy); the ragged exchange forced onto the v5e slice is refused by
  XLA:TPU (the fact the choice rests on: if a libtpu lifts it, this test says so).
  Slow: the same for one whole MoE layer; single rows in (2, 128) tiles with copies around the exchange, and
  v5e refusing ragged_dot's weight gradient on unit-shaped buffers (why ragged_dot's rows travel one by one).
- A rematerialised layer scan of dispatches allocates its exchange buffers in each layer: no copy of them
  (a bare `lax.empty`, hoisted out of the scan, is copied in every layer).
"""

from __future__ import annotations

import os

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")   # quiets libtpu's host probe
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu

import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from lingpack import backend  # noqa: E402
from lingpack.plan import chips  # noqa: E402
from lingpack.models.moe import MoE, MoEConfig  # noqa: E402
from lingpack.parallel import expert  # noqa: E402
from lingpack.parallel.layout import Layout, activation_layout  # noqa: E402
from lingpack.train.configs import ParallelConfig  # noqa: E402
from lingpack.train.sharding import make_mesh  # noqa: E402

# the grouped matmul is XLA:TPU's ragged_dot: the exchange is under test, and Megablox's eight Mosaic kernels
# would take most of the compile
CFG = MoEConfig(num_experts=8, top_k=2, expert_dim=128, n_groups=1, num_shared_experts=0, grouped_matmul="ragged_dot")
D, T = 128, 256


@functools.cache
def _devices(topology: str):
    """The devices of a TPU slice named like "v5e:4x8" (lingpack.plan.chips.tpu_devices)."""
    generation, shape = topology.split(":")
    return tuple(chips.tpu_devices(chips.chip(generation), math.prod(map(int, shape.split("x"))), shape))


def _compile(cfg: MoEConfig, parallel: ParallelConfig, devices) -> str:
    """The compiled HLO text of one MoE layer's forward + backward on `devices` (XLA:TPU)."""
    layout = Layout(make_mesh(parallel, devices), parallel.rules)
    # the suite's "highest" precision asks Mosaic (Megablox, XLA:TPU's ragged_dot) for fp32 passes on bf16
    # operands, which it refuses
    with backend.target("tpu"), jax.default_matmul_precision("default"):
        moe = nnx.eval_shape(lambda: MoE(cfg, D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(moe)
        place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=layout.sharding(tuple(s), a.shape))
        params = jax.tree.map(place, params, nnx.get_partition_spec(params), is_leaf=lambda s: isinstance(s, P))
        B = layout.mesh.size
        x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16, sharding=layout.sharding(("batch", "length", None), (B, T, D)))

        def loss(params, x):
            with activation_layout(layout):
                y, aux = nnx.merge(graphdef, params)(x)
            return jnp.sum(y.astype(jnp.float32)) + aux["router_z_loss"]

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()


def test_exchange_follows_the_chip():
    with backend.target("tpu"):
        got = {t: backend.expert_exchange(_devices(t)) for t in ("v5p:2x2x2", "v5e:2x4", "v5e:4x8")}
    assert got == {"v5p:2x2x2": "ragged", "v5e:2x4": "ragged", "v5e:4x8": "dense"}, got
    assert _devices("v5e:4x8")[0].device_kind in backend.RAGGED_ALL_TO_ALL_MAX_CHIPS
    assert backend.expert_exchange(jax.devices()) == "dense"   # CPU: no ragged all-to-all


def _compile_dispatch(devices, exchange: str, unit: int = expert.UNIT, layers: int = 0) -> str:
    """Compiled HLO of `expert.dispatch`'s forward + backward over all `devices` as the EP group (XLA:TPU),
    data x 8 (data over the rest): 64 tokens per device, top-2 of 8 experts, one per device, rows in units of
    `unit`. `layers` > 0: a rematerialised scan of that many dispatches, each with its own weights, as the
    model's layer stack runs them."""
    mesh = Mesh(np.array(devices).reshape(-1, 8), ("data", "ep"))
    rows, E, width = 64 * 2, 8, 128
    w_spec, w_shape = (P(None, "ep"), (layers, E, width, width)) if layers else (P("ep"), (E, width, width))

    def experts(w, x, sizes):
        return jax.lax.ragged_dot(x, w, sizes)

    def one(x, w, sizes):
        return expert.dispatch(x, sizes, experts, w, axis_name="ep", top_k=2, unit=unit, exchange=exchange)

    def loss(x, w, sizes):
        def local(x, w, sizes):
            if layers:
                body = jax.checkpoint(lambda x, w_l: (x + one(x, w_l, sizes[0])[0], None),
                                      policy=jax.checkpoint_policies.nothing_saveable)
                y, rounds = jax.lax.scan(body, x, w)[0], 0
            else:
                y, rounds = one(x, w, sizes[0])
            return jnp.sum(y.astype(jnp.float32))[None] + rounds
        per_device = jax.shard_map(local, mesh=mesh, in_specs=(P(("data", "ep")), w_spec, P(("data", "ep"))),
                                   out_specs=P(("data", "ep")), check_vma=False)(x, w, sizes)
        return jnp.sum(per_device)

    spec = lambda shape, dtype, s: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))
    n = len(devices)
    with backend.target("tpu"), jax.default_matmul_precision("default"):   # as in _compile
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
            spec((n * rows, width), jnp.bfloat16, P(("data", "ep"))),
            spec(w_shape, jnp.bfloat16, w_spec),
            spec((n, E), jnp.int32, P(("data", "ep")))).compile().as_text()


def test_v5e_dispatch_compiles_dense_and_refuses_ragged():
    v5e = _devices("v5e:4x8")
    with backend.target("tpu"):
        exchange = backend.expert_exchange(v5e)
    text = _compile_dispatch(v5e, exchange, unit=1)   # ragged_dot's experts: rows one by one (models/moe.py)
    assert " all-to-all(" in text and "ragged-all-to-all" not in text
    with pytest.raises(Exception, match="Ragged all-to-all is currently not supported in limited ICI routing"):
        _compile_dispatch(v5e, "ragged", unit=1)


@pytest.mark.slow
def test_v5e_refuses_ragged_dot_weight_gradients_on_units():
    """Why the MoE sends rows one by one when XLA:TPU's ragged_dot runs the experts: on v5e its weight
    gradient does not compile on unit-shaped buffers (if a libtpu fixes it, this test says so)."""
    with pytest.raises(Exception, match="mask_aggregator"):
        _compile_dispatch(_devices("v5e:2x4"), "ragged")


def _exchanged(text: str) -> tuple[list[str], list[str]]:
    """(the shapes with layouts the ragged all-to-alls move, those of the bf16 copies) in compiled HLO."""
    return re.findall(r"= (\S+) ragged-all-to-all\(", text), re.findall(r"= (bf16\S+) copy\(", text)


def test_v5p_dispatch_exchanges_units_in_the_kernels_layout():
    """Rows in units of 16 travel in the (8, 128)(2, 1) tiles every kernel reads: no relayout copy of an
    exchange buffer on either side."""
    moved, copies = _exchanged(_compile_dispatch(_devices("v5p:2x2x2"), "ragged"))
    tiled = r"bf16\[\d+,16,128\]\{2,1,0:T\(8,128\)\(2,1\)\}"
    assert len(moved) == 6 and all(re.fullmatch(tiled, m) for m in moved), moved
    assert not [c for c in copies if "T(2,128)" in c or re.match(r"bf16\[\d+,(1|16),", c)], copies


@pytest.mark.slow
def test_v5p_dispatch_of_single_rows_copies_around_the_exchange():
    """The fact the units rest on: rows exchanged one by one are row-contiguous (2, 128) tiles, and XLA:TPU
    copies every exchange buffer to and from the kernels' tiles (if a libtpu stops doing so, this says so)."""
    moved, copies = _exchanged(_compile_dispatch(_devices("v5p:2x2x2"), "ragged", unit=1))
    assert moved and all("T(2,128)" in m for m in moved), moved
    assert len([c for c in copies if re.match(r"bf16\[(128|160),1,128\]\{2,0,1:T\(8,128\)", c)]) >= 4, copies


@pytest.mark.slow
def test_v5e_compiles_the_dense_exchange_and_refuses_the_ragged_one():
    v5e = _devices("v5e:4x8")
    text = _compile(CFG, ParallelConfig(data=4, expert=8), v5e)
    assert " all-to-all(" in text and "ragged-all-to-all" not in text
    with pytest.raises(Exception, match="Ragged all-to-all is currently not supported in limited ICI routing"):
        _compile(dataclasses.replace(CFG, expert_parallel_exchange="ragged"), ParallelConfig(data=4, expert=8), v5e)


@pytest.mark.slow
def test_v5p_compiles_the_ragged_exchange():
    text = _compile(CFG, ParallelConfig(data=1, expert=8), _devices("v5p:2x2x2"))
    assert "ragged-all-to-all" in text


@pytest.mark.parametrize("scratch", ["per_layer", "lax_empty"])
def test_v5p_layer_scan_allocates_each_exchange_buffer_in_its_layer(scratch, monkeypatch):
    """The exchanges write into buffers allocated in their own layer: no copy of an exchange buffer. The fact
    it rests on: `lax.empty`, which depends on nothing, is hoisted out of the layer scan, and XLA:TPU copies the
    one hoisted buffer in every layer before the exchange writes into it (if that changes, this says so)."""
    if scratch == "lax_empty":
        monkeypatch.setattr(expert, "_scratch", lambda shape, dtype, after: jax.lax.empty(shape, dtype))
    moved, copies = _exchanged(_compile_dispatch(_devices("v5p:2x2x2"), "ragged", layers=3))
    assert moved, "no ragged all-to-all compiled"
    units = [c for c in copies if re.match(r"bf16\[\d+,16,128\]", c)]
    assert (not units) if scratch == "per_layer" else units, copies
