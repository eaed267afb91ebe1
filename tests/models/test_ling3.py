"""Whole-model packing invariance, no leakage, configs: for every KDA kernel and attention implementation."""
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from lingpack.models import mtp
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config, config_from_dict, count_active_params, count_params
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from packing_cases import documents, packed_batch, pad_rows, per_document_batch
from tests.kernels.kda_cases import rms_ratio

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
ROWS, T = [[5, 1, 20, 16], [48], [1, 30], []], 48   # length-1 docs, a doc of exactly one chunk, padding rows
MTP_SCALE, Z_COEF = 0.1, 1e-3


def packing_config(kda_impl, attention_impl) -> Ling3Config:
    """KDA (safe gate) + dense, then MLA (q LoRA, partial interleaved RoPE) + MoE (groups), one MoE MTP layer."""
    return Ling3Config(
        vocab_size=64, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, first_dense_layers=1,
        mlp_dim=48, mtp_num_layers=1, kda_impl=kda_impl, kda_chunk_size=16, kda_max_segs=8,
        attention_impl=attention_impl, attention_block_size=16 if attention_impl == "flash" else 128,
        kda=KDAConfig(num_heads=2, head_dim=16, lower_bound=-5.0),
        mla=MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, rope_type="rope", partial_rotary_factor=0.5, rope_interleaved=True),
        moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, n_groups=2, topk_groups=1, routed_scaling_factor=2.5))


def per_token_losses(out, batch):
    """Main + MTP_SCALE * MTP cross-entropy per position [B, T] (masked), each charged to position t's document."""
    def xent(logits, tgt):
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tgt[..., None], -1)[..., 0]
    total = xent(out.logits_BTV, batch["targets"]) * (batch["targets_segmentation"] != 0)
    for d, logits in enumerate(out.mtp_logits):
        tgt, mask = mtp.mtp_targets(batch["targets"], batch["targets_segmentation"], d, batch["inputs_segmentation"])
        total = total + MTP_SCALE * xent(logits, tgt) * mask
    return total


