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

The files are written into a temporary directory beside the output and renamed into place only once every
input has been read (as Megatron's builder finalises its index at the end): a failure or Ctrl-C leaves an
existing `PREFIX.bin/.idx` (and its record) as they were, and no partial files. A user error (a missing
input, invalid JSON at a line, a missing --json-key, no documents at all) is one line on stderr and exit
status 1.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile

import numpy as np

from lingpack.data.indexed import IndexedDatasetWriter, token_dtype_for_vocab
from lingpack.data.tokenizer import load_tokenizer
from lingpack.errors import ConfigError, MissingFileError


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_texts(path: str, *, json_key: str = "text", txt_split: str = "file"):
    """Yield the document texts of one input file; a file that cannot be read is a ConfigError naming it."""
    if not os.path.isfile(path):
        raise MissingFileError(f"{path}: input file not found")
    if txt_split not in ("file", "paragraph", "line"):
        raise ConfigError(f"--txt-split {txt_split!r} is not one of file, paragraph, line")
    where = [0]  # the line being read, for the error of an undecodable file
    try:
        yield from _texts(path, json_key, txt_split, where)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}:{where[0] + 1}: not UTF-8 text ({error.reason} at byte "
                          f"{error.start} of a block); give .jsonl / .txt files (.gz ok)") from None
    except (EOFError, OSError) as error:  # a truncated or non-gzip .gz, an unreadable file
        raise ConfigError(f"{path}:{where[0] + 1}: cannot be read ({error})") from None


def _texts(path: str, json_key: str, txt_split: str, where: list):
    stem = path[:-3] if path.endswith(".gz") else path
    with _open_text(path) as stream:
        if stem.endswith((".jsonl", ".json")):
            for line_number, line in enumerate(stream, 1):
                where[0] = line_number
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{path}:{line_number}: not valid JSON ({error.msg}, column {error.colno})"
                                      ) from None
                if not isinstance(record, dict) or json_key not in record:
                    found = sorted(record)[:5] if isinstance(record, dict) else type(record).__name__
                    raise ConfigError(f"{path}:{line_number}: no {json_key!r} key (it has {found}); name the "
                                      "text's key with --json-key")
                yield str(record[json_key])
        elif txt_split == "file":
            yield stream.read()
        elif txt_split == "paragraph":
            paragraph: list[str] = []
            for where[0], line in enumerate(stream, 1):
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph)
                    paragraph = []
            if paragraph:
                yield "".join(paragraph)
        else:
            for where[0], line in enumerate(stream, 1):
                yield line.rstrip("\n")


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
    """Tokenize every document of `inputs` into `output_prefix.bin/.idx`; returns counts.

    Nothing at `output_prefix` changes unless every input is read: the pair and the tokenizer record are
    written under a temporary directory beside it and renamed into place at the end.
    """
    tokenizer = tokenizer or load_tokenizer("byte")
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    for path in inputs:  # before any work: a typo in the last of many inputs fails at once
        if not os.path.isfile(path):
            raise MissingFileError(f"{path}: input file not found")
    name = os.path.basename(output_prefix)
    if not name:
        raise ConfigError(f"--output-prefix {output_prefix!r} names a directory; give a path prefix such as "
                          f"{os.path.join(output_prefix, 'corpus')!r}")
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=directory)  # same filesystem: renames are atomic
    try:
        partial = os.path.join(staging, name)
        documents = skipped = tokens = 0
        with IndexedDatasetWriter(partial, dtype) as writer:
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
            raise ConfigError(f"{', '.join(inputs)}: no document with text ({skipped} empty ones skipped); nothing "
                              f"written to {output_prefix}")
        write_tokenizer_record(partial, tokenizer)
        for suffix in (".bin", ".idx", RECORD_SUFFIX):
            os.replace(partial + suffix, output_prefix + suffix)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
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
    try:
        tokenizer = load_tokenizer(args.tokenizer, **options)
        counts = preprocess(args.input, args.output_prefix, tokenizer=tokenizer,
                            append_eod=args.append_eod, json_key=args.json_key, txt_split=args.txt_split)
    except (ConfigError, OSError) as error:  # the user's input or disk, not a bug: one line, no traceback
        print(f"preprocess: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"preprocess: interrupted; {args.output_prefix}.bin/.idx are as they were", file=sys.stderr)
        return 130
    print(json.dumps({"output_prefix": args.output_prefix, **counts}))
    if not args.append_eod:
        print("note: without --append-eod documents carry no EOD; lingpack's segments need it",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
