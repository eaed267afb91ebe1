"""Megatron indexed datasets: a `.bin` of raw tokens and an `.idx` that says where each sequence lies.

`.idx` layout (little endian), as megatron-core's `indexed_dataset.py` writes it:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    8 bytes   version, uint64, always 1
    1 byte    dtype code of the `.bin` tokens (see DTYPE_BY_CODE)
    8 bytes   sequence count N, uint64
    8 bytes   document count D, uint64 (= number of documents + 1)
    N * 4     sequence lengths, int32 (tokens per sequence)
    N * 8     sequence pointers, int64 (byte offset of each sequence in `.bin`)
    D * 8     document indices, int64 (0, then the sequence count after each document)
   [N * 1     sequence modes, int8, multimodal datasets only; ignored here]

GPT training indexes *sequences* (one per document when the preprocessor does not split sentences).
Readers memory-map both files, so they are cheap to open, safe to share between threads (read-only)
and pickle as their path alone (Grain worker processes re-open the maps).
"""

from __future__ import annotations

import os
import struct

import numpy as np

from lingpack.errors import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8

# Megatron's DType enum: the code stored in the `.idx` header for each token dtype.
DTYPE_BY_CODE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}


class IndexedDatasetError(ConfigError):
    """A `.bin`/`.idx` pair that cannot be read; the message names the file and the problem (a user error)."""


class DataFileNotFoundError(IndexedDatasetError, FileNotFoundError):
    """A dataset prefix whose `.bin` or `.idx` does not exist."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocessor picks: uint16 below 65500 token ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron `.bin`/`.idx` pair.

    `get(i, offset, length)` returns a view of sequence `i`'s tokens (no copy). Construction checks
    the header, that the index is complete, that the `.bin` holds every sequence it points to, and
    (unless `allow_empty_documents`) that no sequence is empty.
    """

    def __init__(self, prefix: str, *, allow_empty_documents: bool = False) -> None:
        self.prefix = str(prefix)
        self.allow_empty_documents = allow_empty_documents
        self._open()

    # Pickle as the path: memory maps do not cross process boundaries.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "allow_empty_documents": self.allow_empty_documents}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self.allow_empty_documents = state["allow_empty_documents"]
        self._open()

    def _open(self) -> None:
        index_file, data_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (index_file, data_file):
            if not os.path.isfile(path):
                raise DataFileNotFoundError(
                    f"{path}: not found; a Megatron dataset prefix {self.prefix!r} needs both "
                    f"{self.prefix}.bin and {self.prefix}.idx (make them with "
                    "`python -m lingpack.data.preprocess`)"
                )
        self.dtype, self.sequence_count, self.document_count = read_header(index_file)
        self.index_file, self.data_file = index_file, data_file

        needed = HEADER_BYTES + self.sequence_count * (4 + 8) + self.document_count * 8
        index_bytes = os.path.getsize(index_file)
        if index_bytes < needed:
            raise IndexedDatasetError(
                f"{index_file}: truncated index: {index_bytes} bytes, but its header announces "
                f"{self.sequence_count} sequences and {self.document_count} document indices, "
                f"which need {needed} bytes; re-run the preprocessor"
            )
        index_map = np.memmap(index_file, mode="r", dtype=np.uint8)
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index_map, np.int32, self.sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index_map, np.int64, self.sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index_map, np.int64, self.document_count, offset)
        self._validate_index()

        data_bytes = os.path.getsize(data_file)
        self._check_bin_size(data_bytes)
        if data_bytes == 0:  # numpy cannot map an empty file; there is nothing to read anyway
            self._tokens = np.zeros(0, dtype=self.dtype)
        else:
            self._tokens = np.memmap(data_file, mode="r", dtype=np.uint8)

    def _validate_index(self) -> None:
        where = self.index_file
        if self.document_count == 0 or self.document_indices[0] != 0:
            raise IndexedDatasetError(
                f"{where}: document indices must start with 0 (got "
                f"{self.document_indices[:1].tolist()}); the file is not a Megatron index"
            )
        if self.document_indices[-1] != self.sequence_count:
            raise IndexedDatasetError(
                f"{where}: last document index {int(self.document_indices[-1])} != sequence count "
                f"{self.sequence_count}; the index is corrupt or truncated"
            )
        negative = np.flatnonzero(self.sequence_lengths < 0)
        if negative.size:
            raise IndexedDatasetError(
                f"{where}: sequence {int(negative[0])} has negative length "
                f"{int(self.sequence_lengths[negative[0]])}; the index is corrupt"
            )
        if not self.allow_empty_documents:
            empty = np.flatnonzero(self.sequence_lengths == 0)
            if empty.size:
                raise IndexedDatasetError(
                    f"{where}: {empty.size} empty document(s), first at sequence "
                    f"{int(empty[0])}; drop empty texts when preprocessing (lingpack's "
                    "preprocess does) or pass allow_empty_documents=True"
                )

    def _check_bin_size(self, data_bytes: int) -> None:
        if self.sequence_count == 0:
            return
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
        beyond = np.flatnonzero(ends > data_bytes)
        if beyond.size or int(self.sequence_pointers.min()) < 0:
            first = int(beyond[0]) if beyond.size else int(np.argmin(self.sequence_pointers))
            raise IndexedDatasetError(
                f"{self.data_file}: truncated data file: {data_bytes} bytes, but sequence {first} "
                f"needs bytes [{int(self.sequence_pointers[first])}, {int(ends[first])}) "
                f"({self.sequence_count} sequences of {self.dtype.name} need {int(ends.max())} "
                "bytes); re-copy or re-run the preprocessor"
            )

    def __len__(self) -> int:
        return self.sequence_count

    @property
    def name(self) -> str:
        return self.data_file

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `index` (to its end when length is None)."""
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"{self.data_file}: tokens [{offset}, {offset + length}) out of range for "
                f"sequence {index} of length {sequence_length}"
            )
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._tokens, self.dtype, length, start) if length else np.zeros(
            0, self.dtype
        )

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(int(index))

    def check_token_range(self, vocab_size: int, *, chunk_tokens: int = 1 << 24) -> None:
        """Raise if any token is negative or >= vocab_size, naming the first offending sequence."""
        total = self.num_tokens
        flat = np.frombuffer(self._tokens, self.dtype, total, 0) if total else np.zeros(0, self.dtype)
        for start in range(0, total, chunk_tokens):
            chunk = flat[start : start + chunk_tokens]
            bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0))
            if bad.size:
                token_position = start + int(bad[0])
                byte_position = token_position * self.dtype.itemsize
                sequence = int(np.searchsorted(self.sequence_pointers, byte_position, "right") - 1)
                raise IndexedDatasetError(
                    f"{self.data_file}: token id {chunk[bad[0]]} in sequence {sequence} is outside "
                    f"the vocabulary [0, {vocab_size}); set vocab_size to the tokenizer's size or "
                    "re-tokenize"
                )


def read_header(index_file: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequence count, document count) from an `.idx` header, with clear errors."""
    with open(index_file, "rb") as stream:
        header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        raise IndexedDatasetError(
            f"{index_file}: truncated header ({len(header)} of {HEADER_BYTES} bytes)"
        )
    magic = header[:9]
    if magic != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{index_file}: bad magic {magic!r}, expected {INDEX_MAGIC!r}; not a Megatron "
            "(mmap) indexed dataset index"
        )
    (version,) = struct.unpack("<Q", header[9:17])
    if version != INDEX_VERSION:
        raise IndexedDatasetError(
            f"{index_file}: unsupported index version {version}, expected {INDEX_VERSION}"
        )
    code = header[17]
    if code not in DTYPE_BY_CODE:
        raise IndexedDatasetError(
            f"{index_file}: unknown dtype code {code}; valid codes are "
            + ", ".join(f"{c}={d.name}" for c, d in DTYPE_BY_CODE.items())
        )
    sequence_count, document_count = struct.unpack("<QQ", header[18:34])
    return DTYPE_BY_CODE[code], int(sequence_count), int(document_count)


