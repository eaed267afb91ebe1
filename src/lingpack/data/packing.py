"""Whole-document packing: documents in Megatron's reading order, kept whole, packed first-fit into rows.

    plan = pack_documents(lengths_in_order, capacity=seq_length + 1, open_rows=16)
    rows = PackedRows(document_index, **plan)      # rows[r] -> (document, offset, length) pieces of row r

A row is a window of `capacity = seq_length + 1` tokens (the last one is only a target, as in Megatron's
samples). Documents are visited in order; each goes, whole, into the first of the `open_rows` rows still
being filled that has room for it (first fit). When none has room and all are open, the row opened first
is closed (emitted) and a new one opened; a row that is exactly full closes at once; the rows still open at
the end close in the order they were opened. The gap left in a closed row is padding (no loss, segment 0).

Only a document longer than a row is ever cut: into full rows of `capacity` tokens, each starting one
token before the previous one ends (Megatron's one-token overlap of consecutive samples, so every token
after the document's first is a target exactly once), and the tail, packed like any other document.
Nothing is dropped; `PackedRows.stats()` counts the cut documents and their pieces.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lingpack.data import indices as ix
from lingpack.errors import ConfigError


def pack_documents(lengths: np.ndarray, *, capacity: int, open_rows: int) -> dict[str, np.ndarray]:
    """Plan rows for documents of `lengths` (in reading order): arrays row_start [R + 1] (each row's first
    piece), piece_position / piece_offset / piece_length [P] (position in the reading order, token offset,
    tokens). Zero-length documents are skipped."""
    if capacity < 2 or open_rows < 1:
        raise ValueError(f"packing needs capacity >= 2 and open_rows >= 1; got {capacity}, {open_rows}")
    pieces: list[tuple[int, int, int]] = []      # (position, offset, length) in row order
    row_start: list[int] = [0]
    rows: list[list] = []                          # open rows: [room, [pieces]] in the order they were opened

    def close(row) -> None:
        pieces.extend(row[1])
        row_start.append(len(pieces))

    for position, length in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        offset = 0
        while length - offset > capacity:        # a full row, then the next piece starts at its last token
            close([0, [(position, offset, capacity)]])
            offset += capacity - 1
        rest = length - offset
        if rest == 0:
            continue
        row = next((row for row in rows if row[0] >= rest), None)
        if row is None:
            if len(rows) == open_rows:
                close(rows.pop(0))
            row = [capacity, []]
            rows.append(row)
        row[0] -= rest
        row[1].append((position, offset, rest))
        if row[0] == 0:
            rows.remove(row)
            close(row)
    for row in rows:
        close(row)
    table = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    return dict(row_start=np.asarray(row_start, dtype=np.int64), piece_position=table[:, 0].copy(),
                piece_offset=table[:, 1].copy(), piece_length=table[:, 2].copy())


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """One dataset split's rows (the whole-document counterpart of `indices.GPTIndices`).

    document_index: sequence ids in reading order (Megatron's document index for the epochs packed).
    row_start / piece_*: the plan of `pack_documents` over `sequence_lengths[document_index]`.
    """

    document_index: np.ndarray
    row_start: np.ndarray
    piece_position: np.ndarray
    piece_offset: np.ndarray
    piece_length: np.ndarray

    def __len__(self) -> int:
        return int(self.row_start.shape[0] - 1)

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """(sequence id, offset, length) of every piece of `row`, in row order."""
        lo, hi = int(self.row_start[row]), int(self.row_start[row + 1])
        return [(int(self.document_index[self.piece_position[p]]), int(self.piece_offset[p]),
                 int(self.piece_length[p])) for p in range(lo, hi)]

    def read(self, documents, row: int, capacity: int, pad_id: int, eod_id: int) -> np.ndarray:
        """The row's window: int64 [capacity], its pieces in order, then pad_id."""
        window = np.full(capacity, pad_id, dtype=np.int64)
        filled = 0
        for sequence, offset, length in self.pieces(row):
            tokens = documents.get(sequence, offset, length)
            ends_document = offset + length == int(documents.sequence_lengths[sequence])
            if ends_document and tokens[-1] != eod_id:  # its neighbour in the row would share its segment id
                raise ConfigError(f"{documents.name}: document {sequence} ends with token {int(tokens[-1])}, not "
                                  f"data.eod_id={eod_id}; whole-document packing needs every document to end with "
                                  "its EOD (preprocess with --append-eod) or set data.eod_id to the data's")
            window[filled:filled + length] = tokens
            filled += length
        return window

    def stats(self, sequence_lengths: np.ndarray, capacity: int) -> dict[str, int]:
        """Counts of the plan: rows, documents, cut documents and their pieces, document and padding tokens."""
        lengths = np.asarray(sequence_lengths, dtype=np.int64)[np.asarray(self.document_index)]
        cut = lengths > capacity
        tokens = int(np.asarray(self.piece_length).sum())
        return dict(rows=len(self), documents=int((lengths > 0).sum()), cut_documents=int(cut.sum()),
                    cut_pieces=int(np.bincount(np.asarray(self.piece_position), minlength=lengths.size)[cut].sum()),
                    tokens=tokens, padding_tokens=len(self) * capacity - tokens)


def build_packed_rows(sequence_lengths: np.ndarray, documents: np.ndarray, *, capacity: int, open_rows: int,
                      seed: int, num_rows: int | None, num_epochs: int | None = None,
                      name: str = "dataset") -> PackedRows:
    """The split's rows: Megatron's document index (its first shuffle, `numpy.random.RandomState(seed)`)
    over the fewest epochs that give `num_rows` rows, packed. Epochs are counted up from the number
    Megatron reads for `num_rows` samples of `capacity - 1` tokens (padding can need more); `num_rows`
    None packs one epoch, `num_epochs` exactly that many."""
    if len(documents) == 0:
        raise ConfigError(f"{name}: the split has no documents; give it a share of data.split or add data")
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    tokens_per_epoch = int(lengths[documents].sum())
    if tokens_per_epoch == 0:
        raise ConfigError(f"{name}: the split's documents are all empty; add data")
    if num_epochs is not None:
        epochs = num_epochs
    elif num_rows is None:
        epochs = 1
    else:
        epochs = ix.num_epochs_needed(tokens_per_epoch, capacity - 1, num_rows)
    while True:
        # One shuffle of all epochs' documents, as Megatron's document index (no separate final epoch).
        document_index = ix.build_document_index(documents, epochs, np.random.RandomState(seed), False)
        plan = pack_documents(lengths[document_index], capacity=capacity, open_rows=open_rows)
        rows = PackedRows(document_index, **plan)
        if num_epochs is not None or num_rows is None or len(rows) >= num_rows:
            return rows
        epochs += 1
