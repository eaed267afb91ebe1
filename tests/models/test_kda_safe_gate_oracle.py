"""Ling3's lower-bound ("safe") KDA gate against FLA, and a whole KDA layer with it against outside code.

Oracles: FLA's torch reference gates (`naive_kda_lowerbound_gate`, `naive_kda_gate`, taken from
fla/ops/kda/gate.py without its triton import) and FLA's `naive_recurrent_kda`; the rest of the layer
(projections, fused short conv, beta, gated output norm) is transformers' KimiLinearDeltaAttention.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack.kernels.kda import gate
from lingpack.models.ling3 import Ling3
from lingpack.parity import convert
from tests.kernels.kda_cases import fla_gate_functions, fla_naive_module
from tests.models.test_parity_kimi import kimi_like_config
from tests.optional import require

torch = require("torch")
transformers = require("transformers")
H, K = 3, 8


@pytest.fixture(scope="module")
def fla_gates():
    return fla_gate_functions()


@pytest.mark.parametrize("with_a_log,with_dt_bias", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("lower_bound", [-5.0, -1.5])
def test_lower_bound_gate_matches_fla(fla_gates, with_a_log, with_dt_bias, lower_bound):
    rng = np.random.default_rng(0)
    g_raw = (rng.standard_normal((2, 33, H, K)) * 4).astype(np.float32)   # saturates both ends of the sigmoid
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32) if with_a_log else None
    dt_bias = rng.standard_normal(H * K).astype(np.float32) if with_dt_bias else None
    torch_or_none = lambda x: None if x is None else torch.tensor(x)
    ref = fla_gates["naive_kda_lowerbound_gate"](torch.tensor(g_raw), torch_or_none(A_log), torch_or_none(dt_bias),
                                                  lower_bound).numpy()
    ours = np.asarray(gate.lower_bound_gate(g_raw, A_log, dt_bias, lower_bound))
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)
    assert ref.min() < 0.99 * lower_bound and ref.max() > 0.01 * lower_bound   # the whole range is exercised


@pytest.mark.parametrize("with_dt_bias", [True, False])
def test_softplus_gate_matches_fla(fla_gates, with_dt_bias):
    rng = np.random.default_rng(1)
    g_raw = (rng.standard_normal((2, 33, H, K)) * 15).astype(np.float32)   # both sides of softplus's x > 20 switch
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = rng.standard_normal(H * K).astype(np.float32) if with_dt_bias else None
    ref = fla_gates["naive_kda_gate"](torch.tensor(g_raw), torch.tensor(A_log),
                                      None if dt_bias is None else torch.tensor(dt_bias)).numpy()
    np.testing.assert_allclose(np.asarray(gate.softplus_gate(g_raw, A_log, dt_bias)), ref, rtol=1e-6, atol=1e-6)


def _patch_hf_kda(monkeypatch, fla_gates, lower_bound):
    """transformers' KimiLinear KDA layer with FLA's lower-bound gate and FLA's naive recurrence as its kernel.

    Returns the list that collects every gate tensor the kernel receives."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf
    naive = fla_naive_module()
    seen_gates = []

    def forget_gate(self, x):
        g_raw = self.f_b_proj(self.f_a_proj(x)).view(*x.shape[:2], -1, self.head_dim)
        return fla_gates["naive_kda_lowerbound_gate"](g_raw, self.A_log, self.dt_bias, lower_bound)

    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
        assert use_qk_l2norm_in_kernel and initial_state is None
        seen_gates.append(g)
        return naive.naive_recurrent_kda(hf.l2norm(q, dim=-1, eps=1e-6), hf.l2norm(k, dim=-1, eps=1e-6), v, g, beta,
                                         output_final_state=output_final_state)
    monkeypatch.setattr(hf.KimiLinearForgetGate, "forward", forget_gate)
    monkeypatch.setattr(hf, "chunk_kimi_delta_attention", kernel)
    return seen_gates


def test_kda_layer_with_lower_bound_gate_matches_fla_per_document(monkeypatch, fla_gates):
    """One packed row through a KDA layer (safe gate) == each document alone through FLA-gate + FLA-kernel KDA."""
    base = kimi_like_config(num_layers=1, inhomogeneous_layer_cycle_interval=2, mtp_num_layers=0)
    cfg = dataclasses.replace(base, kda=dataclasses.replace(base.kda, lower_bound=-5.0))
    model = Ling3(cfg, rngs=nnx.Rngs(0))
    key = jax.random.key(1)
    for _, var in nnx.iter_graph(model):   # O(1) activations; dt_bias spread so gates cover (-5, 0)
        if isinstance(var, nnx.Param) and var.ndim >= 2:
            key, sub = jax.random.split(key)
            var[...] = jax.random.normal(sub, var.shape) / np.sqrt(var.shape[-2])
    model.layers[0].self_attn.dt_bias[...] = 2.0 * jax.random.normal(key, model.layers[0].self_attn.dt_bias.shape)
    seen_gates = _patch_hf_kda(monkeypatch, fla_gates, -5.0)
    hf_model = transformers.KimiLinearForCausalLM(convert.kimi_config_from_ling3(base)).eval()   # softplus-free: patched
    hf_model.load_state_dict({k: torch.tensor(v) for k, v in convert.to_hf_state_dict(model).items()}, strict=True)

    lengths, T = [1, 37, 70, 12], 130   # a length-1 document, one spanning KDA chunks, then padding
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
    seg = np.zeros((1, T), np.int32)
    pos = np.zeros((1, T), np.int32)
    start = 0
    for i, n in enumerate(lengths):
        seg[0, start:start + n], pos[0, start:start + n] = i + 1, np.arange(n)
        start += n
    ours = np.asarray(nnx.jit(lambda m, x, s, p: m(x, s, p).logits_BTV)(model, tokens, seg, pos))
    start = 0
    for n in lengths:
        with torch.no_grad():
            doc = torch.tensor(tokens[:, start:start + n], dtype=torch.long)
            ref = hf_model(doc, use_cache=False).logits[0].numpy()
        np.testing.assert_allclose(ours[0, start:start + n], ref, atol=1e-5 * np.abs(ref).max(), rtol=1e-5)
        start += n
    assert len(seen_gates) == len(lengths)   # the patched FLA path really ran, once per document
    assert np.std(ours[seg > 0]) > 0.3 and min(float(g.min()) for g in seen_gates) < -4.0   # O(1), near the bound
