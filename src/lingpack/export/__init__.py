"""A run's checkpoint -> a transformers model directory, and a transformers directory -> a run's initial weights.

    python -m lingpack.export --run outputs/x [--step N] --out hf/x [--no-mtp] [--max-shard-size 5GB]

writes config.json, model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json past
the shard size), generation_config.json and, when the data has a tokenizer record, tokenizer.json +
tokenizer_config.json. A config transformers' KimiLinear expresses exports as `KimiLinearForCausalLM`; any
other Ling3 (the default's safe KDA gate and RoPE MLA) as `Ling3ForCausalLM` with its modeling files
(`configuration_ling3.py`, `modeling_ling3.py`, `trust_remote_code=True`). Weights are float32 (the master
copy the checkpoint holds). MTP layers are stored as `mtp.{d}.*` unless `--no-mtp`; transformers' KimiLinear
has no MTP and leaves them unused. `model.init_from=DIR` (importer.py) reads such a directory back. Modules: runs.py (the command's body),
table.py (which checkpoint leaves make which tensor), weights.py (shards out, tensors in), hf_config.py
(config.json both ways), tokenizer.py, remote/ (the Ling3 modeling files).
"""
