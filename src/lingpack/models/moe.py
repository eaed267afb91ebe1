"""Ling / DeepSeek-V3 style mixture of experts with dropless dispatch.

Routing (fp32, float64 with a float64 model): `scores = sigmoid(x @ router)`; experts are CHOSEN by `scores +
expert_bias` (the auxiliary-loss-free balancing bias), optionally limited to the `topk_groups` best of
`n_groups` groups (a group's score = sum of its 2 best biased scores); the chosen experts are WEIGHTED by the
unbiased scores, optionally renormalised (`norm_topk_prob`), times `routed_scaling_factor`.
Dispatch: the N*k (token, expert) assignments are sorted by expert and run as grouped matmuls, so no
token is ever dropped: Megablox's `gmm` on TPU (JAX's Pallas TPU kernel, `megablox_grouped_matmul`: its grid
runs over the tiles that hold a group's rows only), `tiled_grouped_matmul` on CPU and GPU, where XLA expands
ragged_dot into a dense dot of every row against every expert (E times the work; docs/kernels.md#moe-grouped-matmul
measures it on CPU); on NVIDIA GPUs the expansion is
openxla/xla:xla/hlo/transforms/expanders/ragged_dot_rewriter.cc, unless an experimental cuDNN flag is set.
XLA:TPU runs `ragged_dot`'s forward and input gradient as Mosaic kernels of its own, but its weight gradient
as a dense dot against every expert (experiments/expert_parallel/tpu.py measures it; docs/parallelism.md).
Shared experts see every token. Under context parallelism every device dispatches its own tokens; with the
experts split over axes that also split the tokens (`parallel.expert`), the assignments travel to the
experts' devices by all-to-all (parallel/expert.py).

`expert_bias` is an `ExpertBias` variable, not an `nnx.Param`: gradients never reach it; it moves only
through `update_expert_bias` (outside the gradient), from the per-expert load counts each call returns.
Statistics (load counts, router z-loss) count real tokens only (segment id != 0). The aux dict also
carries each token's chosen experts, router logits and the bias used (the parity routing trace).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from lingpack import backend
from lingpack.errors import ConfigError
from lingpack.models.layers import DEFAULT_INIT, MLP, partitioned
from lingpack.parallel import expert
from lingpack.parallel.context import current, dividing_axes
from lingpack.parallel.layout import axis_tuple, constrain, current_layout
from lingpack.precision import at_least_fp32
from lingpack.models.remat import tag


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2
    expert_dim: int = 64
    num_shared_experts: int = 1           # shared width = num_shared_experts * expert_dim
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    bias_update_rate: float = 1e-3        # the train step's `update_expert_bias` rate (auxiliary-loss-free)
    z_loss_coef: float = 0.0              # Ling3: 2.9e-6; the objective adds it times the router z-loss
    grouped_matmul: str = "auto"          # "megablox", "ragged_dot", "tiled", or "auto" (GROUPED_MATMUL_AUTO per platform)
    # experts split over axes that also split the tokens: "all_to_all" sends the tokens to the experts'
    # devices (parallel/expert.py); "gather" all-gathers every expert onto every device instead
    expert_parallel: str = "all_to_all"
    expert_parallel_chunks: int = 1       # all_to_all: the device's tokens dispatched in this many rounds
    # all_to_all: each round's tokens dispatched as this many independent slices side by side, so that one
    # slice's exchange can run while another's experts compute (docs/parallelism.md)
    expert_parallel_slices: int = 1
    # all_to_all: receive buffers hold this many times the balanced load; rows past it go in further exchange
    # rounds, only when routing is that skewed (parallel/expert.py; nothing is dropped)
    expert_parallel_capacity: float = 1.25
    # all_to_all: "ragged" (XLA's ragged all-to-all), "dense" (all_to_all of capacity-sized buffers), or
    # "auto" (backend.expert_exchange: what the chip supports)
    expert_parallel_exchange: str = "auto"

    def __post_init__(self):
        E, G = self.num_experts, self.n_groups
        if E < 1 or not 1 <= self.top_k <= E:
            raise ValueError(f"moe: need 1 <= top_k <= num_experts; got top_k={self.top_k}, num_experts={E}")
        if G < 1 or E % G:
            raise ValueError(f"moe: num_experts={E} must be divisible by n_groups={G}")
        if not 1 <= self.topk_groups <= G:
            raise ValueError(f"moe: topk_groups={self.topk_groups} must lie in [1, n_groups={G}]")
        if G > 1 and E // G < 2:
            raise ValueError(f"moe: group scores sum each group's 2 best experts; num_experts/n_groups = {E // G} < 2")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(f"moe.grouped_matmul must be one of {GROUPED_MATMULS}; got {self.grouped_matmul!r}")
        if self.expert_parallel not in EXPERT_PARALLEL:
            raise ValueError(f"moe.expert_parallel must be one of {EXPERT_PARALLEL}; got {self.expert_parallel!r}")
        if not self.expert_parallel_capacity > 0:
            raise ValueError(f"moe.expert_parallel_capacity={self.expert_parallel_capacity} must be > 0 (1.0: "
                             "buffers of the balanced load; 1.25 is the default)")
        if self.expert_parallel_exchange not in ("auto", *expert.EXCHANGES):
            raise ValueError(f"moe.expert_parallel_exchange must be one of {('auto', *expert.EXCHANGES)}; got "
                             f"{self.expert_parallel_exchange!r}")
        if self.expert_parallel_chunks < 1:
            raise ValueError(f"moe.expert_parallel_chunks={self.expert_parallel_chunks} must be >= 1")
        if self.expert_parallel_slices < 1:
            raise ValueError(f"moe.expert_parallel_slices={self.expert_parallel_slices} must be >= 1")
        if self.topk_groups * (E // G) < self.top_k:
            raise ValueError(f"moe: the {self.topk_groups} kept groups hold {self.topk_groups * (E // G)} experts,"
                             f" fewer than top_k={self.top_k}; raise topk_groups")


GROUPED_MATMULS = ("auto", "megablox", "ragged_dot", "tiled")
EXPERT_PARALLEL = ("all_to_all", "gather")
GROUPED_MATMUL_AUTO = {"tpu": "megablox", "gpu": "tiled", "cpu": "tiled"}   # the module docstring says why
MEGABLOX_TILES = (512, 256, 128)   # Megablox tile edges tried (Mosaic blocks: multiples of 128 lanes)


def megablox_tile(D: int, I: int) -> int | None:
    """The largest tile edge dividing both matrix widths (gmm's backward swaps the contraction and output
    dimensions under the same tiling), or None: Megablox cannot tile them on TPU."""
    return next((t for t in MEGABLOX_TILES if D % t == 0 and I % t == 0), None)
TILE_ROWS = 32  # rows per tile of `tiled_grouped_matmul`: at most E * (TILE_ROWS - 1) filler rows per call


def tiled_grouped_matmul(x_MD: jax.Array, w_EDI: jax.Array, group_sizes_E: jax.Array, *, tile: int = TILE_ROWS,
                         block: int | None = None, preferred_element_type=None) -> jax.Array:
    """`ragged_dot` semantics (rows sorted by group; group e's rows times w[e]) as tiles of one expert each.

    Each group's rows are padded to whole tiles of `tile` rows (filler rows are zero and dropped again);
    the tile count is static: ceil(M / tile) + E bounds sum_e ceil(size_e / tile). Tiles run `block` at a
    time (default E) as one batched matmul [block, tile, D] x [block, D, I] with per-tile expert weights, in
    a loop: a tile's weights are gathered for its block only (and again in the backward), so the gathered
    copies never exceed E experts' worth, whatever M (all tiles at once held M / tile copies of a weight).
    """
    M, D = x_MD.shape
    E = w_EDI.shape[0]
    block = E if block is None else block
    n_blocks = -(-(-(-M // tile) + E) // block)
    n_tiles = n_blocks * block
    padded_E = (group_sizes_E + tile - 1) // tile * tile
    padded_start_E = jnp.cumsum(padded_E) - padded_E
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    expert_M = jnp.repeat(jnp.arange(E), group_sizes_E, total_repeat_length=M)
    dest_M = padded_start_E[expert_M] + jnp.arange(M) - start_E[expert_M]
    x_tiles = jnp.zeros((n_tiles * tile, D), x_MD.dtype).at[dest_M].set(x_MD).reshape(n_blocks, block, tile, D)
    # tile t belongs to the expert whose padded range holds row t * tile; unused tiles (zero rows) take E - 1
    tile_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded_E), jnp.arange(n_tiles) * tile, side="right"), E - 1)

    @jax.checkpoint   # the backward gathers the block's weights again instead of saving every block's copy
    def one_block(x_btd, experts_b):
        return jnp.einsum("btd,bdi->bti", x_btd, w_EDI[experts_b], preferred_element_type=preferred_element_type)

    y_tiles = jax.lax.map(lambda args: one_block(*args), (x_tiles, tile_expert.reshape(n_blocks, block)))
    return y_tiles.reshape(n_tiles * tile, -1)[dest_M]


def megablox_grouped_matmul(x_MD: jax.Array, w_EDI: jax.Array, group_sizes_E: jax.Array, *,
                            preferred_element_type=None, free_rows: str = "zero") -> jax.Array:
    """`ragged_dot` semantics by Megablox's `gmm` (jax.experimental.pallas.ops.tpu.megablox; its own VJP).

    Rows are padded to whole row tiles; rows past sum(group_sizes) (padding, or a receive buffer's free space),
    which gmm leaves unwritten, come back zero. `free_rows="any"` skips those masks (a pass over x, the result
    and their gradients each): free rows of x may then hold anything, even NaN, and those of the result and of
    x's gradient are unspecified. Rows stay independent and tgmm selects only group rows, so the other rows
    and the weight gradient are unchanged. A Mosaic kernel: interpret mode on CPU (tests), a
    ConfigError on GPU (backend.pallas_interpret). Mosaic refuses bf16 operands under
    `jax_default_matmul_precision=highest` (an fp32 pass); bf16 runs at the default precision.
    """
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
    M, D = x_MD.shape
    I = w_EDI.shape[2]
    interpret = backend.pallas_interpret(None, kernel="Megablox gmm", alternative="moe.grouped_matmul=tiled",
                                         emulate=None)
    tile = megablox_tile(D, I)
    if tile is None and not interpret:
        raise ConfigError(f"moe.grouped_matmul=megablox tiles widths by multiples of 128; got {D} x {I} "
                          "(emb_dim x expert_dim): use moe.grouped_matmul=ragged_dot")
    tk, tn = (tile, tile) if tile else (D, I)   # interpret mode: any block
    tm = min(MEGABLOX_TILES[0], -(-M // 128) * 128)
    padded = -(-M // tm) * tm
    if free_rows not in ("zero", "any"):
        raise ValueError(f"free_rows must be 'zero' or 'any'; got {free_rows!r}")
    used_M1 = (jnp.arange(M) < jnp.sum(group_sizes_E))[:, None]
    mask = (lambda a: jnp.where(used_M1, a, jnp.zeros((), a.dtype))) if free_rows == "zero" else (lambda a: a)
    # the input masked too: its gradient, which gmm's backward leaves unwritten past the groups, is zero there
    x_pad = jnp.pad(mask(x_MD), ((0, padded - M), (0, 0)))
    out_dtype = preferred_element_type or x_MD.dtype
    y = megablox.gmm(x_pad, w_EDI.astype(x_MD.dtype), group_sizes_E.astype(jnp.int32), out_dtype,
                     (tm, tk, tn), None, None, False, interpret)[:M]
    return mask(y)


@jax.custom_vjp
def sort_rows(x_ND: jax.Array, from_P: jax.Array, to_M: jax.Array) -> jax.Array:
    """Each of the N rows k times (k = M / N) in a sorted order of P >= M places: place p holds copy
    from_P[p] % k of row from_P[p] // k; a padding place (from_P[p] = M) holds a copy of the last row, some
    finite row (a zero fill would cost XLA:TPU a select over the rows; `combine_rows` zeroes their
    cotangents instead). Copy j of row n takes place to_M[n*k + j]. Its backward is a gather too (XLA
    transposes a gather into a scatter-add)."""
    N = x_ND.shape[0]
    return x_ND[jnp.minimum(from_P // (to_M.shape[0] // N), N - 1)]


def _sort_rows_fwd(x_ND, from_P, to_M):
    # residuals: the places, and x's row count and dtype as an empty [N, 0] array
    return sort_rows(x_ND, from_P, to_M), (to_M, x_ND[:, :0])


def _sort_rows_bwd(res, g_PD):
    to_M, like_N0 = res
    M, N = to_M.shape[0], like_N0.shape[0]
    # the k copies' cotangents summed in fp32 at least, over [k, N, D] slabs (see `combine_rows`)
    g_KND = g_PD[to_M.reshape(N, M // N).T]
    sums_ND = g_KND[0].astype(at_least_fp32(g_PD.dtype))
    for g_ND in g_KND[1:]:
        sums_ND = sums_ND + g_ND
    return sums_ND.astype(like_N0.dtype), None, None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


@jax.custom_vjp
def combine_rows(y_PD: jax.Array, to_M: jax.Array, from_P: jax.Array, w_NK: jax.Array) -> jax.Array:
    """sum_j w[n, j] y[to[n*k + j]] in w's dtype: `sort_rows`' places (`from_P` is M at padding places) undone
    and the top-k outputs weighted. The k copies are taken as slabs [k, N, D] and added one by one: XLA:TPU
    costs a sum over the middle axis of [N, k, D] at about twice (docs/benchmarks.md, "The MoE's data-movement
    ops alone"). The backward writes each place's cotangent,
    d[n] w[n, j], in one gather by `from_P` (zero at padding places); y's rows are needed for w's only."""
    return _combine_fwd(y_PD, to_M, from_P, w_NK)[0]


def _combine_fwd(y_PD, to_M, from_P, w_NK):
    N, k = w_NK.shape
    y_KND = y_PD[to_M.reshape(N, k).T]
    acc_ND = y_KND[0].astype(w_NK.dtype) * w_NK[:, :1]
    for j in range(1, k):
        acc_ND = acc_ND + y_KND[j].astype(w_NK.dtype) * w_NK[:, j:j + 1]
    return acc_ND, (y_KND, from_P, w_NK)


def _combine_bwd(res, d_ND):
    y_KND, from_P, w_NK = res
    (N, k), wide = w_NK.shape, w_NK.dtype
    m_P = jnp.minimum(from_P, N * k - 1)
    d_ND = d_ND.astype(wide)
    dy_PD = jnp.where((from_P < N * k)[:, None], d_ND[m_P // k] * w_NK.reshape(-1)[m_P][:, None], 0)
    dw_NK = jnp.stack([jnp.sum(y_KND[j].astype(wide) * d_ND, axis=-1) for j in range(k)], axis=1)
    return dy_PD.astype(y_KND.dtype), None, None, dw_NK


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def _token_mapping(B: int, T: int):
    """(mesh, PartitionSpec of [B, T, ...] token arrays, layout or None) for a sharded dispatch; None on one device."""
    layout, cp = current_layout(), current()
    if layout is not None:
        return layout.mesh, layout.spec(("batch", "length"), (B, T)), layout
    if cp is not None:   # context parallelism traced without a layout (its own tests): rows over cp.batch_axes
        return cp.mesh, P(dividing_axes(cp.mesh, cp.batch_axes, B), cp.axis), None
    return None


def _expert_weight_specs(layout, tokens: P, shapes, all_to_all: bool = True) -> tuple[list[P], tuple, tuple, tuple]:
    """(in_specs of wi_gate [E, D, I], wi_up, wo [E, I, D]; axes to all-gather E over; to psum over; the EP axes).

    Experts enter split over the `exp` rule's axes, expert widths over the `mlp` rule's (each device computes
    its slice of I, outputs are summed), unless those axes also split the tokens; the model width D enters
    whole (an FSDP gather). When the `exp` axes also split the tokens they are the expert-parallel group
    (fourth result, unless `all_to_all` is False): tokens travel to the experts (parallel/expert.py). Else
    experts split over axes that do not split the tokens are all-gathered inside, the rest enter whole.
    """
    if layout is None:
        return [P()] * 3, (), (), ()
    token_axes = {a for entry in tokens for a in axis_tuple(entry)}
    E, _, I = shapes[0]
    spec = layout.spec(("exp", "mlp"), (E, I))
    ep = expert.ep_axes(spec[0], token_axes) if all_to_all else ()
    gather, reduce = (tuple(a for a in axis_tuple(entry) if a not in token_axes) for entry in spec)
    if math.prod(layout.mesh.shape[a] for a in gather) != math.prod(layout.mesh.shape[a] for a in axis_tuple(spec[0])):
        gather = ()   # part of the expert axis also splits the tokens: expert parallelism, or enter whole
    if math.prod(layout.mesh.shape[a] for a in reduce) != math.prod(layout.mesh.shape[a] for a in axis_tuple(spec[1])):
        reduce = ()
    e, i = (axes[0] if len(axes) == 1 else (axes or None) for axes in (ep or gather, reduce))
    return [P(e, None, i), P(e, None, i), P(e, i, None)], gather, reduce, ep


class ExpertBias(nnx.Variable):
    """Auxiliary-loss-free routing bias: the router's dtype, excluded from gradients and weight decay."""


def route(logits_NE: jax.Array, bias_E: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """(top-k expert indices int32 [N, k], combine weights [N, k] in the logits' dtype) from router logits."""
    N, E = logits_NE.shape
    scores = jax.nn.sigmoid(logits_NE)
    choice = scores + bias_E  # the bias only changes WHICH experts are chosen, not their weights
    if cfg.n_groups > 1:
        grouped = choice.reshape(N, cfg.n_groups, E // cfg.n_groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                              # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_groups)
        keep_NG = jnp.any(jax.nn.one_hot(top_groups, cfg.n_groups, dtype=bool), axis=1)
        keep_NE = jnp.repeat(keep_NG, E // cfg.n_groups, axis=1)
        choice = jnp.where(keep_NE, choice, -jnp.inf)  # -inf only feeds top_k (no gradient path)
    _, idx_NK = jax.lax.top_k(jax.lax.stop_gradient(choice), cfg.top_k)
    weights_NK = jnp.take_along_axis(scores, idx_NK, axis=1)
    if cfg.norm_topk_prob:
        weights_NK = weights_NK / (weights_NK.sum(-1, keepdims=True) + 1e-20)  # eps as in DeepSeek: never 0/0
    return idx_NK.astype(jnp.int32), weights_NK * cfg.routed_scaling_factor


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, emb_dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        E, D, I = cfg.num_experts, emb_dim, cfg.expert_dim
        # Routing is fp32 whatever the compute dtype (bf16 logits flip near-tied expert choices between steps);
        # float64 when the model computes in float64.
        self.routing_dtype = at_least_fp32(dtype, param_dtype)
        self.router = nnx.Param(partitioned(DEFAULT_INIT, ("embed", "exp"))(rngs.params(), (D, E), self.routing_dtype))
        self.expert_bias = ExpertBias(partitioned(nnx.initializers.zeros, ("exp",))(None, (E,), self.routing_dtype))
        self.wi_gate = nnx.Param(partitioned(DEFAULT_INIT, ("exp", "embed", "mlp"))(rngs.params(), (E, D, I), param_dtype))
        self.wi_up = nnx.Param(partitioned(DEFAULT_INIT, ("exp", "embed", "mlp"))(rngs.params(), (E, D, I), param_dtype))
        self.wo = nnx.Param(partitioned(DEFAULT_INIT, ("exp", "mlp", "embed"))(rngs.params(), (E, I, D), param_dtype))
        self.shared_experts = (MLP(D, I * cfg.num_shared_experts, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                               if cfg.num_shared_experts else None)

    def routed(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(routed experts' output [B, T, D], chosen experts int32 [B, T, k], fp32 router logits [B, T, E],
        expert-parallel exchange rounds taken: int32 [B, T] on a mesh (each token's device's), else a scalar).

        On a mesh (an activation layout, or context parallelism alone) each device routes and dispatches its
        own tokens inside a shard_map over the token axes: a global sort over split rows would gather every
        token onto every device (and XLA does not partition a top-k over its rows either).
        """
        weights = (self.router[...], self.expert_bias[...], self.wi_gate[...], self.wi_up[...], self.wo[...])
        mapped = _token_mapping(*x_BTD.shape[:2])
        if mapped is None:
            return self._route_and_dispatch(x_BTD, *weights)
        mesh, tokens, layout = mapped
        expert_specs, gather, reduce, ep = _expert_weight_specs(layout, tokens, [w.shape for w in weights[2:]],
                                                                self.cfg.expert_parallel == "all_to_all")
        exchange = self.cfg.expert_parallel_exchange
        exchange = backend.expert_exchange(mesh.devices.flat) if exchange == "auto" else exchange

        def local(x, router, bias, *experts_w):
            # experts split over `gather` axes (`exp`) come back whole here (their gradient is reduce-scattered);
            # split over `ep` axes they stay local and the tokens travel instead
            experts_w = [jax.lax.all_gather(e, gather, axis=0, tiled=True) if gather else e for e in experts_w]
            y, idx, logits, rounds = self._route_and_dispatch(x, router, bias, *experts_w, ep=ep, exchange=exchange)
            y = jax.lax.psum(y, reduce) if reduce else y   # widths split over `reduce`: partial sums
            return y, idx, logits, jnp.full(idx.shape[:2], rounds, jnp.int32)

        # router and bias enter replicated (small); their gradients are summed over devices by the transpose
        return jax.shard_map(local, mesh=mesh, in_specs=(tokens, P(), P(), *expert_specs), out_specs=(tokens,) * 4,
                             check_vma=False)(x_BTD, *weights)

    def _route_and_dispatch(self, x_BTD, router_DE, bias_E, wi_gate, wi_up, wo, ep=(), exchange="ragged"):
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        logits_NE = x_ND.astype(self.routing_dtype) @ router_DE  # fp32 routing (see the router's comment)
        idx_NK, weights_NK = route(logits_NE, bias_E, self.cfg)
        y_ND, rounds = self._dispatch(x_ND, idx_NK, weights_NK, wi_gate, wi_up, wo, ep, exchange)
        return y_ND.reshape(B, T, D), idx_NK.reshape(B, T, -1), logits_NE.reshape(B, T, -1), rounds

    def _dispatch(self, x_ND, idx_NK, weights_NK, wi_gate, wi_up, wo, ep=(), exchange="ragged"):
        """(combined outputs [N, D], exchange rounds taken) from sorting assignments by expert, grouped matmuls
        (on the experts' devices over `ep` axes) and a weighted sum back; over `ep`, in
        `expert_parallel_chunks` rounds of `expert_parallel_slices` slices of the tokens."""
        if ep:
            body = lambda x, i, w: self._dispatch_rows(x, i, w, wi_gate, wi_up, wo, ep, exchange)
            return expert.in_rounds(body, self.cfg.expert_parallel_chunks, x_ND, idx_NK, weights_NK,
                                    slices=self.cfg.expert_parallel_slices)
        return self._dispatch_rows(x_ND, idx_NK, weights_NK, wi_gate, wi_up, wo, ep, exchange)

    def _dispatch_rows(self, x_ND, idx_NK, weights_NK, wi_gate, wi_up, wo, ep, exchange):
        N, D = x_ND.shape
        k, E = idx_NK.shape[1], self.cfg.num_experts
        flat_expert = idx_NK.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(N * k, dtype=order.dtype))
        group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
        choice = self.cfg.grouped_matmul
        if choice == "auto":   # Megablox where it tiles the widths, XLA:TPU's ragged_dot for narrower ones
            choice = GROUPED_MATMUL_AUTO[backend.current()]
            choice = "ragged_dot" if choice == "megablox" and megablox_tile(D, self.cfg.expert_dim) is None else choice
        # under `ep` rows travel in units (parallel/expert.py): each expert's rows padded with rows to whole
        # units; not for ragged_dot, whose weight gradient XLA:TPU fails to compile for v5e on unit-shaped
        # buffers (libtpu 0.0.42: a RET_CHECK in mask_aggregator.cc; tests/parallel/test_expert_tpu.py)
        unit = expert.UNIT if ep and choice != "ragged_dot" else 1
        if unit > 1:
            to, back, group_sizes = expert.unit_layout(flat_expert, inverse, group_sizes, unit)
        else:
            to, back = inverse, order
        x_sorted = sort_rows(x_ND, back, to).astype(self.dtype)
        grouped = {"tiled": tiled_grouped_matmul, "megablox": megablox_grouped_matmul,
                   "ragged_dot": jax.lax.ragged_dot}[choice]
        # under `ep` a receive buffer's free rows are never read back: Megablox may leave them as they come
        unmasked = bool(ep) and choice == "megablox"
        grouped = functools.partial(grouped, free_rows="any") if unmasked else grouped
        wide = at_least_fp32(self.dtype)  # fp32 accumulation for bf16 (float64 for float64)

        def experts_fn(w, x_MD, sizes):   # the experts held here (all E, or this device's E / EP under `ep`)
            mm = lambda a, w_KF, out: grouped(a, w_KF.astype(self.dtype), sizes, preferred_element_type=out)
            # gate and up projections as one grouped matmul of [D, 2F] weights: x's rows are read once, and its
            # cotangent is one matmul rather than the sum of two (the same dot products; XLA may order their sums
            # differently, docs/parity.md)
            # every matmul accumulates in fp32 inside and rounds once into the compute dtype (as the dense MLP's
            # projections do): its outputs and their cotangents are bf16 buffers (half the bytes of fp32 ones over
            # the receive buffer), the SwiGLU is computed in fp32 from them, and the outputs travel back in bf16
            F = w[0].shape[-1]
            x_MD = tag(x_MD, "expert_inputs")
            gate_up = mm(x_MD, jnp.concatenate([w[0], w[1]], axis=-1), self.dtype)
            gate, up = tag(gate_up[:, :F], "mlpwi_0").astype(wide), tag(gate_up[:, F:], "mlpwi_1").astype(wide)
            return tag(mm((jax.nn.silu(gate) * up).astype(self.dtype), w[2], self.dtype), "mlpwo")

        if ep:
            y_sorted, rounds = expert.dispatch(x_sorted, group_sizes, experts_fn, (wi_gate, wi_up, wo), axis_name=ep,
                                               top_k=k, unit=unit, capacity=self.cfg.expert_parallel_capacity,
                                               exchange=exchange, masked=not unmasked)
        else:
            y_sorted, rounds = experts_fn((wi_gate, wi_up, wo), x_sorted, group_sizes), jnp.ones((), jnp.int32)
        y_sorted = tag(y_sorted, "expert_outputs")
        # the weighted sum over the top-k accumulates in fp32 (float64 for float64)
        return combine_rows(y_sorted, to, back, weights_NK.astype(wide)).astype(self.dtype), rounds

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
        B, T, D = x_BTD.shape
        y_BTD, idx_BTK, logits_BTE, rounds_BT = self.routed(x_BTD)
        if self.shared_experts is not None:
            y_BTD = y_BTD + self.shared_experts(x_BTD)
        real_BT = jnp.ones((B, T), bool) if segment_ids_BT is None else segment_ids_BT != 0
        # statistics: sums over the [B, T] token axes, kept split (per-device sums, then one small all-reduce)
        hits_BTKE = constrain(jax.nn.one_hot(idx_BTK, self.cfg.num_experts), ("batch", "length", None, None))
        load_E = jnp.sum(hits_BTKE * real_BT[..., None, None], axis=(0, 1, 2))
        z_BT = jax.nn.logsumexp(logits_BTE, axis=-1) ** 2
        idx_NK, logits_NE = idx_BTK.reshape(B * T, -1), logits_BTE.reshape(B * T, -1)
        aux = {"router_z_loss": jnp.sum(jnp.where(real_BT, z_BT, 0.0)),
               "load_counts": jax.lax.stop_gradient(load_E),
               "num_tokens": jnp.sum(real_BT).astype(logits_BTE.dtype),
               # the routing trace (parity/routing.py); unused outputs cost nothing under jit
               "expert_ids": idx_NK, "router_logits": jax.lax.stop_gradient(logits_NE),
               "expert_bias": self.expert_bias[...],
               # exchange rounds the expert-parallel dispatch took (1 unless a receive buffer overflowed)
               "dispatch_rounds": jnp.max(rounds_BT)}
        return y_BTD, aux


def update_expert_bias(model, load_counts, rate: float) -> None:
    """bias += rate * sign(mean_load - load), then re-centred to mean 0; in place, outside the gradient.

    `model` is a MoE, or any module with `moe_layers()` (Ling3) whose order matches the stacking of
    `load_counts` [num_moe_layers, E] (as returned in `Ling3Output.moe_aux["load_counts"]`). Its entries
    are MoE modules or (MoE, index) pairs: `index` picks one layer of a layer-stacked (scanned) MoE.
    """
    layers = model.moe_layers() if hasattr(model, "moe_layers") else [model]
    layers = [entry if isinstance(entry, tuple) else (entry, ()) for entry in layers]
    load_counts = jnp.asarray(load_counts).reshape(len(layers), -1)  # counts: exact in any float dtype
    for (moe, index), load_E in zip(layers, load_counts):
        bias_E = moe.expert_bias[...][index]
        if load_E.shape != bias_E.shape:
            raise ValueError(f"load_counts rows must have {bias_E.shape[0]} experts; got {load_E.shape}")
        load_E = load_E.astype(bias_E.dtype)
        bias_E = bias_E + rate * jnp.sign(jnp.mean(load_E) - load_E)  # underloaded experts rise
        moe.expert_bias[...] = moe.expert_bias[...].at[index].set(bias_E - jnp.mean(bias_E))
