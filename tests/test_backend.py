"""The backend target: what every backend-dependent choice reads instead of jax.default_backend()."""
import jax
import jax.numpy as jnp
import pytest

from lingpack import backend
from lingpack.plan import hlo
from lingpack.errors import ConfigError
from lingpack.kernels.attention.api import attention


def test_target_overrides_the_default_backend_and_nests():
    assert backend.current() == jax.default_backend() == "cpu"
    with backend.target("tpu"):
        assert backend.current() == "tpu"
        with backend.target("cuda"):
            assert backend.current() == "gpu"
        assert backend.current() == "tpu"
    assert backend.current() == "cpu"


def test_unknown_platform_is_a_config_error():
    with pytest.raises(ConfigError, match="'metal'.*cpu"):
        with backend.target("metal"):
            pass


def test_pallas_interpret_is_only_what_was_asked_or_the_cpu_default():
    ask = lambda requested: backend.pallas_interpret(requested, kernel="k", alternative="the other kernel")
    assert ask(None) is True and ask(False) is False and ask(True) is True
    with backend.target("tpu"):
        assert ask(None) is False and ask(True) is True
    with backend.target("gpu"):
        assert ask(True) is True       # the user asked for emulation
        with pytest.raises(ConfigError, match="use the other kernel on GPU"):
            ask(None)


def test_interpret_mode_on_cpu_is_one_warning_per_kernel(monkeypatch, caplog):
    monkeypatch.setattr(backend, "_WARNED", set())
    with caplog.at_level("WARNING", logger="lingpack"):
        for _ in range(3):  # every trace of the step asks again
            assert backend.pallas_interpret(None, kernel="the K kernel", alternative="kernel=chunked") is True
        backend.pallas_interpret(True, kernel="the J kernel", alternative="x")    # asked for: no warning
        with backend.target("tpu"):
            backend.pallas_interpret(None, kernel="the J kernel", alternative="x")  # the real kernel
    assert [r.getMessage() for r in caplog.records] == [
        "the K kernel has no CPU lowering: it runs in Pallas interpret mode, an op-by-op emulation meant for tests "
        "and far slower than a kernel; on CPU use kernel=chunked (set kernel.interpret=true to emulate it without "
        "this warning)"]


def test_splash_traced_for_tpu_lowers_to_mosaic_not_interpret_mode():
    q = jnp.zeros((1, 256, 2, 128), jnp.float32)
    seg = jnp.ones((1, 256), jnp.int32)
    f = lambda q: attention(q, q, q, segment_ids_BT=seg, impl="splash")
    assert "tpu_custom_call" not in jax.jit(f).lower(q).as_text()   # CPU host, no target: interpret mode
    with backend.target("tpu"):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(q).mlir_module()
    assert "tpu_custom_call" in text


def _lowered_for(platform, f, *args) -> str:
    waived = [jax.export.DisabledSafetyCheck.custom_call(hlo.TRITON_CALL)]
    with backend.target(platform):
        return jax.export.export(jax.jit(f), platforms=[{"gpu": "cuda"}.get(platform, platform)],
                                 disabled_checks=waived)(*args).mlir_module()


def test_auto_attention_is_each_platforms_kernel():
    """auto: splash (Mosaic) on TPU, pallas_triton (Triton) on GPU, flash (plain XLA) on CPU, as lowered."""
    from lingpack.kernels.attention.api import AUTO, resolve
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    f = lambda q, s: attention(q, q, q, segment_ids_BT=s, impl="auto")
    kernels = {}
    for platform in ("tpu", "gpu", "cpu"):
        with backend.target(platform):
            kernels[platform] = resolve("auto")
        module = _lowered_for(platform, f, q, seg)
        lowered = (bool(hlo.mosaic_calls(module)), bool(hlo.triton_calls(module)))
        assert lowered == (platform == "tpu", platform == "gpu"), platform
    assert kernels == AUTO == {"tpu": "splash", "gpu": "pallas_triton", "cpu": "flash"}


@pytest.mark.parametrize("platform,impl,names", [
    ("gpu", "splash", "model.attention_impl=auto"),
    ("tpu", "pallas_triton", "model.attention_impl=auto"),
    ("gpu", "pallas_segment", "kernel=chunked"),
])
def test_a_kernel_of_the_other_accelerator_is_a_one_line_config_error(platform, impl, names):
    from lingpack.kernels.kda.api import chunk_kda
    q = jnp.zeros((1, 128, 2, 64), jnp.float32)
    seg = jnp.ones((1, 128), jnp.int32)
    if impl == "pallas_segment":
        run = lambda: chunk_kda(q, q, q, -jnp.ones_like(q), jnp.ones((1, 128, 2)), segment_ids=seg, impl=impl)
    else:
        run = lambda: attention(q, q, q, segment_ids_BT=seg, impl=impl)
    with backend.target(platform), pytest.raises(ConfigError) as err:
        jax.eval_shape(run)
    message = str(err.value)
    assert names in message and f"no {platform.upper()} lowering" in message and "\n" not in message


def test_moe_grouped_matmul_auto_is_ragged_dot_only_on_tpu():
    """XLA expands ragged_dot into E dense dots on CPU and (without an experimental flag) on GPU: tiled there."""
    from flax import nnx
    from lingpack.models.moe import MoE, MoEConfig
    moe = MoE(MoEConfig(num_experts=4, top_k=2, expert_dim=16), 32, rngs=nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    graphdef, state = nnx.split(moe)
    f = lambda state, x: nnx.merge(graphdef, state)(x)[0]
    for platform, ragged in (("tpu", True), ("gpu", False)):
        with backend.target(platform):
            text = str(jax.make_jaxpr(f)(state, x))
        assert ("ragged_dot" in text) == ragged, platform
