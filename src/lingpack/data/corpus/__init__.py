"""The bundled public-domain corpus (see LICENSE.md), tokenized on first use.

    prefix = bundled_corpus_prefix("outputs/cache")   # -> ".../bundled-shakespeare-byte-<hash>"
    DataConfig(source="megatron", paths=(prefix,), eod_id=BYTE_EOD_ID, pad_id=BYTE_PAD_ID,
               vocab_size=BYTE_VOCAB_SIZE, seq_length=256, ...)

Byte-level tokens: ids 0-255 are UTF-8 bytes, EOD = 256, pad = 257, vocab_size = 258.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from lingpack.data.indexed import bin_path, exists, idx_path
from lingpack.data.preprocess import preprocess
from lingpack.data.tokenizer import BYTE_EOD_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, ByteTokenizer

CORPUS_FILE = os.path.join(os.path.dirname(__file__), "shakespeare.jsonl.gz")

__all__ = ["bundled_corpus_prefix", "CORPUS_FILE", "BYTE_EOD_ID", "BYTE_PAD_ID", "BYTE_VOCAB_SIZE"]


def bundled_corpus_prefix(cache_dir: str) -> str:
    """Tokenize the bundled corpus into `cache_dir` unless already there; return its prefix."""
    with open(CORPUS_FILE, "rb") as stream:
        digest = hashlib.md5(stream.read()).hexdigest()[:12]  # a corpus update re-tokenizes
    prefix = os.path.join(os.path.abspath(cache_dir), f"bundled-shakespeare-byte-{digest}")
    if exists(prefix):
        return prefix
    os.makedirs(cache_dir, exist_ok=True)
    temporary = f"{prefix}.{uuid.uuid4().hex}.tmp"
    preprocess([CORPUS_FILE], temporary, tokenizer=ByteTokenizer(), append_eod=True)
    # .bin first, then .idx: `exists` (which needs both) never sees a half-written pair.
    os.replace(bin_path(temporary), bin_path(prefix))
    os.replace(idx_path(temporary), idx_path(prefix))
    return prefix
