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
    with pytest.raises(config_lib.ConfigError) as err:   # as lingpack reports it: one line, the options kept
        config_lib.compose(["kernel=fastest"], run_dir=str(CONF))
    assert str(err.value) == ("kernel=fastest: no such option; choose one of " + ", ".join(options("kernel")))


@pytest.mark.parametrize("override,message", [
    ("kernel.name=flash", "kernel.name='flash' is not one of"),
    ("+kernel.max_seg=8", "unknown key\\(s\\) kernel.max_seg"),
    ("train.steps=many", "train.steps='many' has the wrong type"),
    ("loss.mode=mean", "mode"),
    ("logger.mode=sometimes", "logger.mode='sometimes' is not one of"),
    ("kernel=chunked_aligned kernel.max_segs=null", "set kernel.max_segs"),
    ("model.vocab_size=100", "data.vocab_size=258 exceeds model.vocab_size=100"),
    ("kernel.max_segs=0", "kernel.max_segs=0 must be >= 1"),
    ("train.steps=-1", "TrainConfig.steps=-1 must be >= 1"),
    ("model.num_layers=0", "num_layers must be >= 1"),
])
def test_bad_values_name_the_key(override, message, tmp_path):
    plain = resolved(override.split() + ["data.cache_dir=" + str(tmp_path / "cache")], tmp_path)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.build(plain, str(tmp_path))


def test_missing_required_value(tmp_path):
    plain = resolved(["data=megatron"], tmp_path)
    with pytest.raises(config_lib.ConfigError, match="data.paths is required"):
        config_lib.build(plain, str(tmp_path))


def test_kernel_without_phantom_segments_ignores_max_segs(tmp_path, caplog):
    from lingpack.experiment import _announce, run_summary
    plain = resolved(["kernel=chunked", "kernel.max_segs=8", "data.cache_dir=" + str(tmp_path / "cache")], tmp_path)
    rc = config_lib.build(plain, str(tmp_path))
    assert rc.model.kda_max_segs is None          # the step then never counts drops for this kernel
    with caplog.at_level("INFO", logger="lingpack"):
        _announce(rc)
    assert "kernel.max_segs=8 is ignored" in caplog.text and "kernel=chunked_aligned kernel.max_segs=8,16,32" in caplog.text
    assert run_summary(rc, [{"step": 1, "lm_loss": 2.0}], preempted=False)["max_segs"] is None
    aligned = config_lib.build(resolved(["kernel=chunked_aligned", "kernel.max_segs=8", "data.cache_dir="
                                         + str(tmp_path / "cache")], tmp_path), str(tmp_path))
    assert aligned.model.kda_max_segs == 8


def test_model_vocab_follows_the_data(tmp_path):
    plain = resolved(["data.cache_dir=" + str(tmp_path / "cache")], tmp_path)
    assert config_lib.build(plain, str(tmp_path)).model.vocab_size == 384   # 258 bytes+eod+pad, padded to 128
    assert config_lib.padded_vocab_size(157184, 128) == 157184 and config_lib.padded_vocab_size(258, 128, 4) == 512
    plain["model"]["vocab_size"] = 300
    assert config_lib.build(plain, str(tmp_path)).model.vocab_size == 300  # set: kept


def test_megatron_data_from_the_preprocess_cli_runs_as_in_the_readme(tmp_path):
    """The README's `data=megatron 'data.paths=[...]'` with the tiny model: ids and vocab follow the data."""
    import json

    from lingpack.data import make_iterator
    from lingpack.data.preprocess import main as preprocess_main
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i} " * (8 + i % 4)}) + "\n" for i in range(40)))
    for name in ("a", "b"):
        assert preprocess_main(["--input", str(docs), "--output-prefix", str(tmp_path / f"{name}_text_document"),
                                "--append-eod"]) == 0
    paths = f"data.paths=[0.3,{tmp_path}/a_text_document,0.7,{tmp_path}/b_text_document]"
    small = ["data.seq_length=64", "data.global_batch_size=2"]
    rc = config_lib.build(resolved(["data=megatron", paths, *small], tmp_path), str(tmp_path))
    assert (rc.data.vocab_size, rc.data.eod_id, rc.data.pad_id, rc.model.vocab_size) == (258, 256, 257, 384)
    batch = next(make_iterator(rc.data, split="train"))
    assert batch["inputs"].shape == (2, 64) and batch["inputs_segmentation"].max() > 1  # EODs split documents
    with pytest.raises(config_lib.ConfigError, match="data.eod_id=5 but .* was tokenized with eod_id=256"):
        config_lib.build(resolved(["data=megatron", paths, "data.eod_id=5"], tmp_path), str(tmp_path))
    (tmp_path / "a_text_document.tokenizer-record.json").unlink()   # e.g. data made by Megatron-LM's tools
    with pytest.raises(config_lib.ConfigError, match="has no tokenizer record .* set data.vocab_size, data.eod_id"):
        config_lib.build(resolved(["data=megatron", paths], tmp_path), str(tmp_path))


def test_phantom_sweep_has_the_segment_native_baseline(tmp_path):
    """`python run.py -m experiment=phantom_sweep`: max_segs null is the segment-native kernel's job."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=phantom_sweep"], return_hydra_config=True)
    swept = str(cfg.hydra.sweeper.params["kernel.max_segs"]).split(",")
    assert swept[0] == "null" and [int(v) for v in swept[1:]] == [8, 16, 32, 64, 128]
    for value, kernel in [("null", "chunked"), ("16", "chunked_aligned")]:
        plain = resolved(["experiment=phantom_sweep", f"kernel.max_segs={value}", f"data.cache_dir={tmp_path}"],
                         tmp_path)
        rc = config_lib.build(plain, str(tmp_path))
        assert (rc.kernel.name, rc.kernel.max_segs) == (kernel, None if value == "null" else 16)
