"""`model.init_from=DIR`: a run's initial weights from a transformers directory (KimiLinear or a lingpack export).

The directory's config.json is read back to a Ling3Config and checked against the run's model on every
architecture field (`hf_config.ARCHITECTURE`: one ConfigError line naming each field that differs, with both
values); then each tensor is read from the safetensors files and written into the freshly initialised state's
parameters (and the MoE expert biases, `e_score_correction_bias`). The optimizer state stays as initialised
(Adam's moments are zeros either way). MTP layers come from the directory's `mtp.{d}.*` tensors when it
has them (a lingpack export); a KimiLinear checkpoint has none, and the run's MTP layers keep their
initialisation, said in one log line. A run that resumes from its own checkpoint does not read DIR.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from lingpack.errors import ConfigError
from lingpack.export import hf_config, table, weights

log = logging.getLogger("lingpack.export")


def stored_config(directory: str):
    """(the directory's Ling3Config, its layout: hf_config.KIMI or LING3)."""
    d = hf_config.read_config_json(directory)
    return hf_config.ling3_config_from_json(d, directory), d["model_type"]


def load_tree(directory: str, model_cfg, tree: dict) -> list[str]:
    """Write DIR's tensors into the pure-dict state `tree` ({"params": ..., "rest": ...} of numpy arrays) in
    place; returns the log lines to print. Raises ConfigError on a config mismatch or a missing tensor."""
    stored, layout = stored_config(directory)
    hf_config.check_matches(stored, model_cfg, directory)
    lines, mtp = [], model_cfg.mtp_num_layers > 0
    if mtp and stored.mtp_num_layers == 0:
        lines.append(f"model.init_from={directory} has no MTP layers: the run's {model_cfg.mtp_num_layers} MTP "
                     "layer(s) start from their initialisation")
        mtp = False
    elif mtp and (stored.mtp_num_layers, stored.mtp.use_moe) != (model_cfg.mtp_num_layers, model_cfg.mtp.use_moe):
        raise ConfigError(f"model.init_from={directory} holds another model: model.mtp_num_layers: checkpoint "
                          f"{stored.mtp_num_layers}, this run {model_cfg.mtp_num_layers}; model.mtp.use_moe: "
                          f"checkpoint {stored.mtp.use_moe}, this run {model_cfg.mtp.use_moe}. Set them to the "
                          "checkpoint's (or model.mtp_num_layers=0)")
    entries = table.entries(model_cfg, mtp=mtp, layout=layout)
    try:
        missing = weights.read_into(entries, directory, tree)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"model.init_from={directory}: {err}") from err
    if missing:
        raise ConfigError(f"model.init_from={directory} lacks {len(missing)} tensor(s) this model needs, e.g. "
                          f"{missing[:3]}; is it a {layout} checkpoint of this config?")
    lines.append(f"initialised from {directory} ({layout}, {len(entries)} tensors)")
    return lines


def initial_state(state, shardings, model_cfg, directory: str):
    """`state` (a fresh TrainState) with its parameters and expert biases from DIR, placed in `shardings`."""
    from lingpack import distributed
    params, rest = distributed.fetch((state.params, state.rest))   # host numpy copies (a collective on pods)
    tree = {"params": jax.tree.map(np.array, params), "rest": jax.tree.map(np.array, rest)}
    for line in load_tree(directory, model_cfg, tree):
        log.info(line)
    place = lambda host, sharding: jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return dataclasses.replace(state, params=jax.tree.map(place, tree["params"], shardings.params),
                               rest=jax.tree.map(place, tree["rest"], shardings.rest))
