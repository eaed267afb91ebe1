"""The resolved run configuration: Hydra's composed config -> small frozen dataclasses, validated.

This is the only module (with run.py) that knows Hydra exists. Every group maps onto the dataclass its
consumer owns (`Ling3Config`, `DataConfig`, `LossConfig`, ...); an unknown key, a wrong type or an
invalid choice raises `ConfigError` naming the key (as `group.key`) and what would be valid.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing

from lingpack import resolvers
from lingpack.data.config import DataConfig
from lingpack.distributed import DistributedConfig
from lingpack.errors import ConfigError  # noqa: F401  (re-exported: callers catch it from here too)
from lingpack.kernels.kda import api as kda_api
from lingpack.kernels.kda import gate as kda_gate
from lingpack.kernels.short_conv import BACKWARDS as SHORT_CONV_BACKWARDS
from lingpack.models.ling3 import Ling3Config, config_from_dict
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.schedule import ContextSchedule

resolvers.register()  # conf/ uses them; tests and tools compose through Hydra after importing this module

LOGGER_KINDS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The KDA kernel: `name` picks the implementation behind `kernels.kda.api.chunk_kda`."""
    name: str = "chunked"
    max_segs: int | None = None      # cu_seqlens slots per micro-batch (aligned designs only)
    chunk_size: int = 64
    interpret: bool | None = None    # Pallas: None = interpret mode off TPU
    short_conv: str = "xla"          # the short convs' backward: xla, or pallas (kernels/short_conv.py, TPU)

    def __post_init__(self):
        if self.name not in kda_api.names():   # the registry in kernels/kda/api.py
            raise ConfigError(f"kernel.name={self.name!r} is not one of {kda_api.names()}")
        if self.short_conv not in SHORT_CONV_BACKWARDS:
            raise ConfigError(f"kernel.short_conv={self.short_conv!r} is not one of {SHORT_CONV_BACKWARDS}")
        if self.max_segs is not None and self.max_segs < 1:
            raise ConfigError(f"kernel.max_segs={self.max_segs} must be >= 1: it is the number of documents a micro-batch"
                              " may hold (`python -m lingpack.data.stats` recommends one)")
        if kda_api.needs_max_segs(self.name) and self.max_segs is None:
            raise ConfigError(f"kernel={self.name} packs documents into kernel.max_segs slots: set kernel.max_segs"
                              " >= the most documents in a micro-batch (`python -m lingpack.data.stats` recommends one)")
        try:
            kda_gate.check_chunk_size(self.chunk_size, "kernel.chunk_size")
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclasses.dataclass(frozen=True)
class LoggerConfig:
    kind: str = "wandb"
    mode: str = "offline"
    project: str = "lingpack"
    group: str | None = None
    job_type: str = "train"
    tags: tuple[str, ...] = ()
    console_every: int = 0   # full-metrics console line every N steps; 0 = off (the loop logs one line per step)
    quiet: bool = True       # W&B's own console output off (one line says where the run is instead)

    def __post_init__(self):
        if self.kind not in LOGGER_KINDS:
            raise ConfigError(f"logger.kind={self.kind!r} is not one of {LOGGER_KINDS}")
        if self.mode not in WANDB_MODES:
            raise ConfigError(f"logger.mode={self.mode!r} is not one of {WANDB_MODES}")


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    """The Megatron loss-parity experiment (experiment=loss_parity)."""
    enabled: bool = False
    tolerance: float = 1e-4
    megatron_log: str | None = None  # compare against an imported Megatron-LM log as well
    lock_routing: bool = False       # the reference uses lingpack's expert selections (parity/harness.py)
    reference_dtype: str | None = None  # float32 | float64; None: float64 for a float64 model, else float32
    # torch threads of the reference (None: torch's default). Its ops are small (one document per row): with more
    # threads OpenMP spins against JAX's; one thread took 10x less CPU time per step on a shared 2-core machine.
    reference_threads: int | None = 1

    def __post_init__(self):
        if self.reference_threads is not None and self.reference_threads < 1:
            raise ConfigError(f"parity.reference_threads={self.reference_threads} must be >= 1 or null "
                              "(torch's default)")
        if self.reference_dtype not in (None, "float32", "float64"):
            raise ConfigError(f"parity.reference_dtype={self.reference_dtype!r} is not one of float32, float64 or "
                              "null (null: float64 when model.dtype is float64, else float32)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str
    seed: int
    model: Ling3Config
    kernel: KernelConfig
    data: DataConfig
    loss: LossConfig
    optim: OptimConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    train: TrainConfig
    logger: LoggerConfig
    parity: ParityConfig
    run_dir: str
    schedule: ContextSchedule = ContextSchedule()   # progressive context stages (experiment=context_schedule)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    notes: tuple[str, ...] = ()   # what the config check found worth saying once at start (e.g. no test split)


def _is_instance(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if annotation in (typing.Any, None) or isinstance(annotation, str):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return isinstance(value, (tuple, list))
    return isinstance(value, origin or annotation) if isinstance(origin or annotation, type) else True


def make(cls, values: dict | None, group: str):
    """`cls(**values)` with errors naming `group.key`: unknown keys, wrong types, failed validation."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{group}.{k}' for k in unknown)}; valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if isinstance(value, list):
            values[key] = value = tuple(value)
        if value == "???":
            raise ConfigError(f"{group}.{key} is required (it is ??? in the config); set it on the command line")
        if not _is_instance(value, hints[key]):
            raise ConfigError(f"{group}.{key}={value!r} has the wrong type: expected {hints[key]}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{group}: {err}") from err


def _data_config(values: dict, seed_dir: str) -> DataConfig:
    values = dict(values)
    paths = values.get("paths") or ()
    if paths == "???":
        raise ConfigError("data.paths is required (it is ??? in the config): give Megatron --data-path style"
                          " prefixes, e.g. 'data.paths=[/data/corpus_text_document]'")
    if isinstance(paths, str):
        paths = paths.split()
    cache_dir = values.get("cache_dir") or os.path.join(seed_dir, "data_cache")
    # "bundled" / "bundled:scene": the bundled corpus (one document per speech / per scene), tokenized on first use
    paths = [_bundled(p, cache_dir) if str(p).startswith("bundled") else p for p in paths]
    values["paths"] = tuple(paths)
    if values.get("source", "megatron") == "megatron" and paths:
        _check_data_files(values)  # a missing or truncated file is named before anything read from it
        _follow_tokenizer_record(values)
    return make(DataConfig, values, "data")


def _check_data_files(values: dict) -> None:
    """Open every dataset prefix: its `.bin`/`.idx` exist and hold what the index says (IndexedDatasetError)."""
    from lingpack.data.indexed import IndexedDataset
    from lingpack.data.indices import parse_blend
    try:
        prefixes, _ = parse_blend(values["paths"])
    except ValueError as err:
        raise ConfigError(f"data.paths: {err}") from err
    for prefix in prefixes:
        IndexedDataset(prefix)


def _follow_tokenizer_record(values: dict) -> None:
    """Fill data.vocab_size/eod_id/pad_id left null from the tokenizer record beside each dataset prefix.

    Set values must agree with the record (else the run would misread documents); without a record
    (data made by Megatron-LM's tools) null values are an error naming the keys to set.
    """
    from lingpack.data.indices import parse_blend
    from lingpack.data.preprocess import RECORD_KEYS, read_tokenizer_record, record_path
    try:
        prefixes, _ = parse_blend(values["paths"])
    except ValueError as err:
        raise ConfigError(f"data.paths: {err}") from err
    for prefix in prefixes:
        record = read_tokenizer_record(prefix)
        for key in RECORD_KEYS:
            if record is None:
                if values.get(key) is None:
                    raise ConfigError(
                        f"data.{key} is null and {prefix} has no tokenizer record ({record_path(prefix)}, written by "
                        "`python -m lingpack.data.preprocess`): set data.vocab_size, data.eod_id and data.pad_id to "
                        "the tokenizer's (Ling3's: data.vocab_size=157184 data.eod_id=156892 data.pad_id=-1)")
            elif values.get(key) is None:
                values[key] = record[key]
            elif values[key] != record[key]:
                raise ConfigError(f"data.{key}={values[key]} but {prefix} was tokenized with {key}={record[key]} "
                                  f"({record_path(prefix)}); set data.{key}={record[key]} or null (follow the data)")


def _bundled(path: str, cache_dir: str) -> str:
    from lingpack.data.corpus import bundled_corpus_prefix
    unit = path.partition(":")[2] or "speech"
    try:
        return bundled_corpus_prefix(cache_dir, unit)
    except ValueError as err:
        raise ConfigError(f"data.paths entry {path!r}: {err}") from err


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Megatron's `make_vocab_size_divisible_by` padding: round up to a multiple of divisible_by * tensor size."""
    if divisible_by < 1:
        raise ConfigError(f"model.vocab_size_divisible_by={divisible_by} must be >= 1 (Megatron's default is 128)")
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def _train_samples(data: DataConfig, train: TrainConfig) -> DataConfig:
    """Megatron's training sample count, train iterations x global batch size, unless num_samples or
    num_epochs is set: a run longer than one epoch reads the next epochs, as Megatron's does."""
    if (data.source != "synthetic" and not data.paths) or data.num_samples or data.num_epochs:
        return data
    return dataclasses.replace(data, num_samples=train.steps * data.global_batch_size)


def _check_batch_shape(data: DataConfig, train: TrainConfig, loss, parallel: ParallelConfig,
                       schedule: ContextSchedule) -> None:
    """What the config alone decides about a batch: micro-batch split, loss groups, context-parallel rows."""
    from lingpack.parallel.reorder import check_length
    B, M = data.global_batch_size, train.micro_batches
    if B % M:
        raise ConfigError(f"data.global_batch_size={B} does not split into train.micro_batches={M}; make it a "
                          f"multiple of {M}")
    if (B // M) % loss.megatron_dp_size:
        raise ConfigError(f"a micro-batch of {B // M} rows (data.global_batch_size / train.micro_batches) does not "
                          f"split into loss.megatron_dp_size={loss.megatron_dp_size} groups")
    if parallel.context > 1:
        lengths = [stage.seq_length for stage in schedule.stages] if schedule.enabled else [data.seq_length]
        for length in lengths:
            try:
                check_length(length, parallel.context, parallel.load_balance)
            except ValueError:
                parts = 2 * parallel.context if parallel.load_balance else parallel.context
                where = "a schedule stage's seq_length" if schedule.enabled else "data.seq_length"
                raise ConfigError(
                    f"{where}={length} does not divide into {parts} chunks (parallel.context={parallel.context}"
                    f"{' x 2, parallel.load_balance=true' if parallel.load_balance else ''}); make it a multiple of "
                    f"{parts}, or change parallel.context") from None


def _whole_document_rows(data: DataConfig, schedule: ContextSchedule, parallel: ParallelConfig,
                         kernel: KernelConfig) -> tuple[DataConfig, ContextSchedule, tuple]:
    """data.packing=whole_documents pads rows, so their length is free: under context parallelism every row
    length (data.seq_length, each schedule stage's) is rounded up to a multiple of 2 x context x the KDA
    chunk (context x chunk without load balance), so each device's zigzag chunk is whole KDA chunks."""
    if data.packing != "whole_documents" or parallel.context <= 1:
        return data, schedule, ()
    multiple = (2 if parallel.load_balance else 1) * parallel.context * kernel.chunk_size

    def rounded(length: int) -> int:
        return -(-length // multiple) * multiple

    notes = []
    if schedule.enabled:
        stages = tuple(dataclasses.replace(s, seq_length=rounded(s.seq_length)) for s in schedule.stages)
        changed = [f"{a.seq_length}->{b.seq_length}" for a, b in zip(schedule.stages, stages) if a != b]
        if changed:
            notes.append(f"whole-document rows: schedule stage lengths {', '.join(changed)} (a multiple of {multiple}"
                         f" for parallel.context={parallel.context}); set them so to silence this")
        schedule = ContextSchedule(stages=stages)
    elif rounded(data.seq_length) != data.seq_length:
        notes.append(f"whole-document rows: data.seq_length={data.seq_length} rounded up to {rounded(data.seq_length)}"
                     f" (a multiple of {multiple} for parallel.context={parallel.context}); set it so to silence this")
        data = dataclasses.replace(data, seq_length=rounded(data.seq_length))
    return data, schedule, tuple(notes)


def _check_data_budget(data: DataConfig, train: TrainConfig, schedule: ContextSchedule) -> tuple[TrainConfig, tuple]:
    """The data against what the run reads (data/budget.py); a test split too small skips the test evaluation."""
    from lingpack.data import budget
    from lingpack.train.evaluate import split_sample_counts
    splits = ("valid", "test") if train.eval_test else ("valid",)
    counts = split_sample_counts(train, data.global_batch_size) if train.eval_every else {}
    evaluated = {split: counts[split] for split in splits} if train.eval_every else {}
    lengths = [stage.seq_length for stage in schedule.stages] if schedule.enabled else [data.seq_length]
    notes, test = [], True
    for length in dict.fromkeys(lengths):
        more, stage_test = budget.check(dataclasses.replace(data, seq_length=length),
                                        train_samples=train.steps * data.global_batch_size, eval_samples=evaluated)
        notes += [n for n in more if n not in notes]
        test = test and stage_test
    if "test" in evaluated and not test:
        train = dataclasses.replace(train, eval_test=False)
    return train, tuple(notes)


def model_config(values: dict, kernel: KernelConfig, data_vocab_size: int, tensor_parallel: int = 1) -> Ling3Config:
    """The `model` group (+ the kernel) -> Ling3Config; `vocab_size: null` follows the data's vocabulary."""
    values = dict(values)
    for key, name in (("kda_impl", "name"), ("kda_chunk_size", "chunk_size"), ("kda_max_segs", "max_segs"),
                      ("kda_interpret", "interpret"), ("kda_short_conv", "short_conv")):
        if key in values:  # the kernel group sets them: a value here would be overwritten unread
            raise ConfigError(f"model.{key}={values[key]!r} is set by the kernel group: set kernel.{name} instead")
    divisor = values.pop("vocab_size_divisible_by", 128)
    if values.get("vocab_size") is None:  # the data's tokenizer, padded like Megatron's vocab
        values["vocab_size"] = padded_vocab_size(data_vocab_size, divisor, max(tensor_parallel, 1))
    uses_max_segs = kda_api.needs_max_segs(kernel.name)  # other kernels ignore max_segs (no phantom segments)
    values.update(kda_impl=kernel.name, kda_chunk_size=kernel.chunk_size, kda_interpret=kernel.interpret,
                  kda_short_conv=kernel.short_conv,
                  kda_max_segs=kernel.max_segs if uses_max_segs else None)
    try:
        return config_from_dict(values)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model: {err}") from err


# keys that did nothing or duplicated another: each meaning has one key, named here
RETIRED = {("model", "mtp", "loss_scale"): "loss.mtp_loss_scale",
           ("loss", "moe_z_loss_weight"): "model.moe.z_loss_coef",
           ("loss", "expert_bias_update_rate"): "model.moe.bias_update_rate"}


def _check_retired(cfg: dict) -> None:
    for path, key in RETIRED.items():
        node = cfg
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            raise ConfigError(f"{'.'.join(path)}={node!r} is not a key (nothing reads it): set {key} instead")


def build(cfg: dict, run_dir: str, *, open_data: bool = True) -> RunConfig:
    """A resolved plain-dict config (OmegaConf.to_container(cfg, resolve=True)) -> RunConfig.

    `open_data=False` skips the check of the data files against the run's sample counts (data/budget.py),
    for tools that study the program without its data (the planner, exports).
    """
    known = {"name", "seed", "model", "kernel", "data", "loss", "optim", "parallel", "checkpoint", "train",
             "logger", "parity", "schedule", "distributed", "hydra"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; valid: {sorted(known - {'hydra'})}")
    _check_retired(cfg)
    kernel = make(KernelConfig, cfg.get("kernel"), "kernel")
    data = _data_config(cfg.get("data") or {}, os.getcwd())
    parallel = make(ParallelConfig, cfg.get("parallel"), "parallel")
    model = model_config(cfg.get("model") or {}, kernel, data.vocab_size, parallel.tensor)
    if data.vocab_size > model.vocab_size:
        raise ConfigError(f"data.vocab_size={data.vocab_size} exceeds model.vocab_size={model.vocab_size}: tokens"
                          " would index past the embedding; raise model.vocab_size or set it to null (follow the data)")
    train_values = dict(cfg.get("train") or {})
    train_values.setdefault("seed", cfg.get("seed", 0))
    if train_values.get("profile_dir") is None:   # null: the run directory's profile/
        train_values["profile_dir"] = os.path.join(run_dir, "profile")
    train = make(TrainConfig, train_values, "train")
    data = _train_samples(data, train)
    loss = make(LossConfig, cfg.get("loss"), "loss")
    schedule = make(ContextSchedule, cfg.get("schedule"), "schedule")
    data, schedule, row_notes = _whole_document_rows(data, schedule, parallel, kernel)
    _check_batch_shape(data, train, loss, parallel, schedule)
    train, notes = _check_data_budget(data, train, schedule) if open_data else (train, ())
    notes = row_notes + notes
    optim_values = dict(cfg.get("optim") or {})
    return RunConfig(
        name=str(cfg.get("name", "run")), seed=int(cfg.get("seed", 0)), model=model, kernel=kernel, data=data,
        loss=loss, optim=make(OptimConfig, optim_values, "optim"),
        parallel=parallel,
        checkpoint=make(CheckpointConfig, cfg.get("checkpoint"), "checkpoint"),
        train=train, logger=make(LoggerConfig, cfg.get("logger"), "logger"),
        parity=make(ParityConfig, cfg.get("parity"), "parity"), run_dir=run_dir,
        schedule=schedule, distributed=make(DistributedConfig, cfg.get("distributed"), "distributed"),
        notes=notes)


def find_config_dir(config_dir: str | None = None) -> str:
    """conf/ of the run: `config_dir`, else ./conf (where run.py is started), else the checkout's conf/."""
    from pathlib import Path
    checkout = Path(__file__).resolve().parents[2] / "conf"   # src/lingpack/config.py -> <checkout>/conf
    candidates = [Path(config_dir)] if config_dir else [Path.cwd() / "conf", checkout]
    for candidate in candidates:
        if (candidate / "config.yaml").is_file():
            return str(candidate.resolve())
    raise ConfigError(f"no run config (config.yaml) in {' or '.join(map(str, candidates))}: run from the lingpack "
                      "checkout or pass --config-dir DIR")


def compose(overrides: list[str], *, run_dir: str, config_dir: str | None = None) -> dict:
    """The plain config `python run.py OVERRIDES` would run, resolved, with `run_dir` as its run directory.

    Hydra's own errors (an unknown group option, a missing `+`) become a ConfigError with Hydra's message.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:
        with initialize_config_dir(config_dir=find_config_dir(config_dir), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        plain = OmegaConf.to_container(cfg, resolve=False)
        plain.pop("hydra", None)
        plain = _replace_run_dir(plain, run_dir)  # ${hydra:runtime.output_dir} exists only under run.py
        return OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(hydra_error_message(err)) from None


def hydra_error_message(err: Exception) -> str:
    """Hydra's composition error in one line: a missing group option keeps Hydra's list of the available ones
    (and the nearest), without its config-search-path listing; any other error is Hydra's text, joined."""
    import difflib
    import re
    text = str(err).split("\nConfig search path:")[0]
    missing = re.search(r"Could not find '(?P<group>.+)/(?P<option>[^/']+)'", text)
    options = re.search(r"Available options in '[^']*':\n(?P<list>(?:\t.*(?:\n|$))+)", text)
    if not missing:
        return " ".join(text.split())
    group, option = missing["group"], missing["option"]
    choices = options["list"].split() if options else []
    parent = re.match(r"In '(?P<parent>[^']+)':", text)
    where = f" (asked by {parent['parent']})" if parent and parent["parent"] != "config" else ""
    if not choices:
        return f"{group}={option}: no such option{where}, and the group {group!r} has none"
    near = difflib.get_close_matches(option, choices, n=1)
    hint = f"; did you mean {group}={near[0]}?" if near else ""
    return f"{group}={option}: no such option{where}; choose one of {', '.join(choices)}{hint}"


def _replace_run_dir(value, run_dir: str):
    if isinstance(value, dict):
        return {k: _replace_run_dir(v, run_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_run_dir(v, run_dir) for v in value]
    if isinstance(value, str):
        return value.replace("${hydra:runtime.output_dir}", run_dir)
    return value
