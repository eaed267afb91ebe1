"""KDA and MLA layers on packed rows == transformers' KimiLinear layers run on each document alone."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack.models.kda import KDA, KDAConfig, KDAKernel
from lingpack.models.mla import MLA, MLAConfig
from lingpack.parity.convert import hf_gated_norm_activation
from packing_cases import documents, packed_batch, per_document_batch
from tests.optional import lazy

torch = lazy("torch")
hf = lazy("transformers.models.kimi_linear.modeling_kimi_linear")
KimiLinearConfig = lazy("transformers", "KimiLinearConfig")

D = 32
ROWS, T = [[5, 1, 30, 20], [64], [16, 3]], 64


def _randomize(module, seed):
    key = jax.random.key(seed)
    for path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param) and var.ndim == 2 and path[-2:] != ("q_conv", "kernel") and "conv" not in str(path[-2]):
            key, sub = jax.random.split(key)
            var[...] = jax.random.normal(sub, var.shape) / np.sqrt(var.shape[0])
        elif isinstance(var, nnx.Param) and var.ndim == 1 and path[-1] == "weight":
            key, sub = jax.random.split(key)
            var[...] = 0.5 + jax.random.uniform(sub, var.shape)


def _hf_config(kda_cfg=None, mla_cfg=None):
    kw = dict(hidden_size=D, rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention"],
              mlp_layer_types=["dense", "dense"], num_hidden_layers=2)
    if kda_cfg:
        kw["linear_attn_config"] = {"head_dim": kda_cfg.head_dim, "num_heads": kda_cfg.num_heads,
                                    "short_conv_kernel_size": kda_cfg.conv_size}
    if mla_cfg:
        kw.update(num_attention_heads=mla_cfg.num_heads, num_key_value_heads=mla_cfg.num_heads,
                  q_lora_rank=mla_cfg.q_lora_rank, kv_lora_rank=mla_cfg.kv_lora_rank,
                  qk_nope_head_dim=mla_cfg.qk_nope_head_dim, qk_rope_head_dim=mla_cfg.qk_rope_head_dim,
                  v_head_dim=mla_cfg.v_head_dim)
    return KimiLinearConfig(**kw)


def _t(var):
    return torch.tensor(np.asarray(var[...]))


def _hf_kda(ours: KDA, cfg: KDAConfig):
    layer = hf.KimiLinearDeltaAttention(_hf_config(kda_cfg=cfg), layer_idx=0).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
            getattr(layer, name).weight.copy_(_t(getattr(ours, name).kernel).T)
        layer.forget_gate.f_a_proj.weight.copy_(_t(ours.f_a_proj.kernel).T)
        layer.forget_gate.f_b_proj.weight.copy_(_t(ours.f_b_proj.kernel).T)
        layer.forget_gate.A_log.copy_(_t(ours.A_log).reshape(1, 1, -1, 1))
        layer.forget_gate.dt_bias.copy_(_t(ours.dt_bias))
        layer.o_norm.weight.copy_(_t(ours.o_norm.weight))
        convs = [_t(c.kernel) for c in (ours.q_conv, ours.k_conv, ours.v_conv)]
        layer.conv1d.weight.copy_(torch.cat(convs, dim=1).T[:, None, :])
    if cfg.lower_bound is not None:  # transformers has no safe gate: docs/design.md#kda-gates, in torch
        fg = layer.forget_gate

        def safe_gate(self, x):
            g = self.f_b_proj(self.f_a_proj(x)) + self.dt_bias.view(1, 1, -1)
            g = g.view(*x.shape[:2], -1, self.head_dim)
            return cfg.lower_bound * torch.sigmoid(self.A_log.exp() * g)
        fg.forward = types.MethodType(safe_gate, fg)
    return layer


@pytest.mark.parametrize("impl,lower_bound", [("chunked", None), ("reference", -5.0), ("chunked_aligned", -5.0)])
def test_kda_layer_packed_equals_transformers_per_document(impl, lower_bound):
    cfg = KDAConfig(num_heads=2, head_dim=16, lower_bound=lower_bound, gate_activation=hf_gated_norm_activation())
    ours = KDA(cfg, D, kernel=KDAKernel(impl, chunk_size=16, max_segs=8), rngs=nnx.Rngs(0))
    _randomize(ours, 1)
    batch = packed_batch(ROWS, T, vocab=2)
    x = np.random.default_rng(2).standard_normal((len(ROWS), T, D)).astype(np.float32)
    y = np.asarray(nnx.jit(lambda m, x, s: m(x, s))(ours, jnp.asarray(x), jnp.asarray(batch["inputs_segmentation"])))
    layer = _hf_kda(ours, cfg)
    scale = 0.0
    for b, idx in documents(batch):
        with torch.no_grad():
            ref = layer(torch.tensor(x[b, idx][None]))[0].numpy()
        scale = max(scale, np.abs(ref).max())
        np.testing.assert_allclose(y[b, idx], ref, atol=2e-5 * np.abs(ref).max() + 1e-6, rtol=1e-4)
    assert scale > 0.1
    assert np.all(y[np.asarray(batch["inputs_segmentation"]) == 0] == 0)  # padding: kernel output 0 -> o_proj(0)


def _hf_mla(ours: MLA, cfg: MLAConfig):
    layer = hf.KimiLinearAttention(_hf_config(mla_cfg=cfg), layer_idx=1).eval()
    with torch.no_grad():
        names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + (["q_a_proj", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"])
        for name in names:
            getattr(layer, name).weight.copy_(_t(getattr(ours, name).kernel).T)
        layer.kv_a_layernorm.weight.copy_(_t(ours.kv_a_layernorm.weight))
        if cfg.q_lora_rank:
            layer.q_a_layernorm.weight.copy_(_t(ours.q_a_layernorm.weight))
    return layer


@pytest.mark.parametrize("q_lora_rank,impl", [(None, "flash"), (12, "dot_product")])
def test_nope_mla_packed_equals_transformers_per_document(q_lora_rank, impl):
    cfg = MLAConfig(num_heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=12, rope_type="none")
    ours = MLA(cfg, D, attention_impl=impl, attention_block=16, rngs=nnx.Rngs(0))
    _randomize(ours, 3)
    batch = packed_batch(ROWS, T, vocab=2)
    x = np.random.default_rng(4).standard_normal((len(ROWS), T, D)).astype(np.float32)
    y = np.asarray(nnx.jit(lambda m, x, s, p: m(x, s, p))(ours, jnp.asarray(x), jnp.asarray(batch["inputs_segmentation"]),
                                                         jnp.asarray(batch["inputs_position"])))
    layer = _hf_mla(ours, cfg)
    for b, idx in documents(batch):
        n = len(idx)
        causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        with torch.no_grad():
            ref = layer(torch.tensor(x[b, idx][None]), attention_mask=causal)[0][0].numpy()
        np.testing.assert_allclose(y[b, idx], ref, atol=2e-5 * np.abs(ref).max(), rtol=1e-4)


def test_rope_mla_is_position_relative_under_packing():
    """With RoPE, a document packed at an offset (positions restarting at 0) equals the document alone."""
    cfg = MLAConfig(num_heads=2, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=12, rope_type="rope", partial_rotary_factor=0.5, rope_interleaved=True)
    ours = MLA(cfg, D, rngs=nnx.Rngs(0))
    _randomize(ours, 5)
    run = nnx.jit(lambda m, x, s, p: m(x, s, p))
    batch = packed_batch(ROWS, T, vocab=2)
    single, docs = per_document_batch(batch)
    x = np.random.default_rng(6).standard_normal((len(ROWS), T, D)).astype(np.float32)
    x_single = np.zeros((len(docs), T, D), np.float32)
    for r, (b, idx) in enumerate(docs):
        x_single[r, :len(idx)] = x[b, idx]
    y = np.asarray(run(ours, jnp.asarray(x), jnp.asarray(batch["inputs_segmentation"]), jnp.asarray(batch["inputs_position"])))
    alone = np.asarray(run(ours, jnp.asarray(x_single), jnp.asarray(single["inputs_segmentation"]),
                           jnp.asarray(single["inputs_position"])))
    for r, (b, idx) in enumerate(docs):
        np.testing.assert_allclose(y[b, idx], alone[r, :len(idx)], atol=2e-5, rtol=1e-4)
    gapped = batch["inputs_position"] + 7 * (np.arange(T) >= 10)  # relative distances change across t=10
    moved = np.asarray(run(ours, jnp.asarray(x), jnp.asarray(batch["inputs_segmentation"]), jnp.asarray(gapped)))
    assert np.abs(moved[1] - y[1]).max() > 1e-3  # the check can fail: row 1 is one document spanning t=10
