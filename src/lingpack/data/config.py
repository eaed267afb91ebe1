"""`DataConfig`: everything the data pipeline needs, validated on construction."""

from __future__ import annotations

import dataclasses

from lingpack.data.indices import parse_blend, parse_split

SOURCES = ("megatron", "synthetic", "npy")
INDEX_MODES = ("build", "mmap_npy")
PACKINGS = ("samples", "whole_documents")
LENGTH_DISTRIBUTIONS = ("lognormal", "exponential", "uniform", "fixed")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Data pipeline settings.

    source:    "megatron" (`.bin/.idx` prefixes in `paths`, Megatron `--data-path` syntax, e.g.
               ("0.3", "prefix_a", "0.7", "prefix_b")), "npy" (one flat 1-D token `.npy` per path,
               documents end at each eod_id) or "synthetic" (random documents, see synthetic_*).
    split:     Megatron split string "train,valid,test" weights, e.g. "969,30,1".
    num_samples / eval_num_samples: Megatron's train / valid+test sample counts (its `sizes`);
               None reads one epoch. num_epochs (single dataset only) asks for that many epochs.
    pad_id:    -1 means "no pad token" (Megatron's default); must differ from eod_id.
    index_mode: "build" computes Megatron's indices (cached in cache_dir when set); "mmap_npy"
               memory-maps the `.npy` indices a Megatron run cached in cache_dir (its
               --data-cache-path), so both runs read exactly the same samples.
    worker_count: Grain worker processes (0 = in-process); read_threads: Grain reader threads.
    packing:   "samples" (Megatron's: the document stream cut into seq_length + 1 windows, shuffled) or
               "whole_documents" (documents kept whole, packed first-fit into padded rows, see packing.py);
               packing_open_rows: rows filled at once by first fit (1: each row filled in turn).
    """

    source: str = "megatron"
    paths: tuple[str, ...] = ()
    split: str = "969,30,1"
    seq_length: int = 256
    global_batch_size: int = 8
    seed: int = 1234
    eod_id: int = 256
    pad_id: int = -1
    vocab_size: int = 258
    eod_mask_loss: bool = False
    reset_attention_mask: bool = True
    reset_position_ids: bool = True
    cache_dir: str | None = None
    index_mode: str = "build"
    num_samples: int | None = None
    num_epochs: int | None = None
    eval_num_samples: int | None = None
    synthetic_num_documents: int = 2000
    synthetic_length_distribution: str = "lognormal"
    synthetic_mean_length: float = 300.0
    synthetic_length_sigma: float = 1.0
    synthetic_min_length: int = 1
    synthetic_max_length: int = 4096
    worker_count: int = 0
    read_threads: int = 2
    prefetch_buffer_size: int = 4
    check_token_range: bool = True
    packing: str = "samples"
    packing_open_rows: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):  # accept "0.3 a 0.7 b" and ["a"] alike
            object.__setattr__(self, "paths", tuple(self.paths.split()))
        else:
            object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        _choice("source", self.source, SOURCES)
        _choice("index_mode", self.index_mode, INDEX_MODES)
        _choice("packing", self.packing, PACKINGS)
        if self.packing_open_rows < 1:
            raise ValueError(f"packing_open_rows={self.packing_open_rows} must be >= 1 (1: fill one row at a time)")
        if self.packing == "whole_documents" and self.index_mode == "mmap_npy":
            raise ValueError("packing='whole_documents' builds its own row index from the documents; "
                             "index_mode='mmap_npy' reads Megatron's sample index: set index_mode=build")
        _choice("synthetic_length_distribution", self.synthetic_length_distribution,
                LENGTH_DISTRIBUTIONS)
        parse_split(self.split)
        if self.source != "synthetic" and self.paths:  # empty paths fail when the data is opened
            parse_blend(self.paths)
        if self.seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {self.seq_length}")
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if not 0 <= self.eod_id < self.vocab_size:
            raise ValueError(f"eod_id {self.eod_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.pad_id == self.eod_id:
            raise ValueError(
                f"pad_id == eod_id == {self.eod_id}: Megatron then treats no token as padding; "
                "set pad_id=-1 for 'no pad token' or give a distinct id"
            )
        if self.pad_id >= self.vocab_size or self.pad_id < -1:
            raise ValueError(f"pad_id {self.pad_id} must be -1 or in [0, {self.vocab_size})")
        if self.num_samples is not None and self.num_epochs is not None:
            raise ValueError("set num_samples or num_epochs, not both")
        for name in ("num_samples", "num_epochs", "eval_num_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.index_mode == "mmap_npy" and self.source != "megatron":
            raise ValueError("index_mode='mmap_npy' reads Megatron's caches: needs source='megatron'")
        if not 1 <= self.synthetic_min_length <= self.synthetic_max_length:
            raise ValueError(
                f"need 1 <= synthetic_min_length ({self.synthetic_min_length}) <= "
                f"synthetic_max_length ({self.synthetic_max_length})"
            )

    def split_options(self):
        from lingpack.data.split import SplitOptions

        return SplitOptions(
            eod_id=self.eod_id,
            pad_id=self.pad_id,
            eod_mask_loss=self.eod_mask_loss,
            reset_attention_mask=self.reset_attention_mask,
            reset_position_ids=self.reset_position_ids,
        )


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not one of {valid}")
