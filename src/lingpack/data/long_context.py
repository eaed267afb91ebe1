"""Long-context collator: whole documents packed into rows that split evenly over context parallelism.

    collator = LongContextCollator(seq_length=16384, context=8, chunk_size=64, eod_id=256, pad_id=257)
    batch, stats = collator(documents)        # documents: 1-D token arrays, each ending in its EOD

Rows hold `row_length` input tokens: seq_length rounded up to a multiple of 2 x context x chunk_size
(context x chunk_size without load balance), so every device's zigzag chunk is a whole number of KDA
chunks. The documents are packed as `data.packing=whole_documents` packs a split (`packing.pack_documents`:
first fit over `open_rows` rows, in the given order; a document longer than a row is the only one cut, into
row-length pieces that share one token, nothing dropped); `stats` counts the cut documents and their
pieces and the collator logs a warning when there are any. Rows go through `split.split_window`, so
inputs / targets / segment ids / positions / loss mask follow the Megatron semantics of the pipeline.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from lingpack.data.packing import PackedRows, pack_documents
from lingpack.data.split import SplitOptions, split_window

log = logging.getLogger("lingpack.data")


@dataclasses.dataclass(frozen=True)
class LongContextCollator:
    seq_length: int
    context: int
    chunk_size: int
    eod_id: int
    pad_id: int
    load_balance: bool = True
    eod_mask_loss: bool = True
    open_rows: int = 16

    def __post_init__(self):
        if min(self.seq_length, self.context, self.chunk_size, self.open_rows) < 1:
            raise ValueError(f"seq_length, context, chunk_size and open_rows must be >= 1; got {self}")
        if self.pad_id < -1 or self.pad_id == self.eod_id:
            raise ValueError(f"the collator pads rows: pad_id must be -1 (no pad token) or a token id other than "
                             f"eod_id={self.eod_id}; got {self.pad_id}")

    @property
    def multiple(self) -> int:
        return (2 if self.load_balance else 1) * self.context * self.chunk_size

    @property
    def row_length(self) -> int:
        return -(-self.seq_length // self.multiple) * self.multiple

    def __call__(self, documents) -> tuple[dict, dict]:
        """(batch of int32 [rows, row_length] arrays (split.BATCH_KEYS), stats dict)."""
        capacity = self.row_length + 1  # a window of T + 1 tokens: the last one is only a target
        documents = [np.asarray(doc, np.int64).reshape(-1) for doc in documents]
        documents = [doc for doc in documents if doc.size]
        if not documents:
            raise ValueError("the collator got no non-empty documents")
        for number, doc in enumerate(documents):
            if doc[-1] != self.eod_id:  # packed neighbours would otherwise share its segment id
                raise ValueError(f"document {number} does not end with eod_id={self.eod_id} (last token {doc[-1]}); "
                                 "preprocess with --append-eod")
        lengths = np.array([doc.size for doc in documents], np.int64)
        rows = PackedRows(np.arange(lengths.size), **pack_documents(lengths, capacity=capacity,
                                                                    open_rows=self.open_rows))
        windows = np.full((len(rows), capacity), self.pad_id, np.int64)
        for r in range(len(rows)):
            tokens = np.concatenate([documents[d][offset:offset + n] for d, offset, n in rows.pieces(r)])
            windows[r, :tokens.size] = tokens
        stats = rows.stats(lengths, capacity)
        if stats["cut_documents"]:
            log.warning("long-context collator: %d document(s) longer than a row of %d tokens cut into %d row-length "
                        "pieces (no token dropped); raise seq_length to keep them whole", stats["cut_documents"],
                        self.row_length, stats["cut_pieces"])
        options = SplitOptions(eod_id=self.eod_id, pad_id=self.pad_id, eod_mask_loss=self.eod_mask_loss)
        return split_window(windows, options), stats
