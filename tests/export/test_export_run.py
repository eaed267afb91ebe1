"""Export and import on real runs (slow: four `run.py` trainings in subprocesses, ~10 min on 2 CPU cores).

* the default Ling3 trained by run.py -> `python -m lingpack.export` -> transformers (`trust_remote_code`):
  logits of the run's first batch, each document alone, equal lingpack's from the checkpoint within 1e-4, and
  greedy generation runs;
* a KimiLinear-expressible run -> export (`KimiLinearForCausalLM`) -> a new run with `model.init_from`: its first
  step's lm loss equals transformers' loss on the same batch (Megatron's reported lm loss: masked token sum
  over the token count of the whole batch, computed from transformers' per-document logits), and a rerun
  resumes from its checkpoint instead of reading init_from again.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from lingpack.export.runs import checkpoint_step_dir, load_checkpoint_model, read_run

from tests.optional import require
from tests.runner.test_runner_smoke import ENV, ROOT, records, run_py

torch = require("torch")
transformers = require("transformers")

pytestmark = pytest.mark.slow
SMALL = ["data.global_batch_size=2", "data.seq_length=64", "train.progress_bar=false", "train.log_every=1",
         "train.eval_every=0", "train.eval_test=false", "logger.mode=disabled"]
KIMI = ["model.kda.lower_bound=null", "model.mla.rope_type=none"]


def export(run_dir, out, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lingpack.export", "--run", str(run_dir), "--out", str(out)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def first_batch(run_dir):
    from lingpack.data.pipeline import make_iterator
    info = read_run(str(run_dir))
    return info, next(make_iterator(info.run_config.data, split="train", process_index=0, process_count=1))


def documents(batch):
    """(row, index array) of every document of the packed batch."""
    for row, seg in enumerate(np.asarray(batch["inputs_segmentation"])):
        for s in sorted(set(seg.tolist()) - {0}):
            yield row, np.flatnonzero(seg == s)


def hf_logits(hf, batch, row, idx):
    ids = torch.tensor(np.asarray(batch["inputs"])[row, idx][None], dtype=torch.long)
    positions = torch.tensor(np.asarray(batch["inputs_position"])[row, idx][None], dtype=torch.long)
    with torch.no_grad():
        return hf(ids, position_ids=positions).logits[0].float()


def test_default_run_exports_with_its_modeling_file(tmp_path):
    import jax.numpy as jnp
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    run_py([*SMALL, "train.steps=2", f"hydra.run.dir={run_dir}"], tmp_path)
    said = export(run_dir, out, tmp_path)
    assert "Ling3ForCausalLM with its modeling files" in said and "MTP layers: kept" in said, said
    info, batch = first_batch(run_dir)
    model = load_checkpoint_model(info.model, checkpoint_step_dir(info.checkpoint_dir, None)[0])
    ours = np.asarray(model(jnp.asarray(batch["inputs"]), jnp.asarray(batch["inputs_segmentation"]),
                            jnp.asarray(batch["inputs_position"])).logits_BTV)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    for row, idx in documents(batch):
        np.testing.assert_allclose(ours[row, idx], hf_logits(hf, batch, row, idx).numpy(), atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    prompt = tok("ROMEO:", return_tensors="pt")["input_ids"]
    assert prompt[0].tolist() == list(b"ROMEO:")   # the byte-level tokenizer the run trained with
    generated = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt.shape[1]


def test_kimi_run_exports_and_a_run_starts_from_it(tmp_path):
    source, out, run_dir = tmp_path / "source", tmp_path / "hf", tmp_path / "init"
    run_py([*SMALL, *KIMI, "train.steps=2", f"hydra.run.dir={source}"], tmp_path)
    assert "KimiLinearForCausalLM: transformers' own class" in export(source, out, tmp_path)
    init = [*SMALL, *KIMI, f"model.init_from={out}", "checkpoint.save_every=1", f"hydra.run.dir={run_dir}"]
    first = run_py([*init, "train.steps=1"], tmp_path)
    assert f"initialised from {out} (kimi_linear" in first.stdout + first.stderr
    step0 = records(run_dir)[0]["lm_loss"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    _, batch = first_batch(run_dir)
    total, count = 0.0, 0.0
    for row, idx in documents(batch):
        logits = hf_logits(hf, batch, row, idx).double()
        targets = torch.tensor(np.asarray(batch["targets"])[row, idx], dtype=torch.long)
        mask = torch.tensor(np.asarray(batch["targets_segmentation"])[row, idx] != 0, dtype=torch.float64)
        total += float((torch.nn.functional.cross_entropy(logits, targets, reduction="none") * mask).sum())
        count += float(mask.sum())
    assert step0 == pytest.approx(total / count, rel=1e-5)
    again = run_py([*init, "train.steps=2"], tmp_path)
    assert "not read: the run resumes from its own checkpoint" in again.stdout + again.stderr
    assert [r["step"] for r in records(run_dir)] == [1, 2]
    json.loads((run_dir / "summary.json").read_text())
