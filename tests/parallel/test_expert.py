"""Expert parallelism by token all-to-all (parallel/expert.py, models/moe.py).

- The CPU exchange (`dense_ragged_all_to_all`) equals `jax.lax.ragged_all_to_all`'s documented semantics,
  written out as a loop over senders and slices in numpy.
- One MoE layer with its experts split over `expert` (and data / fsdp / tensor / context beside it) equals one
  device: outputs, load counts, z-loss and every gradient (fp32, rel 1e-5); the compiled program has
  all-to-alls, no all-gather of a whole [E, D, I] expert tensor and no all-reduce of an [N*k, D] buffer.
- Tokens dispatched as two slices side by side (`moe.expert_parallel_slices`) equal one device, with twice
  the exchanges.
- Capacity-sized receive buffers (`moe.expert_parallel_capacity`): both exchanges (`ragged`, on CPU its
  stand-in, and `dense`) equal one device for balanced and skewed routing; the skewed one takes the overflow
  rounds the counts call for, and the two exchanges agree with each other; exchange buffers that start as
  NaN (standing in for uninitialised memory) change nothing; with Megablox they reach the experts unmasked.
- Traced for TPU and GPU the same layer lowers with XLA's ragged all-to-all (jax.export).
- `unit_layout` pads each expert's sorted rows to whole exchange units, in order, within the static bound.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core
from jax.sharding import Mesh, PartitionSpec as P

from lingpack import backend
from lingpack.plan import hlo
from lingpack.errors import ConfigError
from lingpack.models.moe import MoEConfig
from lingpack.parallel import expert
from lingpack.parallel.layout import Layout, activation_layout
from lingpack.train.configs import ParallelConfig
from lingpack.train.sharding import make_mesh
from tests.models.test_moe import make_moe

CFG = MoEConfig(num_experts=8, top_k=2, expert_dim=8, n_groups=2, topk_groups=1, z_loss_coef=1e-3)
B, T, D = 8, 16, 16


def test_dense_exchange_equals_ragged_all_to_all_semantics():
    R, per_device, M, OUT = 4, 3, 10, 24        # 3 slices for each of 4 devices, 10 rows, 24 output rows
    rng = np.random.default_rng(0)
    sizes = np.zeros((R, R * per_device), np.int32)   # sizes[s, i]: rows sender s sends as slice i
    for s in range(R):
        cut = np.sort(rng.integers(0, M + 1, R * per_device - 1))
        sizes[s] = np.diff(np.concatenate([[0], cut, [M]]))
    sizes[1, :per_device] = 0                   # a sender with nothing for device 0
    in_off = np.cumsum(sizes, 1) - sizes        # each sender's slices back to back
    # receivers place senders in device order, slices in order: out_off[s, i] on device i // per_device
    out_off = np.zeros_like(sizes)
    for j in range(R):
        cols = slice(j * per_device, (j + 1) * per_device)
        flat = sizes[:, cols].reshape(-1)
        out_off[:, cols] = (np.cumsum(flat) - flat).reshape(R, per_device) + 2   # 2 rows of output left alone
    recv = np.stack([sizes[:, j * per_device:(j + 1) * per_device].reshape(-1) for j in range(R)])
    operand = rng.standard_normal((R, M, 3)).astype(np.float32)
    output = rng.standard_normal((R, OUT, 3)).astype(np.float32)
    want = output.copy()
    for s in range(R):
        for i in range(R * per_device):
            j, n = i // per_device, sizes[s, i]
            want[j, out_off[s, i]:out_off[s, i] + n] = operand[s, in_off[s, i]:in_off[s, i] + n]
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    run = jax.jit(jax.shard_map(
        lambda *a: expert.dense_ragged_all_to_all(*(x[0] for x in a), axis_name="ep")[None], mesh=mesh,
        in_specs=(P("ep"),) * 6, out_specs=P("ep"), check_vma=False))
    got = run(operand, output, in_off, sizes, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_unit_layout_pads_each_expert_to_whole_units():
    """Each expert's rows keep their sorted order and start on a unit boundary; every other place is padding
    (M), and the padded rows fit the static bound."""
    rng = np.random.default_rng(1)
    M, E, U = 45, 5, 4
    expert_M = rng.integers(0, E, M)
    expert_M[expert_M == 3] = 2                    # an expert with no rows takes no unit
    order = np.argsort(expert_M, kind="stable")
    inverse = np.empty(M, np.int32)
    inverse[order] = np.arange(M)
    sizes = np.bincount(expert_M, minlength=E)
    to_M, from_P, padded = (np.asarray(a) for a in expert.unit_layout(
        jnp.asarray(expert_M), jnp.asarray(inverse), jnp.asarray(sizes, jnp.int32), U))
    np.testing.assert_array_equal(padded, -(-sizes // U) * U)
    assert from_P.shape == (expert.padded_rows(M, E, U),) and padded.sum() <= from_P.shape[0]
    np.testing.assert_array_equal(from_P[to_M], np.arange(M))
    starts = np.cumsum(padded) - padded
    for e in range(E):
        rows = np.flatnonzero(expert_M == e)       # in their original (stable-sorted) order
        np.testing.assert_array_equal(to_M[rows], starts[e] + np.arange(len(rows)))
    assert np.all(from_P[np.setdiff1d(np.arange(from_P.shape[0]), to_M)] == M)


def _inputs(padding: int):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[:, T // 2:] = 2
    if padding:
        seg[:, T - padding:] = 0
    return x, w, jnp.asarray(seg)


def _layer_grads(cfg, parallel: ParallelConfig | None, padding=3, skew=None, run=True):
    """(gradients of params and x, (y, load counts, z-loss, tokens), the jitted function, its arguments);
    `run=False`: the function and its arguments only."""
    moe = make_moe(cfg, D)
    if skew is not None:   # one expert's bias so large that every token picks it
        moe.expert_bias[...] = moe.expert_bias[...].at[skew].set(10.0)
    graphdef, params = nnx.split(moe)
    x, w, seg = _inputs(padding)
    layout = None if parallel is None else Layout(make_mesh(parallel), parallel.rules)

    def loss(params, x, seg):
        with activation_layout(layout):
            y, aux = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(y * w) + aux["router_z_loss"], (y, aux["load_counts"], aux["router_z_loss"], aux["num_tokens"],
                                                       aux["dispatch_rounds"])

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    if layout is not None:   # parameters and rows placed as the train step places them
        specs = nnx.get_partition_spec(params)
        params = jax.device_put(params, jax.tree.map(lambda a, s: layout.sharding(tuple(s), a.shape), params, specs,
                                                     is_leaf=lambda s: isinstance(s, P)))
        rows = layout.sharding(("batch", "length"), (B, T))
        x, seg = jax.device_put(x, layout.sharding(("batch", "length", None), x.shape)), jax.device_put(seg, rows)
    if not run:
        return None, fn, (params, x, seg)
    return jax.device_get(fn(params, x, seg)), fn, (params, x, seg)


def _assert_equal(got, ref):
    (g_params, g_x), out = got
    (r_params, r_x), ref_out = ref
    for name, a, b in zip(("y", "load_counts", "router_z_loss", "num_tokens"), out, ref_out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(g_x, r_x, rtol=1e-5, atol=1e-6 * np.abs(r_x).max())
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(r_params), jax.tree.leaves(g_params)):
        err, scale = np.abs(g - r).max(), np.abs(r).max()
        assert err <= 1e-5 * scale, f"{jax.tree_util.keystr(path)}: max error {err:.3g} vs max |grad| {scale:.3g}"


def _expert_collectives(fn, args, cfg):
    """(all-to-all count, whole [E, D, I] / [E, I, D] all-gathers, all-reduces of [N*k, D] rows) in the HLO."""
    ops, _ = hlo.collective_ops(fn.lower(*args).compile().as_text())
    whole = {(cfg.num_experts, D, cfg.expert_dim), (cfg.num_experts, cfg.expert_dim, D)}
    gathers = [op.shape for op in ops if op.kind == "all-gather" and any(tuple(d) in whole for d in op.dims)]
    reduces = [op.shape for op in ops if op.kind == "all-reduce"
               and any(d and d[0] in (B * T * cfg.top_k, B * T) for d in op.dims)]
    return sum(op.kind == "all-to-all" for op in ops), gathers, reduces


@pytest.fixture(scope="module")
def one_device():
    return _layer_grads(CFG, None)[0]


def test_expert4_x_data2_equals_one_device(one_device):
    got, fn, args = _layer_grads(CFG, ParallelConfig(data=2, expert=4))
    _assert_equal(got, one_device)
    to_all, gathers, reduces = _expert_collectives(fn, args, CFG)
    assert to_all >= 4 and gathers == [] and reduces == [], (to_all, gathers, reduces)


def test_two_slices_side_by_side_equal_one_device(one_device):
    """`expert_parallel_slices=2`: two independent dispatches in one program, each with its own exchanges."""
    cfg = dataclasses.replace(CFG, expert_parallel_slices=2)
    got, fn, args = _layer_grads(cfg, ParallelConfig(data=2, expert=4))
    _assert_equal(got, one_device)
    one = _expert_collectives(*_layer_grads(CFG, ParallelConfig(data=2, expert=4), run=False)[1:], CFG)[0]
    assert _expert_collectives(fn, args, cfg)[0] == 2 * one, one


def test_rounds_must_divide_the_tokens():
    with pytest.raises(ConfigError, match="expert_parallel_chunks=3 times moe.expert_parallel_slices=1 must divide "
                                          "the 16 tokens"):
        _layer_grads(dataclasses.replace(CFG, expert_parallel_chunks=3), ParallelConfig(data=2, expert=4))


def test_ragged_all_to_all_on_accelerators():
    """Traced for TPU / GPU the layer's forward and backward exchange by XLA's ragged all-to-all; on CPU by
    all_to_all (XLA:CPU has no ragged one)."""
    _, fn, args = _layer_grads(CFG, ParallelConfig(data=2, expert=4), run=False)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args)
    waived = [jax.export.DisabledSafetyCheck.custom_call(expert.RAGGED_ALL_TO_ALL)]
    for platform in ("tpu", "cuda"):
        with backend.target(platform):
            text = jax.export.export(fn, platforms=[platform], disabled_checks=waived)(*specs).mlir_module()
        # forward: 2 in the first round, 2 in the overflow rounds' loop; backward: 2, and 3 in its loop (inputs
        # and cotangents travel apart there)
        assert text.count(f"custom_call @{expert.RAGGED_ALL_TO_ALL}") == 9, platform
    assert expert.RAGGED_ALL_TO_ALL not in fn.lower(*args).as_text()


def _skewed_rounds(cfg, tokens_per_device: int, R: int, exchange: str, unit: int) -> int:
    """The rounds a one-expert-per-device (E = R) dispatch takes when every token chose one expert: each
    sender sends that expert's device all its tokens, ceil(tokens / unit) units, and no device more."""
    assert cfg.num_experts == R
    M = expert.padded_rows(tokens_per_device * cfg.top_k, cfg.num_experts, unit)
    window = expert.buffer_rows(M, R, 1, cfg.top_k, cfg.expert_parallel_capacity, exchange, unit)[0]
    stream = -(-tokens_per_device // unit) * (R if exchange == "ragged" else 1)   # one receiver's, one pair's
    return -(-stream // window)


def _nan_scratch(shape, dtype, after):
    """`expert._scratch` with NaN where TPU's leaves whatever memory held (CPU's are zeros)."""
    return jnp.full(shape, jnp.nan, dtype)


@pytest.mark.parametrize("exchange", ["ragged", "dense"])
@pytest.mark.parametrize("skew, unit", [(None, expert.UNIT), (5, expert.UNIT), (5, 2)],
                         ids=["balanced", "skewed", "skewed-unit2"])
def test_capacity_buffers_equal_one_device(exchange, skew, unit, monkeypatch):
    """EP=8 with receive buffers of 1.25x the balanced load: outputs and gradients equal one device; all
    tokens sent to one expert take the rounds their units call for, every row still computed (in units of 2
    rows they overflow: 16 rows are one unit of 16, whose padding bound leaves these 16 tokens a device
    room). The exchange buffers start as NaN, where TPU's `lax.empty` leaves whatever memory held (CPU's is
    zeros): no row that was not received or written reaches an output or a gradient."""
    monkeypatch.setattr(expert, "_scratch", _nan_scratch)
    monkeypatch.setattr(expert, "UNIT", unit)
    cfg = dataclasses.replace(CFG, expert_parallel_exchange=exchange, expert_parallel_capacity=1.25)
    got, _, _ = _layer_grads(cfg, ParallelConfig(data=1, expert=8), padding=0, skew=skew)
    ref = _layer_grads(cfg, None, padding=0, skew=skew)[0]
    _assert_equal(got, ref)
    load_E, rounds = got[1][1], int(got[1][4])
    if skew is None:
        assert ref[1][4] == 1 and rounds >= 1
    else:
        assert load_E[skew] == B * T   # every token chose expert `skew`: device 5 receives 8x a balanced load
        assert rounds == _skewed_rounds(cfg, B * T // 8, 8, exchange, unit), rounds
        assert rounds > 1 or unit == expert.UNIT, rounds


def _selects_outside_kernels(jaxpr) -> list[tuple[int, ...]]:
    """The predicate shapes of every select in `jaxpr` and its sub-jaxprs, pallas_call bodies left out."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "select_n":
            found.append(tuple(eqn.invars[0].aval.shape))
        if eqn.primitive.name == "pallas_call":
            continue
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += _selects_outside_kernels(sub)
    return found


@pytest.mark.slow   # Megablox in interpret mode, 5-9 s a case; the masked path's NaN buffers: the capacity tests above
@pytest.mark.parametrize("skew", [None, 5], ids=["balanced", "skewed"])
def test_megablox_takes_the_receive_buffers_unmasked(skew, monkeypatch):
    """With Megablox (interpret mode here) the receive buffers' free rows reach the experts unmasked, NaN
    standing in for uninitialised memory, yet outputs and gradients equal one device (tiled) exactly as
    the masked path does: gmm keeps rows apart, tgmm selects the group rows."""
    monkeypatch.setattr(expert, "_scratch", _nan_scratch)
    cfg = dataclasses.replace(CFG, grouped_matmul="megablox")
    got, fn, args = _layer_grads(cfg, ParallelConfig(data=1, expert=8), padding=0, skew=skew)
    exchange = backend.expert_exchange(jax.devices()[:8])   # CPU: the dense one
    M = expert.padded_rows(B * T // 8 * CFG.top_k, CFG.num_experts, expert.UNIT)
    rows = expert.buffer_rows(M, 8, 1, CFG.top_k, CFG.expert_parallel_capacity, exchange, expert.UNIT)[1] * expert.UNIT
    # no mask over a receive buffer's rows outside Megablox's kernels (whose row tile, in interpret mode, can
    # be the buffer's size and masks rows by group inside)
    selects = _selects_outside_kernels(jax.make_jaxpr(fn)(*args).jaxpr)
    assert selects and not [s for s in selects if s[:1] == (rows,)], (rows, selects)
    _assert_equal(got, _layer_grads(dataclasses.replace(CFG, grouped_matmul="tiled"), None, padding=0, skew=skew)[0])


@pytest.mark.slow   # both exchanges equal one device in the default suite's skewed case already
def test_dense_exchange_equals_ragged(monkeypatch):
    """The two exchanges (dense all_to_all of capacity buffers; the ragged one's CPU stand-in) give the same
    outputs and gradients on skewed routing, with a capacity under the balanced load (more rounds still, in
    units of 2 rows: a unit of 16 holds all 16 tokens a device has here)."""
    monkeypatch.setattr(expert, "UNIT", 2)
    runs = [_layer_grads(dataclasses.replace(CFG, expert_parallel_exchange=exchange, expert_parallel_capacity=0.5),
                         ParallelConfig(data=2, expert=4), skew=3)[0] for exchange in ("ragged", "dense")]
    _assert_equal(*runs)
    assert runs[0][1][4] > 1 and runs[1][1][4] > 1


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="expert_parallel_capacity=0 must be > 0"):
        dataclasses.replace(CFG, expert_parallel_capacity=0)
    with pytest.raises(ValueError, match="expert_parallel_exchange must be one of"):
        dataclasses.replace(CFG, expert_parallel_exchange="sparse")


MATRIX = {
    "ep2-data4": (CFG, ParallelConfig(data=4, expert=2), {}),
    "ep8": (CFG, ParallelConfig(data=1, expert=8), {}),
    "ep4-fsdp2": (CFG, ParallelConfig(data=1, fsdp=2, expert=4), {}),
    "ep4-tensor2": (CFG, ParallelConfig(data=1, tensor=2, expert=4), {}),
    "ep4-context2": (CFG, ParallelConfig(data=1, expert=4, context=2), {}),
    "ep2-data2-context2": (CFG, ParallelConfig(data=2, expert=2, context=2), {}),
    "top1": (dataclasses.replace(CFG, top_k=1, n_groups=1), ParallelConfig(data=2, expert=4), {}),
    "top8-all-experts": (dataclasses.replace(CFG, top_k=8, n_groups=1), ParallelConfig(data=2, expert=4), {}),
    "group-limited": (dataclasses.replace(CFG, top_k=3, n_groups=4, topk_groups=2, norm_topk_prob=True),
                      ParallelConfig(data=2, expert=4), {}),
    "skewed": (CFG, ParallelConfig(data=1, expert=8), dict(skew=5)),
    "no-padding": (CFG, ParallelConfig(data=2, expert=4), dict(padding=0)),
    "mostly-padding": (CFG, ParallelConfig(data=2, expert=4), dict(padding=T - 1)),
    "gather-experts": (dataclasses.replace(CFG, expert_parallel="gather"), ParallelConfig(data=2, expert=4), {}),
    "4-rounds": (dataclasses.replace(CFG, expert_parallel_chunks=4), ParallelConfig(data=2, expert=4), {}),
    "2-rounds-skewed": (dataclasses.replace(CFG, expert_parallel_chunks=2), ParallelConfig(data=1, expert=8),
                        dict(skew=5)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_expert_parallel_matrix_equals_one_device(name):
    cfg, parallel, kw = MATRIX[name]
    got, fn, args = _layer_grads(cfg, parallel, **kw)
    _assert_equal(got, _layer_grads(cfg, None, **kw)[0])
    to_all, gathers, reduces = _expert_collectives(fn, args, cfg)
    if cfg.expert_parallel == "gather":   # the alternative: every expert tensor gathered, no token exchange
        assert to_all == 0 and len(gathers) == 3 and reduces == [], (to_all, gathers, reduces)
    else:
        assert to_all >= 4 and gathers == [] and reduces == [], (to_all, gathers, reduces)
    if "skew" in kw:   # EP=8, one expert each: every token of 8 devices lands on one (its receive buffer full)
        assert got[1][1][kw["skew"]] == np.sum(np.asarray(_inputs(kw.get("padding", 3))[2]) != 0)
