"""Norms, RoPE and the segment-masked short conv against transformers / torch implementations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack import backend
from lingpack.kernels import mosaic
from lingpack.models.layers import (GatedRMSNorm, RMSNorm, ShortConvolution, apply_rope, segment_causal_conv,
                                    short_conv)
from packing_cases import documents, packed_batch
from tests.optional import lazy, require

torch = lazy("torch")
hf = lazy("transformers.models.kimi_linear.modeling_kimi_linear")
rng = np.random.default_rng(0)


def test_rmsnorm_matches_transformers():
    x = rng.standard_normal((2, 5, 16)).astype(np.float32) * 3
    w = rng.standard_normal(16).astype(np.float32)
    ref_mod = hf.KimiLinearRMSNorm(16, eps=1e-6)
    ref_mod.weight.data = torch.tensor(w)
    ours = RMSNorm(16, eps=1e-6)
    ours.weight[...] = jnp.asarray(w)
    np.testing.assert_allclose(ours(jnp.asarray(x)), ref_mod(torch.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_gated_rmsnorm_matches_transformers(activation):
    x, gate = (rng.standard_normal((2, 5, 3, 8)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(8).astype(np.float32)
    ref_mod = hf.KimiLinearRMSNormGated(8, eps=1e-5)
    ref_mod.weight.data = torch.tensor(w)
    ref_mod.activation = activation
    ours = GatedRMSNorm(8, eps=1e-5, activation=activation)
    ours.weight[...] = jnp.asarray(w)
    ref = ref_mod(torch.tensor(x), torch.tensor(gate)).detach().numpy()
    np.testing.assert_allclose(ours(jnp.asarray(x), jnp.asarray(gate)), ref, rtol=1e-5, atol=1e-6)


def _cos_sin(positions, dim, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.tensor(positions, dtype=torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def test_rope_half_split_matches_llama():
    apply_rotary_pos_emb = require("transformers.models.llama.modeling_llama").apply_rotary_pos_emb
    x = rng.standard_normal((2, 7, 3, 16)).astype(np.float32)
    pos = np.array([[0, 1, 2, 0, 1, 0, 5], [3, 4, 5, 6, 7, 8, 9]])   # restarting per document
    cos, sin = _cos_sin(pos, 16)
    ref, _ = apply_rotary_pos_emb(torch.tensor(x), torch.tensor(x), cos, sin, unsqueeze_dim=2)
    np.testing.assert_allclose(apply_rope(jnp.asarray(x), jnp.asarray(pos), interleaved=False), ref.numpy(), atol=1e-5)


def test_rope_interleaved_partial_matches_deepseek():
    """DeepSeek's interleaved pairs; transformers returns them de-interleaved (evens then odds), a fixed
    permutation shared by q and k, so we compare after applying it. Features past rotary_dim pass through."""
    apply_rotary_pos_emb_interleave = require(
        "transformers.models.deepseek_v3.modeling_deepseek_v3").apply_rotary_pos_emb_interleave
    x = rng.standard_normal((2, 7, 3, 16)).astype(np.float32)
    pos = np.array([[0, 1, 2, 0, 1, 0, 5], [30, 4, 5, 6, 7, 8, 900]])
    cos, sin = _cos_sin(pos, 8)
    ref, _ = apply_rotary_pos_emb_interleave(torch.tensor(x[..., :8]), torch.tensor(x[..., :8]), cos, sin, unsqueeze_dim=2)
    ours = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), rotary_dim=8, interleaved=True))
    np.testing.assert_allclose(np.concatenate([ours[..., 0:8:2], ours[..., 1:8:2]], -1), ref.numpy(), atol=1e-4)
    np.testing.assert_array_equal(ours[..., 8:], x[..., 8:])


def test_short_conv_matches_torch_per_document_and_tap_order():
    """Packed segment-masked conv == torch's causal depthwise Conv1d run on each document alone.

    The torch weight converts by a plain transpose: `kernel[K-1]` is the current token's tap."""
    C, K = 6, 4
    batch = packed_batch([[5, 1, 9, 3], [20]], 20, vocab=2)
    seg = batch["inputs_segmentation"]
    x = rng.standard_normal(seg.shape + (C,)).astype(np.float32)
    conv = torch.nn.Conv1d(C, C, K, groups=C, bias=False, padding=K - 1)
    kernel_KC = conv.weight.detach().numpy()[:, 0, :].T
    ours = np.asarray(segment_causal_conv(jnp.asarray(x), jnp.asarray(kernel_KC), jnp.asarray(seg)))
    for b, idx in documents(batch):
        with torch.no_grad():
            ref = conv(torch.tensor(x[b, idx].T[None]))[0, :, :len(idx)].T.numpy()
        np.testing.assert_allclose(ours[b, idx], ref, atol=1e-5)
    # tap order: a unit impulse at t=0 shows kernel[K-1] at t=0, kernel[K-2] at t=1, ...
    impulse = jnp.zeros((1, 8, C)).at[0, 0].set(1.0)
    out = segment_causal_conv(impulse, jnp.asarray(kernel_KC), None)
    np.testing.assert_allclose(out[0, :K], kernel_KC[::-1], atol=1e-7)


