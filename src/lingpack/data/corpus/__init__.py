"""The bundled public-domain corpus (see LICENSE.md), tokenized on first use.

    prefix = bundled_corpus_prefix("outputs/cache")   # -> ".../bundled-shakespeare-byte-<hash>"
    DataConfig(source="megatron", paths=(prefix,), eod_id=BYTE_EOD_ID, pad_id=BYTE_PAD_ID,
               vocab_size=BYTE_VOCAB_SIZE, seq_length=256, ...)

Byte-level tokens: ids 0-255 are UTF-8 bytes, EOD = 256, pad = 257, vocab_size = 258.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import uuid

from lingpack.data.indexed import bin_path, exists, idx_path
from lingpack.data.preprocess import preprocess, record_path
from lingpack.data.tokenizer import BYTE_EOD_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, ByteTokenizer

CORPUS_FILE = os.path.join(os.path.dirname(__file__), "shakespeare.jsonl.gz")

__all__ = ["bundled_corpus_prefix", "CORPUS_FILE", "BYTE_EOD_ID", "BYTE_PAD_ID", "BYTE_VOCAB_SIZE"]


UNITS = ("scene", "speech")


def _speeches(jsonl_path: str, out_path: str) -> None:
    """One JSON document per speech (a blank-line separated block: speaker, then lines)."""
    with gzip.open(jsonl_path, "rt", encoding="utf-8") as src, open(out_path, "w", encoding="utf-8") as dst:
        for line in src:
            for block in json.loads(line)["text"].split("\n\n"):
                if block.strip():
                    dst.write(json.dumps({"text": block.strip() + "\n"}) + "\n")


def bundled_corpus_prefix(cache_dir: str, unit: str = "scene") -> str:
    """Tokenize the bundled corpus into `cache_dir` unless already there; return its prefix.

    `unit` is what one document is: a whole "scene" (376 B to 27 KB) or a single "speech" (a few bytes
    to ~2 KB, many documents per sequence: the dense packing `make run` exercises).
    """
    if unit not in UNITS:
        raise ValueError(f"bundled corpus unit {unit!r} is not one of {UNITS}")
    with open(CORPUS_FILE, "rb") as stream:
        digest = hashlib.md5(stream.read()).hexdigest()[:12]  # a corpus update re-tokenizes
    suffix = "" if unit == "scene" else f"-{unit}"
    prefix = os.path.join(os.path.abspath(cache_dir), f"bundled-shakespeare-byte-{digest}{suffix}")
    if exists(prefix):
        return prefix
    os.makedirs(cache_dir, exist_ok=True)
    temporary = f"{prefix}.{uuid.uuid4().hex}.tmp"
    source = CORPUS_FILE
    if unit == "speech":
        source = f"{temporary}.jsonl"
        _speeches(CORPUS_FILE, source)
    preprocess([source], temporary, tokenizer=ByteTokenizer(), append_eod=True)
    if source != CORPUS_FILE:
        os.remove(source)
    # .bin first, then .idx: `exists` (which needs both) never sees a half-written pair.
    os.replace(bin_path(temporary), bin_path(prefix))
    os.replace(record_path(temporary), record_path(prefix))
    os.replace(idx_path(temporary), idx_path(prefix))
    return prefix
