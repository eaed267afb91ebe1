"""Text / JSONL -> Megatron `.bin/.idx`, like Megatron-LM's `tools/preprocess_data.py`.

    python -m lingpack.data.preprocess --input corpus.jsonl --output-prefix data/corpus --append-eod
    python -m lingpack.data.preprocess --input a.txt b.txt.gz --output-prefix data/books \\
        --tokenizer path/to/tokenizer.json --eod-token '<|endoftext|>' --append-eod

Inputs: `.jsonl` (one JSON object per line, text under --json-key) or plain text (one document
per file, per blank-line-separated paragraph or per line: --txt-split); `.gz` is read transparently.
Each document becomes one sequence (no sentence splitting). Documents whose text is empty are
skipped and counted. Tokens are stored as uint16 when the vocabulary has < 65500 ids, else int32
(Megatron's choice). Beside them, `PREFIX.tokenizer-record.json` keeps the tokenizer's vocab_size, eod_id
and pad_id, so a run's `data.vocab_size/eod_id/pad_id: null` (conf/data/megatron.yaml) and the model's
vocabulary follow the data. Without --append-eod, documents are not separated by an EOD token, and
lingpack's segment ids then cannot see document boundaries: Megatron GPT data wants --append-eod.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

import numpy as np

from lingpack.data.indexed import IndexedDatasetWriter, token_dtype_for_vocab
from lingpack.data.tokenizer import load_tokenizer


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_texts(path: str, *, json_key: str = "text", txt_split: str = "file"):
    """Yield the document texts of one input file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: input file not found")
    stem = path[:-3] if path.endswith(".gz") else path
    with _open_text(path) as stream:
        if stem.endswith((".jsonl", ".json")):
            for line_number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg})") from error
                if not isinstance(record, dict) or json_key not in record:
                    raise ValueError(f"{path}:{line_number}: no {json_key!r} key (set --json-key)")
                yield str(record[json_key])
        elif txt_split == "file":
            yield stream.read()
        elif txt_split == "paragraph":
            paragraph: list[str] = []
            for line in stream:
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph)
                    paragraph = []
            if paragraph:
                yield "".join(paragraph)
        elif txt_split == "line":
            for line in stream:
                yield line.rstrip("\n")
        else:
            raise ValueError(f"--txt-split {txt_split!r} is not one of file, paragraph, line")


RECORD_SUFFIX = ".tokenizer-record.json"
RECORD_KEYS = ("vocab_size", "eod_id", "pad_id")


def record_path(prefix: str) -> str:
    return prefix + RECORD_SUFFIX


def write_tokenizer_record(prefix: str, tokenizer) -> None:
    """`PREFIX.tokenizer-record.json`: the ids a run needs to read the tokens right."""
    record = {"tokenizer": tokenizer.name, **{key: int(getattr(tokenizer, key)) for key in RECORD_KEYS}}
    with open(record_path(prefix), "w", encoding="utf-8") as stream:
        json.dump(record, stream, indent=2)
        stream.write("\n")


def read_tokenizer_record(prefix: str) -> dict | None:
    """The record written beside `prefix` by `preprocess`, or None (e.g. data made by Megatron-LM's tools)."""
    path = record_path(prefix)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def preprocess(
    inputs: list[str],
    output_prefix: str,
    *,
    tokenizer=None,
    append_eod: bool = True,
    json_key: str = "text",
    txt_split: str = "file",
) -> dict:
    """Tokenize every document of `inputs` into `output_prefix.bin/.idx`; returns counts."""
    tokenizer = tokenizer or load_tokenizer("byte")
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    documents = skipped = tokens = 0
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for path in inputs:
            for text in iter_texts(path, json_key=json_key, txt_split=txt_split):
                ids = tokenizer.encode(text)
                if ids.size == 0:
                    skipped += 1
                    continue
                if append_eod:
                    ids = np.append(ids, tokenizer.eod_id)
                writer.add_document(ids)
                documents += 1
                tokens += int(ids.size)
    if documents == 0:
        raise ValueError(f"no non-empty documents in {inputs}; nothing to write to {output_prefix}")
    write_tokenizer_record(output_prefix, tokenizer)
    return {"documents": documents, "skipped_empty": skipped, "tokens": tokens,
            "dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lingpack.data.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl / .txt files (.gz ok)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a local tokenizer.json")
    parser.add_argument("--eod-token", default=None, help="EOD token text for a tokenizer.json")
    parser.add_argument("--eod-id", type=int, default=None, help="EOD token id for a tokenizer.json")
    parser.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--txt-split", default="file", choices=("file", "paragraph", "line"))
    args = parser.parse_args(argv)
    options = {} if args.tokenizer == "byte" else {"eod_token": args.eod_token, "eod_id": args.eod_id}
    tokenizer = load_tokenizer(args.tokenizer, **options)
    counts = preprocess(args.input, args.output_prefix, tokenizer=tokenizer,
                        append_eod=args.append_eod, json_key=args.json_key, txt_split=args.txt_split)
    print(json.dumps({"output_prefix": args.output_prefix, **counts}))
    if not args.append_eod:
        print("note: without --append-eod documents carry no EOD; lingpack's segments need it",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
