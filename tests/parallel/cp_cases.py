"""Packed rows, the per-document oracle and a runner for context-parallel attention tests (fp32)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lingpack.parallel.context import ContextParallel, context_attention
from lingpack.parallel.reorder import inverse_permutation
from lingpack.train.configs import ParallelConfig
from lingpack.train.sharding import make_mesh
from tests.optional import lazy

torch = lazy("torch")   # the per-document SDPA oracle

H, K, V = 8, 16, 8                 # V != K as in MLA; 8 heads so that Ulysses over 8 devices divides them
T = 512
SCALE = K ** -0.5
BLOCK = 16                          # zigzag chunk of T / 16 = 32 tokens: 2 x 2 tiles per chunk pair

# Documents crossing shard (64 / 32) and tile (16) boundaries; one spanning every shard with a
# padding-only tail; many 1-5 token documents then padding.
_short = [1, 2, 3, 4, 5, 1, 5, 2, 4, 3] * 10
ROWS = ((80, 240, 112, 80), (500,), tuple(_short))


def segments(rows, length=T):
    seg = np.zeros((len(rows), length), np.int32)
    for b, lengths in enumerate(rows):
        start = 0
        for i, n in enumerate(lengths):
            seg[b, start:start + n] = i + 1
            start += n
    return seg


def inputs(B, seed=0, length=T):
    rng = np.random.default_rng(seed)
    shapes = ((B, length, H, K), (B, length, H, K), (B, length, H, V), (B, length, H, V))
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]  # q, k, v and the output weights w


@functools.cache
def case(rows: tuple, seed=0):
    """(q, k, v, seg, w) of a packed batch and its oracle (o, dq, dk, dv), cached across tests."""
    seg = segments(rows)
    q, k, v, w = inputs(len(rows), seed)
    return (q, k, v, seg, w), per_document_oracle(q, k, v, seg, w)


def per_document_oracle(q, k, v, seg, w):
    """torch SDPA on every document alone: o and the grads of sum(o * w); padding gets 0 everywhere."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = torch.zeros(q.shape[:3] + (v.shape[-1],))
    for b, row in enumerate(seg):
        for s in np.unique(row[row > 0]):
            idx = torch.tensor(np.nonzero(row == s)[0])
            doc = lambda x: x[b, idx].transpose(0, 1)[None]  # [1, H, n, *]
            o = torch.nn.functional.scaled_dot_product_attention(doc(tq), doc(tk), doc(tv), is_causal=True, scale=SCALE)
            out = out.index_put((torch.tensor(b), idx), o[0].transpose(0, 1))
    (out * torch.tensor(w)).sum().backward()
    return [out.detach().numpy()] + [t.grad.numpy() for t in (tq, tk, tv)]


@functools.cache
def mesh():
    return make_mesh(ParallelConfig(data=-1, context=8))


@functools.cache
def compiled(strategy, load_balance, ulysses):
    """(compiled fn(q, k, v, seg, w) -> (o, counts, dq, dk, dv) on layout-ordered arrays, its HLO text, cp).

    Every test batch has len(ROWS) rows of T tokens, so each configuration compiles once per session.
    """
    B = len(ROWS)
    cp = ContextParallel(mesh(), strategy=strategy, ulysses=ulysses, load_balance=load_balance)

    def f(q, k, v, seg, w):
        def loss(q, k, v):
            o, counts = context_attention(q, k, v, seg, cp=cp, scale=SCALE, block=BLOCK, return_stats=True)
            return jnp.sum(o * w), (o, counts)
        (_, (o, counts)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (o, counts) + grads

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V))]
    args = shapes + [jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T, H, V), jnp.float32)]
    fn = jax.jit(f).lower(*args).compile()
    return fn, fn.as_text(), cp


def run(strategy, load_balance, q, k, v, seg, w, ulysses=1):
    """Runs CP attention on the layout-reordered row; returns (o, dq, dk, dv) in token order, and counts."""
    fn, _, cp = compiled(strategy, load_balance, ulysses)
    perm = cp.token_index(q.shape[1])
    outs = fn(*(x[:, perm] for x in (q, k, v, seg, w)))
    inv = inverse_permutation(perm)
    return [np.asarray(x)[:, inv] for x in (outs[0],) + outs[2:]], np.asarray(outs[1])


def assert_matches(got, ref, perm, n_shards, rel=1e-5):
    """Every device's shard of o, dq, dk, dv within `rel` of the oracle (error / largest oracle value)."""
    shards = np.array_split(perm, n_shards)  # token indices each device holds
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        scale = np.abs(r).max()
        for dev, idx in enumerate(shards):
            err = np.abs(g[:, idx] - r[:, idx]).max() / scale
            assert err <= rel, f"{name} on device {dev}: relative error {err:.2e} > {rel}"