@functools.lru_cache(maxsize=None)
def compiled(kda_impl, attention_impl):
    """(params, f) with f(params, delta_BTD, batch, token_weights_BT, z_weight, norm) -> ((loss, out), grads).

    One compiled function serves both tests: the loss is sum(token_weights * per-token loss) + z_weight *
    z-loss, over `norm`; `delta` is added to the input embeddings so its gradient is d loss / d embeddings.
    """
    model = Ling3(packing_config(kda_impl, attention_impl), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, delta, batch, weights, z_weight, norm):
        model = nnx.merge(graphdef, params, rest)
        emb = model.embed_tokens(batch["inputs"]) + delta
        out = model(batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"], input_embeddings_BTD=emb)
        total = jnp.sum(weights * per_token_losses(out, batch)) + z_weight * jnp.sum(out.moe_aux["router_z_loss"])
        return total / norm, out

    return params, jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _run(kda_impl, attention_impl, batch, weights, z_weight, norm):
    params, f = compiled(kda_impl, attention_impl)
    B, T = batch["inputs"].shape
    delta = jnp.zeros((B, T, packing_config(kda_impl, attention_impl).emb_dim))
    return f(params, delta, {k: jnp.asarray(v) for k, v in batch.items()}, jnp.asarray(weights, jnp.float32),
             z_weight, norm)


COMBOS = [("reference", "splash"), ("chunked", "flash"), ("chunked_aligned", "dot_product")]


@pytest.mark.parametrize("kda_impl,attention_impl", COMBOS)
def test_packed_equals_per_document(kda_impl, attention_impl):
    """Logits, loss (main + MTP + z-loss), expert loads and every gradient equal the per-document run."""
    packed = packed_batch(ROWS, T, vocab=64)
    single, docs = per_document_batch(packed, num_rows=len(ROWS))
    R = max(len(ROWS), len(docs))
    packed, single = pad_rows(packed, R), pad_rows(single, R)   # one shape, one compile
    norm = float((packed["targets_segmentation"] != 0).sum())
    (loss_p, out_p), (grads_p, _) = _run(kda_impl, attention_impl, packed, np.ones((R, T)), Z_COEF, norm)
    (loss_s, out_s), (grads_s, _) = _run(kda_impl, attention_impl, single, np.ones((R, T)), Z_COEF, norm)

    for r, (b, idx) in enumerate(docs):
        n = len(idx)
        np.testing.assert_allclose(out_p.logits_BTV[b, idx], out_s.logits_BTV[r, :n], atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(out_p.mtp_logits[0][b, idx], out_s.mtp_logits[0][r, :n], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(loss_p, loss_s, rtol=1e-5)
    np.testing.assert_array_equal(out_p.moe_aux["load_counts"], out_s.moe_aux["load_counts"])
    np.testing.assert_allclose(out_p.moe_aux["router_z_loss"], out_s.moe_aux["router_z_loss"], rtol=1e-5)
    flat_p, flat_s = nnx.to_flat_state(grads_p), dict(nnx.to_flat_state(grads_s))
    assert len(flat_p) > 30
    for path, g in flat_p:
        g, ref = np.asarray(g[...]), np.asarray(flat_s[path][...])
        scale = max(np.abs(ref).max(), 1e-3)
        np.testing.assert_allclose(g, ref, atol=1e-5 * scale, rtol=1e-4, err_msg=str(path))


@functools.lru_cache(maxsize=None)
def leakage(kda_impl, attention_impl):
    """(max |d loss_A / d emb_B|, min over documents of max |d loss_A / d emb_A|) over all pairs A != B."""
    batch = packed_batch(ROWS, T, vocab=64)
    batch = pad_rows(batch, max(len(ROWS), len(documents(batch))))  # the packing test's shape: no recompile
    docs = documents(batch)
    outside, inside = 0.0, np.inf
    for b, idx in docs:
        mine = np.zeros(batch["inputs"].shape, bool)
        mine[b, idx] = True
        _, (_, d_emb) = _run(kda_impl, attention_impl, batch, mine, 0.0, 1.0)
        d_emb = np.asarray(d_emb)
        outside = max(outside, float(np.abs(d_emb[~mine]).max()))
        inside = min(inside, float(np.abs(d_emb[mine]).max()))
    return outside, inside


@pytest.mark.parametrize("kda_impl,attention_impl", [
    ("reference", "splash"), ("chunked", "flash"), ("chunked_aligned", "dot_product")])
def test_no_leakage_between_documents(kda_impl, attention_impl):
    """d(loss of document A) / d(embeddings of any other document or padding) is exactly zero."""
    outside, inside = leakage(kda_impl, attention_impl)
    assert inside > 0  # the check can fail: every document sees its own inputs
    assert outside == 0.0, f"documents leak: max |grad| outside the document = {outside}"


def test_layer_pattern_and_outputs():
    cfg = Ling3Config(num_layers=8, inhomogeneous_layer_cycle_interval=4, first_dense_layers=1)
    assert cfg.layer_kinds() == [("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe")] * 1 + [
        ("kda", "moe"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe")]
    assert count_active_params(packing_config("chunked", "dot_product")) < count_params(packing_config("chunked", "dot_product"))


def test_config_from_dict_errors_name_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['emb_size'\].*valid keys.*emb_dim"):
        config_from_dict({"emb_size": 3})
    with pytest.raises(ValueError, match=r"\['experts'\] in model\.moe; valid keys.*num_experts"):
        config_from_dict({"moe": {"experts": 3}})
    with pytest.raises(ValueError, match="attention_impl"):
        config_from_dict({"attention_impl": "ring"})
    with pytest.raises(ValueError, match="kda_max_segs"):
        config_from_dict({"kda_impl": "chunked_aligned"})
    with pytest.raises(ValueError, match="model.norm_eps must be a number"):
        config_from_dict({"norm_eps": "tiny"})
    cfg = config_from_dict({"norm_eps": "1e-5", "moe": {"routed_scaling_factor": 2}, "kda": {"lower_bound": None}})
    assert cfg.norm_eps == 1e-5 and cfg.moe.routed_scaling_factor == 2.0 and cfg.kda.lower_bound is None


# (layers, KDA layers, width, vocab, experts, compute dtype) each YAML promises in its header comment
MODEL_YAMLS = {"ling3_tiny": (4, 3, 64, 384, 4, "float32"), "ling3_small": (8, 6, 512, 157184, 16, "bfloat16"),
               "ling3_flagship": (24, 18, 1536, 157184, 128, "bfloat16")}


@pytest.mark.parametrize("name", sorted(MODEL_YAMLS))
def test_conf_model_yaml_builds(name, capsys):
    from lingpack.config import KernelConfig, model_config
    # the bundled data's 258-token vocabulary: a `vocab_size: null` model follows it, padded to 384
    cfg = model_config(yaml.safe_load((CONF / f"{name}.yaml").read_text()), KernelConfig(), data_vocab_size=258)
    layers, kda_layers, width, vocab, experts, dtype = MODEL_YAMLS[name]
    print(f"{name}: {count_params(cfg) / 1e6:.2f}M parameters, {count_active_params(cfg) / 1e6:.2f}M active")
    kinds = cfg.layer_kinds()
    assert (len(kinds), sum(m == "kda" for m, _ in kinds), cfg.emb_dim, cfg.vocab_size) == (layers, kda_layers, width, vocab)
    assert (cfg.moe.num_experts, cfg.dtype, cfg.kda.lower_bound, cfg.mla.rope_type) == (experts, dtype, -5.0, "rope")
    num_moe = sum(f == "moe" for _, f in kinds) + cfg.mtp_num_layers
    outputs = lambda m, x: (lambda out: (out.logits_BTV, out.mtp_logits, out.moe_aux))(m(x, x, x))
    if name == "ling3_tiny":  # small enough to run
        model = Ling3(cfg, rngs=nnx.Rngs(0))
        logits, mtp_logits, moe_aux = nnx.jit(outputs)(model, jnp.ones((2, 16), jnp.int32))
        assert np.isfinite(np.asarray(logits)).all()
    else:  # shape-checked only: the whole forward traced, never run
        model = nnx.eval_shape(lambda: Ling3(cfg, rngs=nnx.Rngs(0)))
        logits, mtp_logits, moe_aux = nnx.eval_shape(outputs, model, jax.ShapeDtypeStruct((2, 16), jnp.int32))
    assert logits.shape == (2, 16, vocab) and logits.dtype == jnp.float32
    assert len(mtp_logits) == cfg.mtp_num_layers == 1 and moe_aux["load_counts"].shape == (num_moe, experts)


def test_bfloat16_compute_tracks_fp32():
    """bf16 compute (fp32 params, fp32 logits) against the same weights in fp32, by FLA's RMS-ratio metric.

    Measured: logits 0.0074, all gradients together 0.013, the worst single parameter 0.022."""
    batch = {k: jnp.asarray(v) for k, v in packed_batch(ROWS, T, vocab=64).items()}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = Ling3(dataclasses.replace(packing_config("chunked", "dot_product"), dtype=dtype), rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            out = nnx.merge(graphdef, params, rest)(batch["inputs"], batch["inputs_segmentation"],
                                                    batch["inputs_position"])
            return jnp.sum(per_token_losses(out, batch)), out
        runs[dtype] = (params, *jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
    (p32, (_, out32), g32), (p16, (_, out16), g16) = runs["float32"], runs["bfloat16"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p16))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), p32, p16)))   # the same weights
    assert out16.logits_BTV.dtype == jnp.float32 and out16.mtp_logits[0].dtype == jnp.float32
    assert rms_ratio(out32.logits_BTV, out16.logits_BTV) < 0.02
    assert rms_ratio(out32.mtp_logits[0], out16.mtp_logits[0]) < 0.02
    flat32, flat16 = dict(nnx.to_flat_state(g32)), dict(nnx.to_flat_state(g16))
    assert flat32.keys() == flat16.keys()
    for path in flat32:
        assert rms_ratio(flat32[path][...], np.asarray(flat16[path][...], np.float32)) < 0.05, path
    every = lambda flat: np.concatenate([np.ravel(np.asarray(flat[p][...], np.float32)) for p in sorted(flat, key=str)])
    assert rms_ratio(every(flat32), every(flat16)) < 0.03


@pytest.mark.slow
def test_remat_gives_identical_gradients():
    batch = {k: jnp.asarray(v) for k, v in packed_batch(ROWS, T, vocab=64).items()}
    grads = []
    for remat in (False, True):
        model = Ling3(dataclasses.replace(packing_config("chunked", "dot_product"), remat=remat), rngs=nnx.Rngs(0))
        loss = lambda m: jnp.mean(per_token_losses(m(batch["inputs"], batch["inputs_segmentation"],
                                                     batch["inputs_position"]), batch))
        grads.append(nnx.jit(nnx.grad(loss))(model))
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads[0]), nnx.to_flat_state(grads[1])):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_head_matmul_gradients_are_autodiffs(monkeypatch):
    """`head_matmul`'s hand-written VJP against autodiff of a plain matmul: alone (any leading axes; a weight
    that is a transposed table, as with tied embeddings) and as the head of a model (main + MTP logits)."""
    from lingpack.models import head as head_lib
    keys = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(keys[1], (33, 16))
    for lead in [(7,), (2, 5), (2, 3, 4)]:
        h, g = jax.random.normal(keys[0], (*lead, 16)), jax.random.normal(keys[2], (*lead, 33))
        ours = jax.jit(lambda h, e: jax.vjp(lambda h, e: head_lib.head_matmul(h, e.T), h, e)[1](g))(h, table)
        ref = jax.vjp(lambda h, e: h @ e.T, h, table)[1](g)
        for a, b in zip(ours, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    cfg = dataclasses.replace(packing_config("chunked", "dot_product"), num_layers=1, inhomogeneous_layer_cycle_interval=1)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(ROWS, T, vocab=64).items()}  # one MLA layer + MTP: fast
    loss = lambda m: jnp.mean(per_token_losses(m(batch["inputs"], batch["inputs_segmentation"],
                                                 batch["inputs_position"]), batch))
    grads = [nnx.jit(nnx.grad(loss))(Ling3(cfg, rngs=nnx.Rngs(0)))]
    monkeypatch.setattr(head_lib, "head_matmul", jnp.matmul)  # autodiff's head
    grads.append(nnx.jit(nnx.grad(loss))(Ling3(cfg, rngs=nnx.Rngs(0))))
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads[0]), nnx.to_flat_state(grads[1])):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5, atol=1e-7, err_msg=str(path))
