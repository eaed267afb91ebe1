"""Restoring a checkpoint into a model of other shapes names the parameters and the likely cause
(Orbax's own error names neither), e.g. a vocabulary padded for another parallel.tensor."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from lingpack.config import ConfigError
from lingpack.train.checkpoint import Checkpointer
from lingpack.train.configs import CheckpointConfig
from lingpack.train.step import TrainState


def state(vocab: int, out: str = "out") -> TrainState:
    return TrainState(step=jnp.int32(2), updates=jnp.int32(2),
                      params={"embed": jnp.ones((vocab, 3)), out: jnp.ones(3)}, rest={"bias": jnp.zeros(2)},
                      opt_state={"mu": jnp.zeros(3)}, rng=jnp.zeros(2, jnp.uint32))


def test_restore_into_other_shapes_names_the_parameter_and_the_fix(tmp_path, caplog):
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"), async_save=False))
    ckpt.save(2, state(384), {"next": 2}, wait=True)
    device = SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, state(384))
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"), async_save=False))  # as a resumed run
    with caplog.at_level("WARNING"):
        assert ckpt.latest_step() == 2
        restored, data = ckpt.restore(2, jax.eval_shape(lambda: state(384)), shardings)
    assert restored.params["embed"].shape == (384, 3) and data == {"next": 2}
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text  # Orbax reads what it holds
    with pytest.raises(ConfigError, match=r"holds another model: embed: checkpoint \(384, 3\), this run \(512, 3\)\. "
                                          r".*follows parallel.tensor"):
        ckpt.restore(2, jax.eval_shape(lambda: state(512)), shardings)
    # another layout (e.g. scan_layers toggled: stacked layers live under stack/): named, not Orbax's tree error
    with pytest.raises(ConfigError, match=r"another model layout: this run's \['stack'\] \(1 in all\) are not in it, "
                                          r"its \['out'\] \(1\) are not in this run.*scan_layers"):
        other = state(384, out="stack")
        ckpt.restore(2, jax.eval_shape(lambda: other), jax.tree.map(lambda _: device, other))
    ckpt.close()
