"""Tokenizers for preprocessing: a byte-level default and any local `tokenizer.json`.

Byte-level: token ids 0-255 are the UTF-8 bytes of the text, EOD is 256, pad is 257, and the
vocabulary size is 258 (models may round their embedding table up; the data never holds ids >= 258).
"""

from __future__ import annotations

import os

import numpy as np

from lingpack.errors import ConfigError, MissingFileError

BYTE_EOD_ID = 256
BYTE_PAD_ID = 257
BYTE_VOCAB_SIZE = 258


class ByteTokenizer:
    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eod_id = BYTE_EOD_ID
    pad_id = BYTE_PAD_ID

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face `tokenizers` `tokenizer.json` from disk (no download)."""

    def __init__(self, path: str, *, eod_token: str | None = None, eod_id: int | None = None,
                 pad_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise MissingFileError(f"{path}: tokenizer file not found (give a local tokenizer.json)")
        self.name = path
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as error:  # noqa: BLE001  tokenizers raises a bare Exception for any bad file
            raise ConfigError(f"{path}: not a tokenizer.json that `tokenizers` can read ({error})") from None
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self.eod_id = self._token_id(eod_token, eod_id, "eod")
        self.pad_id = self._token_id(pad_token, None, "pad") if pad_token else -1

    def _token_id(self, token: str | None, token_id: int | None, role: str) -> int:
        if token_id is not None:
            if not 0 <= token_id < self.vocab_size:
                raise ConfigError(f"{self.name}: {role} id {token_id} outside [0, {self.vocab_size})")
            return int(token_id)
        if token is None:
            raise ConfigError(
                f"{self.name}: name the end-of-document token (e.g. --eod-token '<|endoftext|>') "
                "or give its id (--eod-id)"
            )
        found = self._tokenizer.token_to_id(token)
        if found is None:
            raise ConfigError(f"{self.name}: {role} token {token!r} is not in the vocabulary")
        return int(found)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def load_tokenizer(spec: str = "byte", **kwargs):
    """"byte" for the byte-level tokenizer, else a path to a `tokenizer.json`."""
    if spec == "byte":
        return ByteTokenizer()
    return JsonTokenizer(spec, **kwargs)
