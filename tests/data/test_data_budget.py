"""What the data holds against what the run reads, checked when the config is built (data/budget.py, config.py):
missing files named first, splits too short for one sample, explicit sample counts below the run's, the
empty test split said once, and Megatron's default sample count (a run reads as many epochs as it needs)."""
import json
from pathlib import Path

import pytest

from lingpack import config as config_lib
from lingpack.data.pipeline import make_iterator
from lingpack.data.preprocess import main as preprocess_main
from lingpack.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 documents of 100-130 byte tokens: one epoch of the train split is ~70 samples of 64 tokens."""
    root = tmp_path_factory.mktemp("budget")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"{i:03d} " + "x" * (95 + i % 30)}) + "\n" for i in range(40)))
    assert preprocess_main(["--input", str(docs), "--output-prefix", str(root / "docs"), "--append-eod"]) == 0
    return str(root / "docs")


def build(tmp_path, *overrides):
    plain = config_lib.compose(["data.seq_length=64", "data.global_batch_size=4", *overrides], run_dir=str(tmp_path))
    return config_lib.build(plain, str(tmp_path))


def megatron(prefix):
    return ["data=megatron", f"data.paths=[{prefix}]"]


def test_missing_prefix_is_named_before_the_tokenizer_record(tmp_path):
    with pytest.raises(ConfigError, match=r"/nothing/here\.idx: not found; a Megatron dataset prefix"):
        build(tmp_path, *megatron("/nothing/here"))   # no record either: the file comes first


def test_truncated_data_file_is_named_at_config_time(tmp_path, corpus):
    cut = tmp_path / "cut"
    for suffix in (".idx", ".tokenizer-record.json"):
        (tmp_path / f"cut{suffix}").write_bytes(Path(corpus + suffix).read_bytes())
    data = Path(corpus + ".bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:1000])
    with pytest.raises(ConfigError, match=rf"{cut}\.bin: truncated data file: 1000 bytes, but sequence \d+ needs "
                                          rf"bytes .* {len(data)} bytes\); re-copy or re-run the preprocessor"):
        build(tmp_path, *megatron(str(cut)))


def test_split_too_short_for_one_sample(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"the valid split of .*docs \(data.split='969,30,1' gives it 1 of 40 "
                                          r"documents, \d+ tokens\), less than one sample of data.seq_length \+ 1 = "
                                          r"1025 tokens; give valid a larger share of data.split .* or set "
                                          r"train.eval_every=0"):
        build(tmp_path, *megatron(corpus), "data.seq_length=1024")
    with pytest.raises(ConfigError, match=r"the train split .* less than one sample .* lower data.seq_length"):
        build(tmp_path, *megatron(corpus), "data.seq_length=8192", "train.eval_every=0")


def test_empty_test_split_is_one_note_and_no_test_evaluation(tmp_path, corpus):
    rc = build(tmp_path, *megatron(corpus))
    assert not rc.train.eval_test and len(rc.notes) == 1
    assert rc.notes[0].startswith("no test evaluation: the test split of") and "none of its 40 documents" in rc.notes[0]
    rc = build(tmp_path, *megatron(corpus), "data.split='90,5,5'")
    assert rc.train.eval_test and rc.notes == ()


def test_explicit_sample_counts_below_the_run(tmp_path, corpus):
    with pytest.raises(ConfigError, match=r"data.num_samples=40, but the run reads 240 train samples \(train.steps x "
                                          r"data.global_batch_size\)"):
        build(tmp_path, *megatron(corpus), "data.num_samples=40")
    with pytest.raises(ConfigError, match=r"data.num_epochs=1 gives \d+ train samples, but the run reads 240"):
        build(tmp_path, *megatron(corpus), "+data.num_epochs=1")
    with pytest.raises(ConfigError, match=r"the unweighted blend .* holds \d+ train samples \(one epoch of each "
                                          r"dataset\), but the run reads 480; give each prefix a weight"):
        build(tmp_path, "data=megatron", f"data.paths=[{corpus},{corpus}]", "train.steps=120")


def test_a_run_longer_than_one_epoch_reads_the_next(tmp_path, corpus):
    """Megatron's default: train.steps x global_batch_size samples, as many epochs as that takes."""
    rc = build(tmp_path, *megatron(corpus), "train.steps=30")   # 120 samples: ~1.7 epochs of ~70
    assert rc.data.num_samples == 120
    batches = list(make_iterator(rc.data, split="train", process_index=0, process_count=1))
    assert len(batches) >= 30


def test_config_time_batch_and_context_checks(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    with pytest.raises(ConfigError, match=r"data.global_batch_size=4 does not split into train.micro_batches=3"):
        build(tmp_path, cache, "train.micro_batches=3")
    with pytest.raises(ConfigError, match=r"data.seq_length=100 does not divide into 8 chunks \(parallel.context=4 "
                                          r"x 2, parallel.load_balance=true\); make it a multiple of 8"):
        build(tmp_path, cache, "parallel=context", "data.seq_length=100")
    build(tmp_path, cache, "parallel=context", "data.seq_length=128")
