"""The parity reference evaluates lingpack's evaluation samples: megatron-core's valid/test GPTDataset (the
reference's builder call, Megatron's split sizes) at `eval_sample_range`, row for row lingpack's eval batches.

The losses themselves: tests/parity/test_parity_routing.py (periodic, end-of-run valid and test, <= 1e-6)."""
import sys
from pathlib import Path

import pytest

from tests.optional import require
from tests.parity.test_parity_harness import parity_config

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))


def test_reference_evaluation_reads_lingpacks_valid_and_test_samples(tmp_path):
    require("megatron.core.datasets.gpt_dataset")
    from data_helpers import assert_matches_megatron

    from lingpack.parity.megatron_reference import eval_sample_range, megatron_datasets
    from lingpack.train.evaluate import eval_dataset, eval_num_samples

    rc = parity_config(tmp_path, ["train.steps=4", "train.eval_every=2", "train.eval_batches=2", "data.num_samples=8",
                                  "data.global_batch_size=2", "data.seq_length=32", "logger=none"])
    sizes = {s: eval_num_samples(rc.data, rc.train, s) for s in ("valid", "test")}
    assert sizes == {"valid": (4 // 2 + 1) * 2 * 2, "test": 2 * 2}  # Megatron's train_valid_test_num_samples
    _, *theirs = megatron_datasets(rc.data, [rc.data.num_samples, sizes["valid"], sizes["test"]], rc.data.cache_dir)
    B, E = rc.data.global_batch_size, rc.train.eval_batches
    # evaluations 0, 1 (steps 2, 4) and 2 (end of run) of the valid split; the test split's one
    for split, reference, evaluations in zip(("valid", "test"), theirs, (3, 1)):
        ours = eval_dataset(rc.data, rc.train, split)
        for k in range(evaluations):
            samples = eval_sample_range(k, E, B)
            assert list(samples) == list(range(k * E * B, (k + 1) * E * B))  # the never-rewound valid iterator
            for b in range(E):  # lingpack's Evaluator reads batches [k * E, (k + 1) * E)
                batch = ours[k * E + b]
                for row in range(B):
                    assert_matches_megatron({key: v[row] for key, v in batch.items()}, reference[samples[b * B + row]],
                                            f"{split} evaluation {k} batch {b} row {row}")
    first, last = eval_dataset(rc.data, rc.train, "valid")[0], theirs[0][eval_sample_range(2, E, B)[0]]
    assert (first["inputs"][0] != last["tokens"].numpy()).any()  # evaluations differ: a wrong index would show
