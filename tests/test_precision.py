"""lingpack.precision: the accumulation rule, JAX's x64 mode per run, and the one-line float64 refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack import precision
from lingpack.errors import ConfigError


def test_precision_choices_follow_only_a_wider_dtype():
    assert precision.at_least_fp32(jnp.bfloat16) == precision.at_least_fp32("float32") == jnp.float32
    assert precision.at_least_fp32(jnp.bfloat16, jnp.float32) == jnp.float32
    assert precision.at_least_fp32(jnp.float32, np.float64) == precision.at_least_fp32("float64") == np.float64
    assert precision.at_least_fp32(np.zeros(2, np.float64)) == np.float64   # arrays give their dtype
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        precision.as_dtype("fp64")


def test_x64_is_set_for_the_block_and_restored():
    before = bool(jax.config.jax_enable_x64)
    with precision.x64(True):
        assert jnp.zeros(2, jnp.float64).dtype == jnp.float64
        with precision.x64(False):
            assert not jax.config.jax_enable_x64
        assert jax.config.jax_enable_x64
    assert bool(jax.config.jax_enable_x64) == before


def test_float64_refused_in_one_line_without_x64_or_without_float64_arithmetic(monkeypatch):
    with precision.x64(False), pytest.raises(ConfigError, match="model.dtype=float64 needs JAX's x64 mode") as err:
        precision.check_float64()
    assert "\n" not in str(err.value)
    with precision.x64(True):
        precision.check_float64()   # CPU computes in float64
        # a backend that rounds float64 arithmetic to float32 (what a silent downcast would look like)
        monkeypatch.setattr(precision.jnp, "ones", lambda shape, dtype: np.ones(shape, np.float32))
        with pytest.raises(ConfigError, match=r"computed 1 \+ 2\^-40 as 1 \+ 0.0 in float32") as err:
            precision.check_float64()
        assert "\n" not in str(err.value)


def test_float64_model_refuses_the_fp32_tpu_kernels():
    from lingpack import config as config_lib
    from lingpack.kernels.kda import api
    from lingpack.models.ling3 import Ling3Config
    with pytest.raises(ValueError, match="a float64 model needs kernel=chunked or kernel=reference"):
        Ling3Config(dtype="float64", kda_impl="pallas_segment")
    for kernel in ("splash", "pallas_triton"):
        with pytest.raises(ValueError, match="a float64 model needs model.attention_impl=dot_product, flash or auto"):
            Ling3Config(param_dtype="float64", attention_impl=kernel)
    Ling3Config(dtype="float64", attention_impl="auto")   # auto resolves to flash for float64 inputs
    with pytest.raises(ConfigError, match="^model: kda_impl='pallas_segment' is a TPU kernel"):
        config_lib.model_config({"dtype": "float64"}, config_lib.KernelConfig(name="pallas_segment"), 512)
    with precision.x64(True):
        x = jnp.zeros((1, 16, 1, 16), jnp.float64)
        with pytest.raises(ValueError, match="impl='pallas_segment' is a TPU kernel computing in fp32"):
            api.chunk_kda(x, x, x, x, jnp.zeros((1, 16, 1), jnp.float64), impl="pallas_segment")


def test_a_run_enables_x64_from_its_config_and_restores_it(monkeypatch, tmp_path):
    """experiment.run: x64 on from model/optim dtypes before the run makes an array, off again after; a backend
    without float64 stops the run with the one-line ConfigError before training."""
    from lingpack import experiment
    seen = []
    monkeypatch.setattr(experiment, "_train_and_report", lambda rc, *a: seen.append(
        (rc.model.dtype, bool(jax.config.jax_enable_x64))) or {})
    plain = {"name": "x", "data": {"source": "synthetic"}, "logger": {"kind": "none"}, "checkpoint": {"enabled": False}}
    before = bool(jax.config.jax_enable_x64)
    experiment.run(plain, str(tmp_path / "a"))
    experiment.run({**plain, "model": {"dtype": "float64", "param_dtype": "float64"},
                    "optim": {"master_dtype": "float64"}}, str(tmp_path / "b"))
    assert seen == [("float32", False), ("float64", True)] and bool(jax.config.jax_enable_x64) == before

    def no_float64(key="model.dtype"):
        raise ConfigError(f"{key}=float64: the tpu backend cannot compute in float64")
    monkeypatch.setattr(precision, "check_float64", no_float64)
    with pytest.raises(ConfigError, match="cannot compute in float64"):
        experiment.run({**plain, "optim": {"master_dtype": "float64"}}, str(tmp_path / "c"))
    assert len(seen) == 2 and bool(jax.config.jax_enable_x64) == before
