"""The tokenizer files of an export, from the run's data tokenizer record (data/preprocess.py).

* a `tokenizer.json` the data was made with: copied, with a `tokenizer_config.json` naming its EOD (and pad);
* the byte-level tokenizer (data/tokenizer.py: ids 0-255 the UTF-8 bytes, EOD 256, pad 257): written as a
  `tokenizers` byte-level BPE without merges whose vocabulary puts byte b at id b (the ByteLevel alphabet of
  the `tokenizers` library maps each byte to one printable character), EOD and pad as added special tokens.
Either way `AutoTokenizer.from_pretrained(dir)` loads a `PreTrainedTokenizerFast` that encodes text to the
ids the run trained on.
"""

from __future__ import annotations

import json
import os
import shutil

EOD, PAD = "<|endoftext|>", "<|pad|>"


def _byte_tokenizer_json(eod_id: int, pad_id: int) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    table = _gpt2_byte_table()
    assert sorted(table.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())   # the table ByteLevel uses
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    for token_id, text in sorted([(eod_id, EOD), (pad_id, PAD)]):
        if tok.get_vocab_size(with_added_tokens=True) != token_id:
            raise ValueError(f"byte tokenizer: special token id {token_id} does not follow the 256 bytes")
        tok.add_special_tokens([AddedToken(text, special=True)])
    return tok.to_str()


def _gpt2_byte_table() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (printable bytes as themselves, the rest shifted past 255)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def write_tokenizer(record: dict | None, out_dir: str) -> str | None:
    """Tokenizer files for `record` (None: the data has no record, nothing is written); returns what was written."""
    if record is None:
        return None
    name, eod_id, pad_id = record.get("tokenizer"), int(record["eod_id"]), int(record.get("pad_id", -1))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
    if name == "byte":
        with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as stream:
            stream.write(_byte_tokenizer_json(eod_id, pad_id))
        config.update(eos_token=EOD, pad_token=PAD)
        what = "byte-level tokenizer"
    else:
        if not name or not os.path.isfile(name):
            raise FileNotFoundError(f"the data's tokenizer record names {name!r}, which is not a file here; copy that "
                                    "tokenizer.json into the export directory by hand")
        shutil.copyfile(name, os.path.join(out_dir, "tokenizer.json"))
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(name)
        config["eos_token"] = tok.id_to_token(eod_id)
        if pad_id >= 0:
            config["pad_token"] = tok.id_to_token(pad_id)
        what = f"tokenizer {name}"
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as stream:
        json.dump(config, stream, indent=2)
        stream.write("\n")
    return what