class IndexedDatasetWriter:
    """Write a `.bin`/`.idx` pair byte-compatible with megatron-core's IndexedDatasetBuilder.

    Use as a context manager: `add_document(tokens)` per document, the index is written on exit.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise ValueError(
                f"token dtype {self.dtype} has no Megatron dtype code; use one of "
                + ", ".join(d.name for d in DTYPE_BY_CODE.values())
            )
        directory = os.path.dirname(self.prefix)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._data = open(bin_path(self.prefix), "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens, sequence_lengths: list[int] | None = None) -> None:
        """Append one document (optionally made of several sequences whose lengths sum to it)."""
        values = np.asarray(tokens)
        if values.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = values.min(), values.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"{self.prefix}.bin: token ids span [{low}, {high}], which {self.dtype.name} "
                    f"cannot hold [{info.min}, {info.max}]; choose a wider dtype"
                )
        array = values.astype(self.dtype, copy=False).reshape(-1)
        lengths = [array.size] if sequence_lengths is None else list(sequence_lengths)
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {lengths} do not sum to the {array.size} tokens")
        self._data.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        self._data.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        # Each pointer is the byte offset where its sequence starts in `.bin`.
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path(self.prefix), "wb") as index:
            index.write(INDEX_MAGIC)
            index.write(struct.pack("<Q", INDEX_VERSION))
            index.write(struct.pack("<B", CODE_BY_DTYPE[self.dtype]))
            index.write(struct.pack("<Q", len(lengths)))
            index.write(struct.pack("<Q", len(self.document_indices)))
            index.write(lengths.tobytes(order="C"))
            index.write(pointers.tobytes(order="C"))
            index.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._data.close()


def write_indexed_dataset(prefix: str, documents, dtype: np.dtype | type = np.uint16) -> str:
    """Write an iterable of token arrays as one document each; returns the prefix."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for tokens in documents:
            writer.add_document(tokens)
    return prefix
