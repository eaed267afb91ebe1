"""Short-conv halo and MTP roll under context parallelism (parallel/halo.py) == one device.

Mesh data=2 x context=4; rows of 64 tokens: contiguous blocks of 16, zigzag chunks of 8, so the conv's
3-token halo and documents of 1-2 tokens meet block boundaries in every way.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from lingpack.models.layers import segment_causal_conv
from lingpack.models.mtp import mtp_targets, roll_and_mask_by_segment
from lingpack.parallel import halo, reorder
from tests.kernels.kda_cases import segments_from_lengths

N, B, T, C, WIDTH = 4, 2, 64, 3, 4
ROWS = {
    "mixed": [[3, 6, 1, 1, 2, 3, 8, 9, 20], [8, 8, 16, 1, 2, 19]],   # boundaries at, before and after block edges
    "one_document_and_padding": [[64], [33]],
    "length_one_documents": [[1] * 30 + [17], [2] * 32],
}


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:2 * N]).reshape(2, N), ("data", "context"))


def layout(x, load_balance):
    return np.take(np.asarray(x), reorder.zigzag_permutation(T, N), axis=1) if load_balance else np.asarray(x)


def restore(x, load_balance):
    return reorder.restore_order(np.asarray(x), N) if load_balance else np.asarray(x)


def sharded(mesh, fn, x_ndim, *, side, width, load_balance, params=()):
    """fn(x, seg, *params) run per context block with neighbours, on global arrays (rows over `data`)."""
    x_spec = P("data", "context", *([None] * (x_ndim - 2)))

    def local(x, seg, *params):
        return halo.apply_with_neighbours(lambda a, s: fn(a, s, *params), x, seg, side=side, width=width,
                                          axis_name="context", load_balance=load_balance)
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P("data", "context")) + (P(),) * len(params),
                         out_specs=x_spec)


def conv(x, seg, kernel):
    return segment_causal_conv(x, kernel, seg)


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_short_conv_halo_matches_one_device(mesh, rows, load_balance):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    kernel = rng.standard_normal((WIDTH, C)).astype(np.float32)
    w = rng.standard_normal((B, T, C)).astype(np.float32)
    seg = segments_from_lengths(ROWS[rows], T)
    cp = sharded(mesh, conv, 3, side="previous", width=WIDTH - 1, load_balance=load_balance, params=(kernel,))
    y = restore(jax.jit(cp)(layout(x, load_balance), layout(seg, load_balance), kernel), load_balance)
    np.testing.assert_allclose(y, conv(x, seg, kernel), rtol=1e-6, atol=1e-6)

    ref = jax.grad(lambda x, k: jnp.sum(conv(x, seg, k) * w), argnums=(0, 1))(x, kernel)
    got = jax.jit(jax.grad(lambda x, k: jnp.sum(cp(x, layout(seg, load_balance), k) * layout(w, load_balance)),
                           argnums=(0, 1)))(layout(x, load_balance), kernel)
    np.testing.assert_allclose(restore(got[0], load_balance), ref[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_mtp_roll_matches_one_device(mesh, rows, load_balance):
    rng = np.random.default_rng(1)
    seg = segments_from_lengths(ROWS[rows], T)
    emb = rng.standard_normal((B, T, C)).astype(np.float32)
    tokens = rng.integers(1, 100, (B, T)).astype(np.int32)
    roll = lambda x, s: roll_and_mask_by_segment(x, s)
    for x in (emb, tokens):
        cp = sharded(mesh, roll, x.ndim, side="next", width=1, load_balance=load_balance)
        got = restore(jax.jit(cp)(layout(x, load_balance), layout(seg, load_balance)), load_balance)
        np.testing.assert_array_equal(got, roll_and_mask_by_segment(x, seg))
    # MTP depth 2's targets and mask (three rolls) and the gradient through the embedding roll
    mask = (seg > 0).astype(np.int32)
    cp = sharded(mesh, roll, 2, side="next", width=1, load_balance=load_balance)
    tgt, m = tokens, mask
    for _ in range(3):
        tgt, m = (cp(layout(a, load_balance), layout(seg, load_balance)) for a in (tgt, m))
        tgt, m = restore(tgt, load_balance), restore(m, load_balance)
    ref_tgt, ref_mask = mtp_targets(tokens, mask, 2, seg)
    np.testing.assert_array_equal(tgt, ref_tgt)
    np.testing.assert_array_equal(m, ref_mask)
    w = rng.standard_normal((B, T, C)).astype(np.float32)
    cp = sharded(mesh, roll, 3, side="next", width=1, load_balance=load_balance)
    got = jax.grad(lambda e: jnp.sum(cp(e, layout(seg, load_balance)) * layout(w, load_balance)))(layout(emb, load_balance))
    ref = jax.grad(lambda e: jnp.sum(roll_and_mask_by_segment(e, seg) * w))(emb)
    np.testing.assert_array_equal(restore(got, load_balance), ref)


def test_blocks_shorter_than_the_halo_name_the_fix(mesh):
    x, seg = np.zeros((B, 8, C), np.float32), np.ones((B, 8), np.int32)
    cp = sharded(mesh, conv, 3, side="previous", width=3, load_balance=True, params=(np.zeros((4, C), np.float32),))
    with pytest.raises(ValueError, match="neighbour tokens"):
        cp(x, seg, np.zeros((4, C), np.float32))
