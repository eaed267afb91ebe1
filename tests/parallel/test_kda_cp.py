"""KDA context parallelism (parallel/kda_cp.py) == one device, on 8 fake CPU devices (mesh data=2 x context=4).

Oracles: single-device `chunk_kda` (outputs, final states, every gradient) and FLA's naive recurrence run
per document. Layouts put document boundaries inside blocks, exactly on block boundaries, one document
across every block, many short ones, padding tails and an all-padding row; contiguous and zigzag.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lingpack.kernels.kda import api
from lingpack.parallel import kda_cp, reorder
from tests.kernels.kda_cases import fla_naive_module, make_inputs, per_document_oracle, segments_from_lengths

N, B, T, H, K, V, CHUNK = 4, 2, 128, 2, 16, 8, 16
GRAD_ARGS = (0, 1, 2, 3, 4, 6)  # q, k, v, g, beta, initial_state
# compiling a gradient costs ~5 s of CPU: the default suite runs zigzag (the harder layout), `slow` adds contiguous
LAYOUT_MODES = [pytest.param(False, id="contiguous", marks=pytest.mark.slow), pytest.param(True, id="zigzag")]
LAYOUTS = {
    "crossing_and_mid_block": [[20, 50, 3, 1, 40], [100]],     # row 1: one document over 4 blocks + padding
    "on_block_boundaries": [[32, 32, 16, 16, 32], [64, 48]],   # starts exactly at (zigzag) block starts
    "many_short_and_empty_row": [[5] * 20 + [1, 2, 3], []],
    "one_document_per_row": [[T], [T - 1]],
}


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:2 * N]).reshape(2, N), ("data", "context"))


def inputs(layout, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    return [q, k, v, g, beta, segments_from_lengths(LAYOUTS[layout], T), h0]


def to_layout(xs, load_balance):
    """Zigzag-reorder the [B, T] leading arrays (q, k, v, g, beta, seg) for the CP run."""
    if not load_balance:
        return xs
    d = reorder.reorder_batch(dict(enumerate(xs[:6])), N)
    return [d[i] for i in range(6)] + xs[6:]


def from_layout(x, load_balance):
    return reorder.restore_order(np.asarray(x), N) if load_balance else np.asarray(x)


@functools.lru_cache(maxsize=None)
def cp_fns(mesh, load_balance, gate=False):
    def run(q, k, v, g, beta, seg, h0, *gate_params):
        kw = gate_kwargs(*gate_params) if gate else {}
        return kda_cp.chunk_kda_context_parallel(q, k, v, g, beta, segment_ids=seg, mesh=mesh, batch_axes=("data",),
                                                 load_balance=load_balance, initial_state=h0,
                                                 output_final_state=True, chunk_size=CHUNK, **kw)
    return run


def gate_kwargs(A_log, dt_bias):
    return dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)


@functools.lru_cache(maxsize=None)
def single_fn(gate=False):
    def run(q, k, v, g, beta, seg, h0, *gate_params):
        kw = gate_kwargs(*gate_params) if gate else {}
        return api.chunk_kda(q, k, v, g, beta, segment_ids=seg, chunk_size=CHUNK, initial_state=h0,
                             output_final_state=True, **kw)
    return run


@functools.lru_cache(maxsize=None)
def grads_of(run, argnums):
    def loss(*args):
        *xs, w_o, w_s = args
        o, s = run(*xs)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)
    return jax.jit(jax.grad(loss, argnums=argnums))


def assert_rel(actual, expected, name, rel=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err, scale = np.abs(actual - expected).max(), np.abs(expected).max()
    assert err <= rel * max(scale, 1e-30), f"{name}: max error {err:.3g} vs max |ref| {scale:.3g}"


def assert_rel_per_shard(actual, expected, name, load_balance):
    """rel <= 1e-5 on each device's own tokens (each measured against that shard's scale)."""
    actual, expected = to_layout_one(actual, load_balance), to_layout_one(expected, load_balance)
    for r, (a, e) in enumerate(zip(np.split(actual, N, axis=1), np.split(expected, N, axis=1))):
        if np.abs(e).max() > 0:
            assert_rel(a, e, f"{name} on context shard {r}")
        else:
            assert not np.abs(a).any(), f"{name} on context shard {r} must be 0"


def to_layout_one(x, load_balance):
    """One [B, T, ...] array of the original token order, in the CP run's order."""
    x = np.asarray(x)
    return np.take(x, reorder.zigzag_permutation(T, N), axis=1) if load_balance else x


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_outputs_and_final_states_match_one_device_and_fla(mesh, layout, load_balance):
    xs = inputs(layout)
    o_ref, s_ref = jax.jit(single_fn())(*xs)
    o, s = jax.jit(cp_fns(mesh, load_balance))(*to_layout(xs, load_balance))
    o = from_layout(o, load_balance)
    assert_rel_per_shard(o, o_ref, "o", load_balance)
    assert_rel(s, s_ref, "final state")
    if layout == "crossing_and_mid_block":
        o_fla, s_fla = per_document_oracle(fla_naive_module(), *xs)
        np.testing.assert_allclose(o, o_fla, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(s), s_fla, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("load_balance", LAYOUT_MODES)
@pytest.mark.parametrize("layout", ["crossing_and_mid_block", "on_block_boundaries", "many_short_and_empty_row"])
def test_gradients_match_one_device(mesh, layout, load_balance):
    xs = inputs(layout)
    rng = np.random.default_rng(1)
    w_o, w_s = rng.standard_normal((B, T, H, V)).astype(np.float32), rng.standard_normal((B, H, K, V)).astype(np.float32)
    ref = grads_of(single_fn(), GRAD_ARGS)(*xs, w_o, w_s)
    got = grads_of(cp_fns(mesh, load_balance), GRAD_ARGS)(*to_layout(xs, load_balance), to_layout_one(w_o, load_balance),
                                                        w_s)
    for name, a, e in zip(["dq", "dk", "dv", "dg", "dbeta"], got[:5], ref[:5]):
        assert_rel_per_shard(from_layout(a, load_balance), e, name, load_balance)
    assert_rel(got[5], ref[5], "dinitial_state")


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
def test_gate_in_kernel_gradients_per_head(mesh, load_balance):
    """Ling3's path: raw gate + lower-bound gate + L2 norm in the kernel; A_log and dt_bias differ per head."""
    xs = inputs("crossing_and_mid_block", seed=2)
    rng = np.random.default_rng(3)
    xs[3] = rng.standard_normal((B, T, H, K)).astype(np.float32)  # raw gate pre-activation
    A_log = np.log(np.array([1.5, 12.0], np.float32))
    dt_bias = rng.standard_normal(H * K).astype(np.float32)
    w_o, w_s = rng.standard_normal((B, T, H, V)).astype(np.float32), rng.standard_normal((B, H, K, V)).astype(np.float32)
    argnums = (0, 1, 2, 3, 4, 6, 7, 8)
    ref = grads_of(single_fn(gate=True), argnums)(*xs, A_log, dt_bias, w_o, w_s)
    got = grads_of(cp_fns(mesh, load_balance, gate=True), argnums)(*to_layout(xs, load_balance), A_log, dt_bias,
                                                                   to_layout_one(w_o, load_balance), w_s)
    for name, a, e in zip(["dq", "dk", "dv", "dg_raw", "dbeta"], got[:5], ref[:5]):
        assert_rel_per_shard(from_layout(a, load_balance), e, name, load_balance)
    for name, a, e in zip(["dinitial_state", "dA_log", "ddt_bias"], got[5:], ref[5:]):
        assert_rel(a, e, name)
    assert np.abs(ref[6][0] - ref[6][1]) > 0, "heads must get different A_log gradients"


@pytest.mark.parametrize("load_balance", LAYOUT_MODES)
def test_perturbing_one_document_leaves_the_others_bit_identical(mesh, load_balance):
    xs = inputs("crossing_and_mid_block", seed=4)
    seg = xs[5]
    doc = (seg == 2)  # 50 tokens from 20 to 70: crosses blocks in both layouts
    rng = np.random.default_rng(5)
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    w_s = rng.standard_normal((B, H, K, V)).astype(np.float32)
    perturbed = [x.copy() for x in xs]
    for i in range(5):
        perturbed[i][doc] += rng.standard_normal(perturbed[i][doc].shape).astype(np.float32) * 0.3
    perturbed[4] = np.clip(perturbed[4], 0.01, 0.99)
    perturbed[3] = np.minimum(perturbed[3], 0.0)
    run = jax.jit(cp_fns(mesh, load_balance))
    grads = grads_of(cp_fns(mesh, load_balance), GRAD_ARGS)
    others = ~doc & (seg > 0)
    results = []
    for x in (xs, perturbed):
        lay = to_layout(x, load_balance)
        o, _ = run(*lay)
        g = grads(*lay, to_layout_one(w_o, load_balance), w_s)
        results.append([from_layout(o, load_balance)] + [from_layout(d, load_balance) for d in g[:5]])
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], *results):
        assert np.array_equal(a[others], b[others]), f"{name} of other documents changed"
        assert not np.array_equal(a[doc], b[doc]), f"{name} of the perturbed document must change"


