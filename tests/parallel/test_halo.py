"""Short-conv halo and MTP roll under context parallelism (parallel/halo.py) == one device.

Mesh data=2 x context=4; rows of 64 tokens: contiguous blocks of 16, zigzag chunks of 8, so the conv's
3-token halo and documents of 1-2 tokens meet block boundaries in every way.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lingpack.models.layers import segment_causal_conv, short_conv
from lingpack.models.mtp import mtp_targets, roll_and_mask_by_segment
from lingpack.parallel import halo, reorder
from lingpack.parallel.context import ContextParallel
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


def sharded(mesh, fn, *, side, width, load_balance, params=(), apart=False):
    """fn(x, seg, *params) run per context block with neighbours, on global arrays (rows over `data`)."""
    cp = ContextParallel(mesh, load_balance=load_balance, batch_axes=("data",))
    return lambda x, seg, *params: halo.context_neighbours(fn, x, seg, *params, cp=cp, side=side, width=width,
                                                           apart=apart)


def conv(x, seg, kernel):
    return jax.nn.silu(segment_causal_conv(x, kernel, seg))


def conv_apart(x, seg, prev_x, prev_seg, kernel, backward="xla"):
    """The model's form: the short conv's own VJP, the previous tokens passed apart (their gradient goes home);
    the joined form (one extended block) is the MTP roll's, tested below."""
    return short_conv(x, kernel, seg, "silu", prev_x, prev_seg, backward)


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_short_conv_halo_matches_one_device(mesh, rows, load_balance):
    check_short_conv_halo(mesh, rows, load_balance, "xla")


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
def test_pallas_short_conv_backward_under_context_parallel(mesh, load_balance):
    """The Pallas backward (kernels/short_conv.py, interpret mode) inside the CP shard_map: the halo's gradient
    goes home, each block's kernel-gradient partials are summed across blocks and rows."""
    check_short_conv_halo(mesh, "mixed", load_balance, "pallas_interpret")


def check_short_conv_halo(mesh, rows, load_balance, backward):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    kernel = rng.standard_normal((WIDTH, C)).astype(np.float32)
    w = rng.standard_normal((B, T, C)).astype(np.float32)
    seg = segments_from_lengths(ROWS[rows], T)
    cp = sharded(mesh, functools.partial(conv_apart, backward=backward), side="previous", width=WIDTH - 1,
                 load_balance=load_balance, params=(kernel,), apart=True)
    y = restore(jax.jit(cp)(layout(x, load_balance), layout(seg, load_balance), kernel), load_balance)
    np.testing.assert_allclose(y, conv(x, seg, kernel), rtol=1e-6, atol=1e-6)

    ref = jax.grad(lambda x, k: jnp.sum(conv(x, seg, k) * w), argnums=(0, 1))(x, kernel)
    got = jax.jit(jax.grad(lambda x, k: jnp.sum(cp(x, layout(seg, load_balance), k) * layout(w, load_balance)),
                           argnums=(0, 1)))(layout(x, load_balance), kernel)
    np.testing.assert_allclose(restore(got[0], load_balance), ref[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def cp_rolls(mesh, load_balance):
    """One jitted CP program: the embedding roll and its gradient, the token roll, depth-2 MTP targets/mask."""
    roll = sharded(mesh, roll_and_mask_by_segment, side="next", width=1, load_balance=load_balance)

    def run(emb, tokens, mask, seg, w):
        grad = jax.grad(lambda e: jnp.sum(roll(e, seg) * w))(emb)
        rolled_emb = roll(emb, seg)
        tgt, m = tokens, mask
        for _ in range(3):  # MTP depth 2 looks three tokens ahead
            tgt, m = roll(tgt, seg), roll(m, seg)
        return rolled_emb, grad, roll(tokens, seg), tgt, m
    return jax.jit(run)


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_mtp_roll_matches_one_device(mesh, rows, load_balance):
    rng = np.random.default_rng(1)
    seg = segments_from_lengths(ROWS[rows], T)
    emb = rng.standard_normal((B, T, C)).astype(np.float32)
    tokens = rng.integers(1, 100, (B, T)).astype(np.int32)
    mask = (seg > 0).astype(np.int32)
    w = rng.standard_normal((B, T, C)).astype(np.float32)
    got = cp_rolls(mesh, load_balance)(*(layout(a, load_balance) for a in (emb, tokens, mask, seg, w)))
    got = [restore(a, load_balance) for a in got]
    ref_grad = jax.grad(lambda e: jnp.sum(roll_and_mask_by_segment(e, seg) * w))(emb)
    ref_tgt, ref_mask = mtp_targets(tokens, mask, 2, seg)
    expected = [roll_and_mask_by_segment(emb, seg), ref_grad, roll_and_mask_by_segment(tokens, seg), ref_tgt, ref_mask]
    for name, a, e in zip(["rolled embeddings", "their gradient", "rolled tokens", "depth-2 targets", "depth-2 mask"],
                          got, expected):
        np.testing.assert_array_equal(a, np.asarray(e).astype(a.dtype), err_msg=name)


def test_blocks_shorter_than_the_halo_name_the_fix(mesh):
    x, seg = np.zeros((B, 8, C), np.float32), np.ones((B, 8), np.int32)
    cp = sharded(mesh, conv, side="previous", width=3, load_balance=True, params=(np.zeros((4, C), np.float32),))
    with pytest.raises(ValueError, match="neighbour tokens"):
        cp(x, seg, np.zeros((4, C), np.float32))
