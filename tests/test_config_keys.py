"""Every config key does something: each key the default config sets changes the resolved RunConfig (or is
refused with an error naming it), is documented in docs/configuration.md, and every schema field is read by
the package; keys that did nothing or duplicated another are one-line errors."""
import copy
import dataclasses
import re
from pathlib import Path

import pytest

from lingpack import config as config_lib
from lingpack.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# another valid value for keys whose type alone does not give one (strings, nulls, constrained numbers)
ALTERNATIVES = {
    "name": "other", "train.nan_policy": "skip", "train.overflow_policy": "halt",
    "checkpoint.directory": "{run_dir}/elsewhere", "distributed.initialize": False,
    "distributed.coordinator_address": "127.0.0.1:1234", "distributed.num_processes": 1,
    "distributed.process_id": 0, "distributed.compilation_cache_dir": "{run_dir}/compilation_cache",
    "parity.megatron_log": "megatron.log", "parity.reference_dtype": "float64", "model.vocab_size": 512,
    "model.dtype": "bfloat16", "model.param_dtype": "bfloat16", "model.attention_impl": "flash",
    "model.remat_policy": "dots_saveable", "model.kda.lower_bound": -2.0, "model.kda.gate_activation": "silu",
    "model.mla.rope_type": "none", "model.moe.num_experts": 6, "model.moe.top_k": 1, "model.moe.n_groups": 1,
    "kernel.name": "reference", "kernel.max_segs": 8, "kernel.chunk_size": 32, "kernel.interpret": False,
    "kernel.short_conv": "pallas",
    "data.source": "synthetic", "data.paths": ["bundled:scene"], "data.split": "900,50,50",
    "data.cache_dir": "{run_dir}/data_cache", "data.index_mode": "mmap_npy", "data.num_samples": 1000,
    "data.packing": "whole_documents", "loss.mode": "per_token", "optim.decay_steps": 100,
    "optim.schedule": "linear", "optim.b1": 0.8, "optim.b2": 0.9, "optim.master_dtype": "bfloat16",
    "parallel.cpu_devices": 2, "logger.kind": "none", "logger.mode": "online", "logger.project": "other",
    "logger.group": "g", "logger.job_type": "eval", "logger.tags": ["t"],
    "train.profile_steps": [0, 1], "train.profile_dir": "{run_dir}/trace", "checkpoint.resume_step": 30,
    "model.init_from": "{run_dir}/hf", "model.remat_policy_kda": "full", "model.remat_policy_mla": "full",
    "model.remat_policy_moe": "full", "model.moe.expert_parallel_exchange": "dense",
}


def _other(key: str, value, run_dir: str):
    if key in ALTERNATIVES:   # paths under the test's own directory: building may create them
        other = ALTERNATIVES[key]
        return other.format(run_dir=run_dir) if isinstance(other, str) else other
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 0.5
    raise AssertionError(f"{key}={value!r}: add another valid value to ALTERNATIVES")


def _leaves(d: dict, prefix: tuple = ()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    plain = config_lib.compose([], run_dir=run_dir)
    plain.pop("hydra", None)
    return plain, run_dir, config_lib.build(copy.deepcopy(plain), run_dir, open_data=False)


def test_every_key_of_the_default_config_changes_the_resolved_config(default):
    plain, run_dir, base = default
    keys, inert = 0, []
    for path, value in _leaves(plain):
        key, changed = ".".join(path), copy.deepcopy(plain)
        node = changed
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = _other(key, value, run_dir)
        try:
            if config_lib.build(changed, run_dir, open_data=False) == base:
                inert.append(key)
        except ConfigError as err:   # refused: the key was read (validated against the data, say)
            assert path[-1] in str(err), (key, str(err))
        keys += 1
    assert inert == [] and keys > 80


def test_every_key_of_the_default_config_is_documented(default):
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [".".join(path) for path, _ in _leaves(default[0])
               if not re.search(rf"`({re.escape('.'.join(path[1:]))}|{re.escape(path[-1])})`", doc)]
    assert missing == []


def _schemas() -> list[type]:
    """Every config dataclass a RunConfig holds, nested ones included."""
    import typing
    seen, todo = [], [config_lib.RunConfig]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for hint in typing.get_type_hints(cls).values():
            todo += [a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)]
    return seen


def test_every_schema_field_is_read_by_the_package():
    """A field nothing reads would be a documented key that does nothing (as `model.mtp.loss_scale` was)."""
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "lingpack").rglob("*.py"))
    schemas = _schemas()
    assert {"Ling3Config", "MoEConfig", "MTPConfig", "LossConfig", "DataConfig"} <= {c.__name__ for c in schemas}
    unread = [f"{cls.__name__}.{f.name}" for cls in schemas for f in dataclasses.fields(cls)
              if not re.search(rf"\.{f.name}\b|getattr\([^)]*[\"']{f.name}[\"']", source)]
    assert unread == []


@pytest.mark.parametrize("group, key, value, instead", [
    ("model", "mtp.loss_scale", 0.2, "loss.mtp_loss_scale"),
    ("loss", "moe_z_loss_weight", 0.1, "model.moe.z_loss_coef"),
    ("loss", "expert_bias_update_rate", 0.1, "model.moe.bias_update_rate"),
    ("model", "kda_chunk_size", 32, "kernel.chunk_size"),
    ("model", "kda_impl", "reference", "kernel.name"),
])
def test_a_retired_key_is_a_one_line_error(default, group, key, value, instead):
    plain, run_dir, _ = default
    changed = copy.deepcopy(plain)
    node = changed[group]
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as err:
        config_lib.build(changed, run_dir, open_data=False)
    assert f"{group}.{key}={value!r}" in str(err.value) and f"set {instead} instead" in str(err.value)
    assert "\n" not in str(err.value)