def test_rows_sharing_a_device_keep_their_own_blocks():
    """context=4 only: every device holds both rows, two zigzag blocks of each, run as four kernel rows."""
    mesh = Mesh(np.array(jax.devices()[:N]), ("context",))
    xs = inputs("crossing_and_mid_block", seed=3)
    o_ref, s_ref = jax.jit(single_fn())(*xs)
    run = lambda q, k, v, g, beta, seg, h0: kda_cp.chunk_kda_context_parallel(
        q, k, v, g, beta, segment_ids=seg, mesh=mesh, load_balance=True, initial_state=h0, output_final_state=True,
        chunk_size=CHUNK)
    o, s = jax.jit(run)(*to_layout(xs, True))
    assert_rel_per_shard(from_layout(o, True), o_ref, "o", True)
    assert_rel(s, s_ref, "final state")


def test_bad_length_names_the_fix(mesh):
    xs = inputs("one_document_per_row")
    with pytest.raises(ValueError, match="2 x context=4"):
        kda_cp.chunk_kda_context_parallel(*[x[:, :100] for x in xs[:5]], segment_ids=xs[5][:, :100], mesh=mesh,
                                          batch_axes=("data",), load_balance=True)


@pytest.mark.slow
def test_heads_split_over_tensor_with_gate_parameters():
    """context=4 x tensor=2: each device runs one head; A_log / dt_bias are split with the heads."""
    mesh = Mesh(np.array(jax.devices()[:2 * N]).reshape(N, 2), ("context", "tensor"))
    xs = inputs("crossing_and_mid_block", seed=6)
    rng = np.random.default_rng(7)
    xs[3] = rng.standard_normal((B, T, H, K)).astype(np.float32)
    A_log, dt_bias = np.log(np.array([2.0, 9.0], np.float32)), rng.standard_normal(H * K).astype(np.float32)
    w_o, w_s = rng.standard_normal((B, T, H, V)).astype(np.float32), rng.standard_normal((B, H, K, V)).astype(np.float32)

    def run(q, k, v, g, beta, seg, h0, A_log, dt_bias):
        return kda_cp.chunk_kda_context_parallel(q, k, v, g, beta, segment_ids=seg, mesh=mesh, head_axes=("tensor",),
                                                 load_balance=True, initial_state=h0, output_final_state=True,
                                                 chunk_size=CHUNK, **gate_kwargs(A_log, dt_bias))
    argnums = (0, 3, 7, 8)
    ref = grads_of(single_fn(gate=True), argnums)(*xs, A_log, dt_bias, w_o, w_s)
    got = grads_of(run, argnums)(*to_layout(xs, True), A_log, dt_bias, to_layout_one(w_o, True), w_s)
    assert_rel(from_layout(got[0], True), ref[0], "dq")
    assert_rel(from_layout(got[1], True), ref[1], "dg_raw")
    assert_rel(got[2], ref[2], "dA_log")
    assert_rel(got[3], ref[3], "ddt_bias")
