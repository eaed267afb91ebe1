"""Megatron-compatible data pipeline on Grain (see pipeline.py for the flow).

Public API: DataConfig, make_iterator, make_dataset, batch_stats, bundled_corpus_prefix, and the
byte-level token ids BYTE_EOD_ID / BYTE_PAD_ID / BYTE_VOCAB_SIZE. Imported lazily so that
`import lingpack.data.indexed` does not pull in Grain.
"""

_EXPORTS = {
    "DataConfig": "lingpack.data.config",
    "make_iterator": "lingpack.data.pipeline",
    "make_dataset": "lingpack.data.pipeline",
    "batch_stats": "lingpack.data.segment_stats",
    "bundled_corpus_prefix": "lingpack.data.corpus",
    "BYTE_EOD_ID": "lingpack.data.tokenizer",
    "BYTE_PAD_ID": "lingpack.data.tokenizer",
    "BYTE_VOCAB_SIZE": "lingpack.data.tokenizer",
    "BATCH_KEYS": "lingpack.data.split",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lingpack.data' has no attribute {name!r}")
