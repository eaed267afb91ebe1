"""Restoring a checkpoint into a model of other shapes names the parameters and the likely cause
(Orbax's own error names neither), e.g. a vocabulary padded for another parallel.tensor."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
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


def _files(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _largest_data_file(step_dir):
    """The biggest TensorStore chunk file of the state item: it holds the embedding's values."""
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def _embed(step):  # random values: their chunk does not compress away, it is the state's largest file
    return np.random.default_rng(step).standard_normal((256, 64)).astype(np.float32)


def _trained(step=0):
    """A state shaped like a run's: optax's AdamW state (namedtuples) beside the parameters."""
    import optax
    params = {"embed": jnp.asarray(_embed(step)), "out": jnp.ones(3)}
    return state(256).replace(params=params, opt_state=optax.adamw(1e-3).init(params))


def _saved(tmp_path, steps=(2, 4)):
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"), async_save=False, keep=2))
    for step in steps:
        ckpt.save(step, _trained(step), {"next": step}, wait=True)
    ckpt.close()
    return tmp_path / "ckpt"


@pytest.mark.parametrize("damage", ["data file", "_METADATA", "data/metadata"])
def test_damaged_newest_step_resumes_from_the_previous_one_and_keeps_it(tmp_path, caplog, damage):
    directory = _saved(tmp_path)
    victim = {"data file": _largest_data_file(directory / "4"), "_METADATA": directory / "4" / "state" / "_METADATA",
              "data/metadata": directory / "4" / "data" / "metadata"}[damage]
    victim.unlink()
    left = _files(directory / "4")
    template = _trained()
    device = SingleDeviceSharding(jax.devices()[0])
    ckpt = Checkpointer(CheckpointConfig(directory=str(directory), async_save=False, keep=2))
    with caplog.at_level("WARNING"):
        step, restored, data = ckpt.resume(jax.eval_shape(lambda: template), jax.tree.map(lambda _: device, template))
    assert (step, data) == (2, {"next": 2})
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]), _embed(2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # Orbax's own: none
    assert len(warnings) == 1 and "checkpoint step 4" in warnings[0] and "resuming from step 2" in warnings[0]
    aside = tmp_path / "ckpt.damaged" / "4"
    assert str(aside) in warnings[0] and _files(aside) == left          # moved whole, not one byte lost
    ckpt.save(4, restored, {"next": 4}, wait=True)                     # the run saves step 4 afresh ...
    ckpt.save(6, restored, {"next": 6}, wait=True)                     # ... and keep=2 cleans only its own
    assert ckpt.all_steps() == [4, 6] and _files(aside) == left
    ckpt.close()


def test_resume_step_and_a_directory_with_nothing_intact(tmp_path):
    directory = _saved(tmp_path)
    template = _trained()
    abstract, device = jax.eval_shape(lambda: template), SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, template)
    ckpt = Checkpointer(CheckpointConfig(directory=str(directory), async_save=False, keep=2))
    with pytest.raises(ConfigError, match=r"resume_step=3: no such step .* \(it holds \[2, 4\]\)"):
        ckpt.resume(abstract, shardings, resume_step=3)
    with pytest.raises(ConfigError, match=r"resume_step=2, but .* also holds the newer steps \[4\]"):
        ckpt.resume(abstract, shardings, resume_step=2)
    _largest_data_file(directory / "4").unlink()
    with pytest.raises(ConfigError, match=r"resume_step=4: the checkpoint at step 4 .* cannot be restored"):
        ckpt.resume(abstract, shardings, resume_step=4)
    _largest_data_file(directory / "2").unlink()
    before = _files(directory)
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be restored \(steps 4, 2; step 4: "):
        ckpt.resume(abstract, shardings)
    assert _files(directory) == before and not (tmp_path / "ckpt.damaged").exists()   # nothing moved
    ckpt.close()
