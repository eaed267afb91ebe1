"""Long-context collator: whole documents packed into rows that split evenly over context parallelism.

    collator = LongContextCollator(seq_length=16384, context=8, chunk_size=64, eod_id=256, pad_id=257)
    batch, stats = collator(documents)        # documents: 1-D token arrays, each ending in its EOD

Rows hold `row_length` input tokens: seq_length rounded up to a multiple of 2 x context x chunk_size
(context x chunk_size without load balance), so every device's zigzag chunk is a whole number of KDA
chunks. Documents are placed in order, whole; one that does not fit the rest of a row starts the next
row, and the gap is padding (no loss, segment 0). A document longer than a row is the only one ever cut:
it is truncated to one row, and `stats` counts it (truncated_documents, truncated_tokens) and the
collator logs a warning, so nothing is dropped silently. Rows go through `split.split_window`, so
inputs / targets / segment ids / positions / loss mask follow the Megatron semantics of the pipeline.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

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

    def __post_init__(self):
        if min(self.seq_length, self.context, self.chunk_size) < 1:
            raise ValueError(f"seq_length, context and chunk_size must be >= 1; got {self}")
        if self.pad_id < 0 or self.pad_id == self.eod_id:
            raise ValueError(f"the collator pads rows: pad_id must be a token id other than eod_id={self.eod_id}; "
                             f"got {self.pad_id}")

    @property
    def multiple(self) -> int:
        return (2 if self.load_balance else 1) * self.context * self.chunk_size

    @property
    def row_length(self) -> int:
        return -(-self.seq_length // self.multiple) * self.multiple

    def __call__(self, documents) -> tuple[dict, dict]:
        """(batch of int32 [rows, row_length] arrays (split.BATCH_KEYS), stats dict)."""
        capacity = self.row_length + 1  # a window of T + 1 tokens: the last one is only a target
        rows, row, used = [], [], 0
        stats = dict(documents=0, truncated_documents=0, truncated_tokens=0, padding_tokens=0)
        for doc in documents:
            doc = np.asarray(doc, np.int64).reshape(-1)
            if doc.size == 0:
                continue
            if doc[-1] != self.eod_id:  # packed neighbours would otherwise share its segment id
                raise ValueError(f"document {stats['documents']} does not end with eod_id={self.eod_id} (last token "
                                 f"{doc[-1]}); preprocess with --append-eod")
            stats["documents"] += 1
            if doc.size > capacity:
                stats["truncated_documents"] += 1
                stats["truncated_tokens"] += doc.size - capacity
                doc = doc[:capacity]
            if used + doc.size > capacity:
                rows.append(row)
                row, used = [], 0
            row.append(doc)
            used += doc.size
        if row:
            rows.append(row)
        if not rows:
            raise ValueError("the collator got no non-empty documents")
        windows = np.full((len(rows), capacity), self.pad_id, np.int64)
        for r, docs in enumerate(rows):
            tokens = np.concatenate(docs)
            windows[r, :tokens.size] = tokens
            stats["padding_tokens"] += capacity - tokens.size
        if stats["truncated_documents"]:
            log.warning("long-context collator: %d document(s) longer than a row of %d tokens were truncated "
                        "(%d tokens dropped); raise data.seq_length to keep them whole",
                        stats["truncated_documents"], self.row_length, stats["truncated_tokens"])
        options = SplitOptions(eod_id=self.eod_id, pad_id=self.pad_id, eod_mask_loss=self.eod_mask_loss)
        return split_window(windows, options), dict(stats, rows=len(rows))
