"""Shared helpers for the data tests: random corpora on disk and megatron-core's GPTDataset oracle."""

from __future__ import annotations

import collections
import os

import numpy as np

from lingpack.data.indexed import write_indexed_dataset

VOCAB = 512
EOD = 511
PAD = 510


def random_documents(seed: int, num_documents: int, *, max_length: int = 300) -> list[np.ndarray]:
    """Documents ending in EOD; lengths mix 1-token documents, short ones and ones > seq_length."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(num_documents):
        kind = rng.random()
        if kind < 0.1:
            length = 1  # just the EOD
        elif kind < 0.8:
            length = int(rng.integers(2, 60))
        else:
            length = int(rng.integers(60, max_length))
        body = rng.integers(0, PAD, length - 1)  # ordinary tokens avoid PAD and EOD
        documents.append(np.append(body, EOD))
    return documents


def write_corpus(directory: str, name: str, seed: int, num_documents: int, **kwargs) -> str:
    prefix = os.path.join(str(directory), name)
    write_indexed_dataset(prefix, random_documents(seed, num_documents, **kwargs), np.uint16)
    return prefix


class OracleTokenizer:
    """The few tokenizer attributes megatron-core's datasets read."""

    def __init__(self, eod: int = EOD, pad: int = PAD, vocab_size: int = VOCAB) -> None:
        self.eod, self.pad, self.vocab_size = eod, pad, vocab_size
        self.unique_identifiers = collections.OrderedDict(
            [("class", "OracleTokenizer"), ("eod", eod), ("pad", pad), ("vocab_size", vocab_size)]
        )


def megatron_datasets(
    blend,
    *,
    split: str,
    sizes: list,
    seq_length: int,
    seed: int,
    cache_dir: str | None,
    eod_mask_loss: bool = False,
    reset_attention_mask: bool = False,
    reset_position_ids: bool = False,
    create_attention_mask: bool = False,
):
    """megatron-core's [train, valid, test] datasets for `blend` = (prefixes, weights or None)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=OracleTokenizer(),
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def assert_matches_megatron(ours_row: dict, theirs: dict, where: str) -> None:
    """Our batch row equals megatron-core's sample: tokens, labels, loss mask, positions."""
    np.testing.assert_array_equal(ours_row["inputs"], theirs["tokens"].numpy(), err_msg=where)
    np.testing.assert_array_equal(ours_row["targets"], theirs["labels"].numpy(), err_msg=where)
    np.testing.assert_array_equal(
        (ours_row["targets_segmentation"] != 0).astype(np.float32),
        theirs["loss_mask"].numpy(),
        err_msg=where,
    )
    np.testing.assert_array_equal(
        ours_row["inputs_position"], theirs["position_ids"].numpy(), err_msg=where
    )
