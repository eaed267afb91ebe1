"""Multi-head latent attention (DeepSeek-V2 MLA) over packed rows, through the attention entry point.

    q      = q_proj x                       or  q_b_proj(q_norm(q_a_proj x))          (optional q LoRA)
    c, kr  = split(kv_a_proj x, [kv_lora_rank, qk_rope_head_dim])
    k_nope, v = split(kv_b_proj(kv_norm c), [qk_nope_head_dim, v_head_dim])            (per head)
    q = [q_nope, rope(q_rope)],  k = [k_nope, rope(kr) shared by all heads]
    y = o_proj(attention(q, k, v; segment_ids) )          scale = (qk_nope + qk_rope) ** -0.5

`rope_type="none"` is Kimi Linear's NoPE MLA: the rope slice exists (shapes as above) but is not rotated.
`rope_type="rope"` rotates the first `partial_rotary_factor * qk_rope_head_dim` features of the rope
slice (interleaved pairs or half-split), with positions from `inputs_position`.
Names follow transformers' KimiLinearAttention / DeepSeek (`kv_a_proj_with_mqa`, `kv_a_layernorm`, ...).
Under context parallelism (`parallel.current()`, see parallel/__init__.py) the attention runs sharded over
the sequence (`parallel.context_strategy`); projections and RoPE are per token, so the layout's permuted
positions need nothing else.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lingpack.kernels.attention.api import attention, resolve
from lingpack.models.layers import RMSNorm, apply_rope, dense
from lingpack.parallel.context import context_attention, current
from lingpack.models.remat import name, tag


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    num_heads: int = 4
    q_lora_rank: int | None = None     # None or 0: a direct q projection (Kimi Linear); Ling3 uses 256
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_type: str = "rope"            # "rope" or "none" (NoPE, Kimi Linear)
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    rope_interleaved: bool = True
    latent_norm_eps: float = 1e-6      # q_a_layernorm / kv_a_layernorm eps (transformers hard-codes 1e-6)

    def __post_init__(self):
        if self.rope_type not in ("rope", "none"):
            raise ValueError(f"mla.rope_type must be 'rope' or 'none'; got {self.rope_type!r}")
        if self.rope_type == "rope":
            rot = self.rotary_dim
            if rot % 2 or rot <= 0:
                raise ValueError(f"mla: partial_rotary_factor * qk_rope_head_dim = {self.partial_rotary_factor} * "
                                 f"{self.qk_rope_head_dim} must give a positive even number of rotated features")

    @property
    def rotary_dim(self) -> int:
        return int(round(self.partial_rotary_factor * self.qk_rope_head_dim))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLA(nnx.Module):
    def __init__(self, cfg: MLAConfig, emb_dim: int, *, attention_impl: str = "dot_product", attention_block: int = 128,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.attention_impl, self.attention_block = cfg, attention_impl, attention_block
        H = cfg.num_heads
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.q_lora_rank:
            self.q_a_proj = dense(emb_dim, cfg.q_lora_rank, ("embed", "q_lora"), **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.latent_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.q_b_proj = dense(cfg.q_lora_rank, H * cfg.qk_head_dim, ("q_lora", "heads"), **kw)
        else:
            self.q_proj = dense(emb_dim, H * cfg.qk_head_dim, ("embed", "heads"), **kw)
        self.kv_a_proj_with_mqa = dense(emb_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, ("embed", "kv_lora"), **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.latent_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.kv_b_proj = dense(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "heads"), **kw)
        self.o_proj = dense(H * cfg.v_head_dim, emb_dim, ("heads", "embed"), **kw)

    def _rope(self, x_BTHR: jax.Array, positions_BT: jax.Array) -> jax.Array:
        if self.cfg.rope_type == "none":
            return x_BTHR
        return apply_rope(x_BTHR, positions_BT, theta=self.cfg.rope_theta, rotary_dim=self.cfg.rotary_dim,
                          interleaved=self.cfg.rope_interleaved)

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None,
                 positions_BT: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        H, nope, rope, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        if cfg.q_lora_rank:
            q = tag(self.q_b_proj(self.q_a_layernorm(tag(self.q_a_proj(x_BTD), "qkv_proj"))), "query_proj")
        else:
            q = tag(self.q_proj(x_BTD), "query_proj")
        q_BTHQ = q.reshape(B, T, H, cfg.qk_head_dim)
        q_BTHQ = jnp.concatenate([q_BTHQ[..., :nope], self._rope(q_BTHQ[..., nope:], positions_BT)], axis=-1)

        latent = tag(self.kv_a_proj_with_mqa(x_BTD), "qkv_proj")
        c_BTC, k_rope_BT1R = latent[..., :cfg.kv_lora_rank], latent[..., cfg.kv_lora_rank:][:, :, None, :]
        kv_BTHX = tag(self.kv_b_proj(self.kv_a_layernorm(c_BTC)), "kv_proj").reshape(B, T, H, nope + dv)
        k_nope_BTHN, v_BTHV = kv_BTHX[..., :nope], kv_BTHX[..., nope:]
        k_rope_BTHR = jnp.broadcast_to(self._rope(k_rope_BT1R, positions_BT), (B, T, H, rope))
        k_BTHQ = jnp.concatenate([k_nope_BTHN, k_rope_BTHR.astype(k_nope_BTHN.dtype)], axis=-1)

        cp = current()
        if cp is None:
            o_BTHV = attention(q_BTHQ, k_BTHQ, v_BTHV, segment_ids_BT=segment_ids_BT, impl=self.attention_impl,
                               scale=cfg.qk_head_dim ** -0.5, block_size=self.attention_block,
                               residual_name=name("context"))
        else:  # sequence sharded over `context`; segment_ids are never None in the model (ling3 fills them)
            o_BTHV = context_attention(q_BTHQ, k_BTHQ, v_BTHV, segment_ids_BT, cp=cp, scale=cfg.qk_head_dim ** -0.5,
                                       block=self.attention_block, residual_name=name("context"),
                                       impl=resolve(self.attention_impl, jnp.result_type(q_BTHQ, v_BTHV)))
        o_BTHV = tag(o_BTHV, "context")
        return tag(self.o_proj(o_BTHV.reshape(B, T, H * dv)), "out_proj")
