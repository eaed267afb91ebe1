"""Whole-document rows against Megatron's samples on the bundled corpus: documents cut, padding, planning time.

    python -m experiments.whole_document_packing.fill      # writes results/fill.json and prints its table

For each document unit (speech, scene), row length T and first-fit width (open rows), one epoch of the train
split in Megatron's document order (seed 1234):
- samples (data.packing=samples): the document stream cut into windows of T + 1 tokens, consecutive windows
  sharing one token; a document is cut when no single window holds it.
- whole_documents: lingpack.data.packing.pack_documents; a document is cut only when longer than a row.
Padding is the share of row slots holding no document token. Planning time is process CPU time per million
documents (the machine was shared: a rough figure, not a ratio).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from lingpack.data import indices as ix
from lingpack.data.corpus import bundled_corpus_prefix
from lingpack.data.indexed import IndexedDataset
from lingpack.data.packing import PackedRows, pack_documents

from experiments.provenance import commit

ROW_LENGTHS = (1024, 4096, 16384)
OPEN_ROWS = (1, 4, 16, 64)
PLURAL = dict(speech="speeches", scene="scenes")
HERE = os.path.dirname(os.path.abspath(__file__))


def samples_cut(lengths: np.ndarray, seq_length: int) -> int:
    """Documents no single Megatron window (tokens [k T, k T + T]) holds whole."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first_window = starts // seq_length
    return int(((ends - 1 > first_window * seq_length + seq_length) & (lengths > 0)).sum())


def main() -> None:
    cache = os.path.join(tempfile.gettempdir(), "lingpack-whole-document-packing")
    results = []
    for unit in ("speech", "scene"):
        dataset = IndexedDataset(bundled_corpus_prefix(cache, unit))
        documents = ix.split_sequence_range(len(dataset.sequence_lengths), "969,30,1", "train")
        order = ix.build_document_index(documents, 1, np.random.RandomState(1234), False)
        lengths = np.asarray(dataset.sequence_lengths, np.int64)[order]
        for T in ROW_LENGTHS:
            row = dict(unit=unit, documents=int(lengths.size), tokens=int(lengths.sum()), seq_length=T,
                       longer_than_a_row=int((lengths > T + 1).sum()),
                       samples=dict(rows=int((lengths.sum() - 1) // T), cut_documents=samples_cut(lengths, T)))
            for open_rows in OPEN_ROWS:
                repeats = 20
                start = time.process_time()
                for _ in range(repeats):
                    plan = pack_documents(lengths, capacity=T + 1, open_rows=open_rows)
                seconds = (time.process_time() - start) / repeats
                stats = PackedRows(order, **plan).stats(dataset.sequence_lengths, T + 1)
                row[f"whole_documents_{open_rows}"] = dict(
                    rows=stats["rows"], cut_documents=stats["cut_documents"],
                    padding=round(stats["padding_tokens"] / (stats["rows"] * (T + 1)), 4),
                    cpu_s_per_million_documents=round(seconds / lengths.size * 1e6, 2))
            results.append(row)
    result = dict(commit=commit(), machine="shared 2-core CPU host", open_rows=list(OPEN_ROWS), results=results)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "fill.json"), "w") as stream:
        json.dump(result, stream, indent=1)
    print(table(result), end="")


def table(result: dict) -> str:
    """The `whole_document_packing` results block, from fill.json."""
    widths = result["open_rows"]
    lines = [f"One epoch of the bundled corpus' train split, lingpack at commit {result['commit']}:", "",
             "| documents | row length T | cut by samples | cut by whole documents | padding, open rows "
             + " / ".join(map(str, widths)) + " | planning, CPU s per 1M documents (16 open rows) |",
             "|---|---|---|---|---|---|"]
    for r in result["results"]:
        pads = " / ".join(f"{100 * r[f'whole_documents_{k}']['padding']:.1f}%" for k in widths)
        lines.append(f"| {r['documents']} {PLURAL[r['unit']]} | {r['seq_length']} | {r['samples']['cut_documents']} | "
                     f"{r['whole_documents_16']['cut_documents']} | {pads} | "
                     f"{r['whole_documents_16']['cpu_s_per_million_documents']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
