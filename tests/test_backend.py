"""The backend target: what every backend-dependent choice reads instead of jax.default_backend()."""
import jax
import jax.numpy as jnp
import pytest

from lingpack import backend
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


def test_splash_traced_for_tpu_lowers_to_mosaic_not_interpret_mode():
    q = jnp.zeros((1, 256, 2, 128), jnp.float32)
    seg = jnp.ones((1, 256), jnp.int32)
    f = lambda q: attention(q, q, q, segment_ids_BT=seg, impl="splash")
    assert "tpu_custom_call" not in jax.jit(f).lower(q).as_text()   # CPU host, no target: interpret mode
    with backend.target("tpu"):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(q).mlir_module()
    assert "tpu_custom_call" in text