def test_short_conv_vjp_matches_torch_autograd_per_document():
    """The conv + SiLU's own VJP (which keeps only its inputs) == torch autograd of Conv1d + SiLU on each
    document alone: dx per document and d_kernel summed over documents; without SiLU and segments, == autodiff."""
    C, K = 6, 4
    batch = packed_batch([[5, 1, 9, 3], [20]], 20, vocab=2)
    seg = jnp.asarray(batch["inputs_segmentation"])
    x = rng.standard_normal(seg.shape + (C,)).astype(np.float32)
    d_out = rng.standard_normal(x.shape).astype(np.float32) * (np.asarray(seg) > 0)[..., None]  # padding: no loss
    conv = torch.nn.Conv1d(C, C, K, groups=C, bias=False, padding=K - 1)
    kernel_KC = jnp.asarray(conv.weight.detach().numpy()[:, 0, :].T)
    out, vjp = jax.vjp(lambda x, w: short_conv(x, w, seg, "silu"), jnp.asarray(x), kernel_KC)
    dx, d_kernel = vjp(jnp.asarray(d_out))
    d_weight = np.zeros((C, K), np.float32)
    for b, idx in documents(batch):
        x_doc = torch.tensor(x[b, idx].T[None], requires_grad=True)
        y = torch.nn.functional.silu(conv(x_doc)[0, :, :len(idx)].T)
        y.backward(torch.tensor(d_out[b, idx]))
        np.testing.assert_allclose(out[b, idx], y.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(dx[b, idx], x_doc.grad[0].T.numpy(), atol=1e-5)
        d_weight += conv.weight.grad[:, 0].numpy()
        conv.weight.grad = None
    np.testing.assert_allclose(d_kernel, d_weight.T, atol=1e-5)
    plain = jax.vjp(lambda x, w: segment_causal_conv(x, w, None), jnp.asarray(x), kernel_KC)[1](jnp.asarray(d_out))
    own = jax.vjp(lambda x, w: short_conv(x, w, None, None), jnp.asarray(x), kernel_KC)[1](jnp.asarray(d_out))
    for a, b in zip(own, plain):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_short_conv_vjp_keeps_only_inputs():
    """Six stacked conv + SiLU layers at the flagship's q/k/v width (2048 channels, T=8192), compiled by XLA:TPU
    for one v5p chip: its temporaries for the gradient hold 9.0 activation-sized arrays with the own VJP (each
    layer's input, and the backward's working set) against 17.0 with autodiff (each layer's shifted, masked
    copies and SiLU operands too); bound 0.6x. (At T=1024 x 64 XLA:TPU plans no temporaries for either.)"""
    T, C, K = 8192, 2048, 4

    def stack(conv):
        def loss(x, kernels, seg):
            for kernel in kernels:
                x = conv(x, kernel, seg)
            return 0.5 * jnp.sum(x * x)   # a cotangent that depends on the forward, as a model's loss
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    chip = jax.sharding.SingleDeviceSharding(mosaic.one_chip("v5p"))
    args = (jax.ShapeDtypeStruct((1, T, C), jnp.float32, sharding=chip),
            [jax.ShapeDtypeStruct((K, C), jnp.float32, sharding=chip)] * 6,
            jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=chip))

    def temp(fn):
        with backend.target("tpu"):
            lowered = fn.lower(*args)
        return lowered.compile().memory_analysis().temp_size_in_bytes / (T * C * 4)
    own = temp(stack(lambda x, w, seg: short_conv(x, w, seg, "silu")))
    autodiff = temp(stack(lambda x, w, seg: jax.nn.silu(segment_causal_conv(x, w, seg))))
    assert own < 0.6 * autodiff, (own, autodiff)


def test_short_conv_module_silu_and_sharding():
    conv = ShortConvolution(6, 4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 5, 6))
    np.testing.assert_allclose(conv(x), jax.nn.silu(segment_causal_conv(x, conv.kernel[...], None)), atol=1e-6)
    assert conv.kernel.get_metadata()["out_sharding"] == ("conv", "heads")
