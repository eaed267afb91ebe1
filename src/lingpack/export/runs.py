"""Export a run: its directory's config and checkpoint -> a transformers model directory (see the package's
docstring); `load_checkpoint_model` gives lingpack's model of a checkpoint step, for comparisons."""


from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

from lingpack.errors import ConfigError
from lingpack.export import hf_config, table, weights

log = logging.getLogger("lingpack.export")

REMOTE_FILES = ("configuration_ling3.py", "modeling_ling3.py")
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3


@dataclasses.dataclass(frozen=True)
class RunInfo:
    model: object                 # Ling3Config
    checkpoint_dir: str
    tokenizer_record: dict | None
    eod_id: int | None
    pad_id: int | None
    run_config: object = None     # the whole RunConfig (data, for tools that read the run's batches)


def read_run(run_dir: str) -> RunInfo:
    """The model config, checkpoint directory and tokenizer record of a run directory (its .hydra/config.yaml)."""
    from omegaconf import OmegaConf

    from lingpack import config as config_lib
    from lingpack.data.indices import parse_blend
    from lingpack.data.preprocess import read_tokenizer_record
    path = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"--run {run_dir}: no .hydra/config.yaml there; give the run directory run.py printed "
                          "('run directory: ...')")
    plain = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    plain = config_lib._replace_run_dir(plain, os.path.abspath(run_dir))   # ${hydra:runtime.output_dir}
    plain = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    rc = config_lib.build(plain, run_dir, open_data=False)
    records = [read_tokenizer_record(p) for p in parse_blend(rc.data.paths)[0]] if rc.data.paths else []
    record = records[0] if records and all(r == records[0] for r in records) else None
    return RunInfo(rc.model, rc.checkpoint.directory, record, rc.data.eod_id, rc.data.pad_id, rc)


def checkpoint_step_dir(checkpoint_dir: str, step: int | None) -> tuple[str, int]:
    from lingpack.train.checkpoint import Checkpointer
    from lingpack.train.configs import CheckpointConfig
    steps = Checkpointer(CheckpointConfig(directory=checkpoint_dir, async_save=False)).all_steps()
    if not steps:
        raise ConfigError(f"no checkpoint in {checkpoint_dir}: train the run with checkpoint.enabled=true first")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"--step {step}: {checkpoint_dir} holds steps {steps}; pick one of them")
    return os.path.join(str(checkpoint_dir), str(step)), step


def export_weights(model_cfg, leaves, out_dir: str, *, mtp: bool = True, eos_id: int | None = None,
                   pad_id: int | None = None, tokenizer_record: dict | None = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write a transformers model directory for `model_cfg` from `leaves` (`weights.CheckpointLeaves` or
    `weights.StateLeaves`); returns what was written."""
    from transformers import GenerationConfig
    layout, why = hf_config.layout_of(model_cfg)
    mtp = mtp and model_cfg.mtp_num_layers > 0
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):   # a previous export's shards would stay listed by nobody but confuse readers
        if stale.endswith(".safetensors") or stale == weights.INDEX:
            os.remove(os.path.join(out_dir, stale))
    entries = table.entries(model_cfg, mtp=mtp, layout=layout)
    written = weights.write_shards(entries, leaves, out_dir, max_shard_bytes)
    config = hf_config.config_json(model_cfg, layout, mtp=mtp, eos_id=eos_id, pad_id=pad_id)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as stream:
        json.dump(config, stream, indent=2, sort_keys=True)
        stream.write("\n")
    if layout == hf_config.LING3:
        here = os.path.join(os.path.dirname(__file__), "remote")
        for name in REMOTE_FILES:
            shutil.copyfile(os.path.join(here, name), os.path.join(out_dir, name))
    GenerationConfig(eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"],
                     do_sample=False).save_pretrained(out_dir)
    from lingpack.export.tokenizer import write_tokenizer
    tokenizer = write_tokenizer(tokenizer_record, out_dir)
    return {**written, "layout": layout, "why": why, "mtp": mtp, "tokenizer": tokenizer,
            "architecture": config["architectures"][0]}


def export_run(run_dir: str, out_dir: str, *, step: int | None = None, mtp: bool = True,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    info = read_run(run_dir)
    step_dir, step = checkpoint_step_dir(info.checkpoint_dir, step)
    done = export_weights(info.model, weights.CheckpointLeaves(step_dir), out_dir, mtp=mtp, eos_id=info.eod_id,
                          pad_id=info.pad_id, tokenizer_record=info.tokenizer_record, max_shard_bytes=max_shard_bytes)
    return {**done, "step": step}


def load_checkpoint_model(model_cfg, step_dir: str):
    """lingpack's model holding a checkpoint step's weights (every parameter leaf restored to host numpy)."""
    import jax
    from flax import nnx
    graphdef, params, rest = nnx.split(table.abstract_model(model_cfg), nnx.Param, ...)
    tree = {"params": params.to_pure_dict(), "rest": rest.to_pure_dict()}
    keys = [("params" if i == 0 else "rest", *map(lambda k: str(getattr(k, "key", k)), path))
            for i, part in enumerate((tree["params"], tree["rest"]))
            for path, _ in jax.tree_util.tree_flatten_with_path(part)[0]]
    values = weights.CheckpointLeaves(step_dir).read(keys)
    for key, value in values.items():
        table.set_path(tree, key, jax.numpy.asarray(value))
    nnx.replace_by_pure_dict(params, tree["params"])
    nnx.replace_by_pure_dict(rest, tree["rest"])
    return nnx.merge(graphdef, params, rest)
