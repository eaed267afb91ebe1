"""One pre-norm decoder layer: x += mixer(norm(x)); x += ffn(norm(x)); mixer KDA or MLA, ffn dense or MoE.

Submodule names follow transformers' KimiLinearDecoderLayer (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`) so conversion stays a table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lingpack.models.kda import KDA, KDAConfig, KDAKernel
from lingpack.models.layers import MLP, RMSNorm
from lingpack.models.mla import MLA, MLAConfig
from lingpack.models.moe import MoE, MoEConfig
from lingpack.models.remat import part
from lingpack.parallel.layout import BTD, constrain


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer is made of and the shared sizes it needs (built by `ling3.Ling3`)."""
    mixer: str                # "kda" or "mla"
    ffn: str                  # "dense" or "moe"
    emb_dim: int
    mlp_dim: int
    norm_eps: float
    kda: KDAConfig
    kda_kernel: KDAKernel
    mla: MLAConfig
    attention_impl: str
    attention_block_size: int
    moe: MoEConfig


class DecoderLayer(nnx.Module):
    def __init__(self, spec: LayerSpec, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if spec.mixer not in ("kda", "mla") or spec.ffn not in ("dense", "moe"):
            raise ValueError(f"layer mixer must be kda|mla and ffn dense|moe; got {spec.mixer!r}, {spec.ffn!r}")
        self.mixer, self.ffn = spec.mixer, spec.ffn
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        D = spec.emb_dim
        self.input_layernorm = RMSNorm(D, eps=spec.norm_eps, dtype=dtype, param_dtype=param_dtype)
        if spec.mixer == "kda":
            self.self_attn = KDA(spec.kda, D, kernel=spec.kda_kernel, norm_eps=spec.norm_eps, **kw)
        else:
            self.self_attn = MLA(spec.mla, D, attention_impl=spec.attention_impl,
                                 attention_block=spec.attention_block_size, **kw)
        self.post_attention_layernorm = RMSNorm(D, eps=spec.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MoE(spec.moe, D, **kw) if spec.ffn == "moe" else MLP(D, spec.mlp_dim, **kw)

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array):
        """-> (x_BTD, moe aux dict or None)."""
        return feed(self, mix(self, x_BTD, segment_ids_BT, positions_BT), segment_ids_BT)


MIXER_PARTS = ("input_layernorm", "self_attn")       # a layer's submodules before its residual add
FFN_PARTS = ("post_attention_layernorm", "mlp")      # and after it


def mix(layer, x_BTD: jax.Array, segment_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """x + mixer(norm(x)) of `layer` (a DecoderLayer, or any module with its MIXER_PARTS and `mixer`)."""
    with jax.named_scope(layer.mixer), part(layer.mixer):
        h = layer.input_layernorm(x_BTD)
        if layer.mixer == "kda":
            h = layer.self_attn(h, segment_ids_BT)
        else:
            h = layer.self_attn(h, segment_ids_BT, positions_BT)
    return constrain(x_BTD + h.astype(x_BTD.dtype), BTD)


def feed(layer, x_BTD: jax.Array, segment_ids_BT: jax.Array):
    """(x + ffn(norm(x)), moe aux or None) of `layer` (a DecoderLayer, or any module with its FFN_PARTS and `ffn`)."""
    aux = None
    with jax.named_scope(layer.ffn), part("moe" if layer.ffn == "moe" else "mlp"):
        h = layer.post_attention_layernorm(x_BTD)
        if layer.ffn == "moe":
            h, aux = layer.mlp(h, segment_ids_BT)
        else:
            h = layer.mlp(h)
    return constrain(x_BTD + h.astype(x_BTD.dtype), BTD), aux


def parts(layer, index: tuple = (), names: tuple = MIXER_PARTS + FFN_PARTS) -> dict:
    """{submodule name: (module, index into its stack axes)} for `names` of a layer (or of a stacked half)."""
    return {name: (getattr(layer, name), index) for name in names}
