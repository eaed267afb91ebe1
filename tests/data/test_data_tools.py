"""Packing statistics, the stats and preprocess CLIs, tokenizers and the bundled corpus."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from lingpack.data.config import DataConfig
from lingpack.data.corpus import CORPUS_FILE, bundled_corpus_prefix
from lingpack.data.indexed import IndexedDataset
from lingpack.data.pipeline import make_iterator
from lingpack.data.preprocess import main as preprocess_main
from lingpack.data.preprocess import preprocess
from lingpack.data.segment_stats import batch_stats, segment_bound
from lingpack.data.stats import main as stats_main
from lingpack.data.tokenizer import BYTE_EOD_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, ByteTokenizer


def test_batch_stats_hand_worked():
    segmentation = np.array([[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0]], dtype=np.int32)
    stats = batch_stats({"inputs_segmentation": segmentation,
                         "targets_segmentation": np.where(segmentation > 0, 1, 0)})
    assert stats["segments_per_row_mean"] == 2.0 and stats["segments_per_row_max"] == 3
    assert stats["min_safe_max_segs"] == 4  # flattened [1, B*T]: 3 + 1 real segments
    assert stats["min_safe_max_segs_per_row"] == 3
    assert (stats["doc_length_min"], stats["doc_length_max"]) == (1, 4)
    assert stats["doc_length_mean"] == pytest.approx(10 / 4)
    assert stats["padding_fraction"] == pytest.approx(2 / 12)
    assert stats["loss_tokens"] == 10


def test_segment_bound_is_never_exceeded():
    cfg = DataConfig(source="synthetic", split="1,0,0", seq_length=64, global_batch_size=4,
                     eod_id=5, pad_id=6, vocab_size=50, synthetic_length_distribution="uniform",
                     synthetic_min_length=3, synthetic_max_length=12, num_samples=200)
    bound = segment_bound(3, 64, 4)
    for batch in make_iterator(cfg, process_index=0, process_count=1):
        assert batch_stats(batch)["min_safe_max_segs"] <= bound


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo")
    assert ids.tolist() == list("héllo".encode("utf-8")) and ids.max() < 256
    assert tokenizer.decode(np.append(ids, BYTE_EOD_ID)) == "héllo"
    assert (BYTE_EOD_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE) == (256, 257, 258)


def test_preprocess_jsonl_and_text(tmp_path, capsys):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["ab", "", "cde"]) + "\n")
    text = tmp_path / "book.txt"
    text.write_text("para one\nstill one\n\npara two\n")
    prefix = str(tmp_path / "out")
    assert preprocess_main(["--input", str(jsonl), str(text), "--output-prefix", prefix,
                            "--append-eod", "--txt-split", "paragraph"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 4 and report["skipped_empty"] == 1
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.uint16
    assert dataset[0].tolist() == [97, 98, BYTE_EOD_ID]
    assert ByteTokenizer().decode(dataset[2]) == "para one\nstill one\n"
    assert [int(d[-1]) for d in (dataset[i] for i in range(4))] == [BYTE_EOD_ID] * 4


def test_preprocess_errors_name_the_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        preprocess([str(bad)], str(tmp_path / "x"))
    wrong_key = tmp_path / "key.jsonl"
    wrong_key.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"key\.jsonl:1: no 'text' key"):
        preprocess([str(wrong_key)], str(tmp_path / "y"))


def test_preprocess_with_local_tokenizer_json(tmp_path):
    import tokenizers   # a core dependency
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eod>"])
    tokenizer.train_from_iterator(["the cat sat", "the dog ran"], trainer)
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "the cat ran"}) + "\n")
    prefix = str(tmp_path / "tok")
    preprocess_main(["--input", str(source), "--output-prefix", prefix, "--tokenizer", path,
                     "--eod-token", "<eod>", "--append-eod"])
    eod = tokenizer.token_to_id("<eod>")
    expected = [tokenizer.token_to_id(w) for w in ("the", "cat", "ran")] + [eod]
    assert IndexedDataset(prefix)[0].tolist() == expected
    assert preprocess_main(["--input", str(source), "--output-prefix", prefix, "--tokenizer", path]) == 1


def _snapshot(directory: Path) -> dict:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_failed_preprocess_leaves_an_existing_dataset_untouched(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(30)))
    out = tmp_path / "out"
    prefix = str(out / "corpus")
    assert preprocess_main(["--input", str(good), "--output-prefix", prefix, "--append-eod"]) == 0
    before = _snapshot(out)
    assert sorted(before) == ["corpus.bin", "corpus.idx", "corpus.tokenizer-record.json"]
    capsys.readouterr()
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_text(good.read_text() + "{not json\n")
    wrong_key = tmp_path / "key.jsonl"
    wrong_key.write_text(json.dumps({"content": "x"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {"invalid.jsonl:31: not valid JSON": [str(invalid)],
             "key.jsonl:1: no 'text' key": [str(wrong_key)],
             "empty.jsonl: no document with text": [str(empty)],
             "missing.jsonl: input file not found": [str(good), str(tmp_path / "missing.jsonl")]}
    for message, inputs in cases.items():
        assert preprocess_main(["--input", *inputs, "--output-prefix", prefix, "--append-eod"]) == 1, message
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) <= 3 and "Traceback" not in err, err
        assert _snapshot(out) == before, message  # byte-identical, and no partial file beside them


def test_interrupted_preprocess_leaves_no_partial_files(tmp_path):
    class Interrupting(ByteTokenizer):  # Ctrl-C arriving while the third document is tokenized
        def __init__(self):
            self.calls = 0

        def encode(self, text):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return super().encode(text)

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    preprocess([str(source)], str(out / "corpus"))
    before = _snapshot(out)
    with pytest.raises(KeyboardInterrupt):
        preprocess([str(source)], str(out / "corpus"), tokenizer=Interrupting())
    assert _snapshot(out) == before
    with pytest.raises(KeyboardInterrupt):
        preprocess([str(source)], str(tmp_path / "new" / "corpus"), tokenizer=Interrupting())
    assert list((tmp_path / "new").iterdir()) == []  # a first run leaves nothing behind either


def test_bundled_corpus(tmp_path):
    with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    prefix = bundled_corpus_prefix(str(tmp_path))
    assert bundled_corpus_prefix(str(tmp_path)) == prefix  # second call reuses the files
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(texts) > 50
    assert ByteTokenizer().decode(dataset[0]) == texts[0]
    dataset.check_token_range(BYTE_VOCAB_SIZE)
    cfg = DataConfig(paths=(prefix,), eod_id=BYTE_EOD_ID, pad_id=BYTE_PAD_ID,
                     vocab_size=BYTE_VOCAB_SIZE, seq_length=256, global_batch_size=8)
    batch = next(make_iterator(cfg, process_index=0, process_count=1))
    assert batch["inputs"].shape == (8, 256)


def test_stats_cli(tmp_path, capsys):
    prefix = bundled_corpus_prefix(str(tmp_path))
    assert stats_main([prefix + ".bin", "--seq-length", "128", "--global-batch-size", "4",
                       "--num-batches", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["batches_read"] == 20
    assert report["segments_per_batch_max"] <= report["segments_per_batch_bound"]
    assert report["recommended_max_segs"] >= report["segments_per_batch_max"]
    assert report["recommended_max_segs"] % 8 == 0
    # the run's own spelling, options between the overrides: micro-batches are what the kernel sees; the eod id
    # comes from the tokenizer record
    assert stats_main([prefix, "data.seq_length=128", "--num-batches", "20", "data.global_batch_size=4",
                       "train.micro_batches=2", "--json", "kernel.max_segs=1"]) == 0
    per_micro = json.loads(capsys.readouterr().out)
    assert per_micro["micro_batches"] == 2 and per_micro["seq_length"] == 128
    assert per_micro["segments_per_batch_max"] < report["segments_per_batch_max"]  # 2 rows, not 4
    assert per_micro["micro_batches_over_max_segs"] > 0 and per_micro["documents_dropped_at_max_segs"] > 0
    assert stats_main([prefix, "data.seq_len=128"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error: ") and "data.seq_len" in err[0], err


def test_stats_cli_reads_the_default_run_data(tmp_path, capsys):
    """No prefix: the data config of `python run.py OVERRIDES` (the bundled corpus), the run's own batches."""
    cache = f"data.cache_dir={tmp_path}"
    assert stats_main([cache, "--json", "kernel=chunked_aligned", "kernel.max_segs=8", "train.steps=5"]) == 0
    report = json.loads(capsys.readouterr().out)
    prefix = bundled_corpus_prefix(str(tmp_path), "speech")   # conf/data/bundled.yaml: one document per speech
    assert report["batches_read"] == 5 and report["seq_length"] == 256 and report["global_batch_size"] == 8
    assert report["documents"] == len(IndexedDataset(prefix)) and report["max_segs"] == 8
    assert report["documents_dropped_at_max_segs"] > 0  # ~24 documents per [8, 256] batch
    cfg = DataConfig(paths=(prefix,), split="969,30,1", eod_id=BYTE_EOD_ID, pad_id=BYTE_PAD_ID,
                     vocab_size=BYTE_VOCAB_SIZE, seq_length=256, global_batch_size=8, num_samples=40)
    segments = [batch_stats(b)["min_safe_max_segs"] for b, _ in zip(make_iterator(cfg, process_index=0,
                                                                                 process_count=1), range(5))]
    assert report["segments_per_batch_max"] == max(segments)  # exactly the batches the run trains on


def test_stats_cli_truncated_file_is_one_line(tmp_path, capsys):
    prefix = bundled_corpus_prefix(str(tmp_path))
    data = Path(prefix + ".bin").read_bytes()
    cut = str(tmp_path / "cut")
    for suffix in (".idx", ".tokenizer-record.json"):
        Path(cut + suffix).write_bytes(Path(prefix + suffix).read_bytes())
    Path(cut + ".bin").write_bytes(data[: len(data) // 2])
    assert stats_main([cut]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"Error: {cut}.bin: truncated data file"), err
