"""Every config composes and resolves; bad overrides fail with the key and the valid choices."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lingpack import config as config_lib
from lingpack.kernels.kda import api as kda_api

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ["kernel", "data", "loss", "optim", "parallel", "logger", "model"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def resolved(overrides, tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra")
    plain["checkpoint"]["directory"] = str(tmp_path / "ckpt")
    return OmegaConf.to_container(OmegaConf.create(plain), resolve=True)


def test_every_registered_kda_kernel_has_a_kernel_config():
    """conf/kernel/ offers exactly the implementations registered in kernels/kda/api.py."""
    assert set(options("kernel")) == set(kda_api.names())
    with pytest.raises(config_lib.ConfigError, match="not one of"):
        config_lib.KernelConfig(name="fast")


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_builds(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if group == "data" and option == "megatron":
        pytest.skip("needs real data paths (paths: ???); covered by test_missing_required_value")
    plain = resolved(overrides + ["data.cache_dir=" + str(tmp_path / "cache")], tmp_path)
    if group == "kernel" and kda_api.needs_max_segs(option):
        assert plain["kernel"]["max_segs"]
    if group == "model" and option == "ling3_flagship":  # real vocab; pair it with data of that vocab
        plain["data"]["vocab_size"] = 258
    rc = config_lib.build(plain, str(tmp_path))
    assert rc.model.kda_impl == rc.kernel.name


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment, tmp_path):
    plain = resolved([f"experiment={experiment}", "data.cache_dir=" + str(tmp_path / "cache")], tmp_path)
    config_lib.build(plain, str(tmp_path))


def test_bad_group_choice_lists_valid_options():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(Exception, match="Available options"):
            compose(config_name="config", overrides=["kernel=fastest"])


@pytest.mark.parametrize("override,message", [
    ("kernel.name=flash", "kernel.name='flash' is not one of"),
    ("+kernel.max_seg=8", "unknown key\\(s\\) kernel.max_seg"),
    ("train.steps=many", "train.steps='many' has the wrong type"),
    ("loss.mode=mean", "mode"),
    ("logger.mode=sometimes", "logger.mode='sometimes' is not one of"),
    ("kernel=chunked_aligned kernel.max_segs=null", "set kernel.max_segs"),
    ("model.vocab_size=100", "data.vocab_size=258 exceeds model.vocab_size=100"),
])
def test_bad_values_name_the_key(override, message, tmp_path):
    plain = resolved(override.split() + ["data.cache_dir=" + str(tmp_path / "cache")], tmp_path)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.build(plain, str(tmp_path))


def test_missing_required_value(tmp_path):
    plain = resolved(["data=megatron"], tmp_path)
    with pytest.raises(config_lib.ConfigError, match="data.paths is required"):
        config_lib.build(plain, str(tmp_path))
