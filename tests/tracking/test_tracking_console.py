"""The run summary as labelled rows a terminal shows, and the sweep table's marks (experiment.py)."""
import json

from omegaconf import OmegaConf

from lingpack.experiment import SUMMARY_FORMATS, SweepSummary, _summary_notes
from lingpack.tracking.console import run_summary_text

SUMMARY = {"name": "r", "kernel": "chunked_aligned", "max_segs": 8, "status": "completed", "steps": 60, "last_step": 60,
           "final_lm_loss": 2.86, "first_lm_loss": 5.96, "tokens_per_s": 9249.0, "segments_per_row": 3.0,
           "phantom_overhead": 1.21, "dropped_documents": 980, "dropped_tokens": 8500, "dropped_token_fraction": 0.69,
           "overflow_steps": 60, "val_lm_loss": 2.9, "val_ppl": 18.2, "test_lm_loss": 3.0, "packing_parity_rel": 0.0,
           "parity_max_rel": 1e-6, "routing_total_flips": 0, "reference_seconds": 12.0, "something_new": 7}


def test_every_figure_once_in_labelled_rows_within_the_width():
    text = run_summary_text(SUMMARY, title="lingpack run summary: r", formats=SUMMARY_FORMATS,
                            notes=_summary_notes(SUMMARY), width=100)
    lines = text.splitlines()
    assert lines[0] == "lingpack run summary: r" and max(map(len, lines)) <= 100
    labels = [line.split()[0] for line in lines[1:] if not line.startswith(" " * 14)]
    assert labels == ["run", "lm", "speed", "packing", "overflow", "validation", "test", "parity", "other"]
    assert "overflow    loss over fewer tokens than the data holds: not comparable" in text
    assert "of all tokens 69.0%" in text and "max_segs 8" in text and "something_new 7" in text
    for value in ("2.8600", "5.9600", "9249", "18.20", "1.0e-06", "12.0000"):
        assert text.count(value) == 1, value


def test_overflow_row_without_drops_and_native_kernel():
    quiet = {"name": "r", "kernel": "chunked", "max_segs": None, "status": "completed", "steps": 2,
             "dropped_documents": 0, "dropped_tokens": 0, "overflow_steps": 0}
    text = run_summary_text(quiet, title="t", width=100)
    assert "overflow    none: every document fit" in text and "max_segs" not in text


def test_sweep_table_marks_jobs_whose_loss_is_not_comparable(tmp_path, capsys):
    jobs = [dict(kernel="chunked", max_segs=None, dropped_tokens=0, final_lm_loss=2.9),
            dict(kernel="chunked_aligned", max_segs=8, dropped_tokens=690, dropped_token_fraction=0.69,
                 final_lm_loss=3.4),
            dict(kernel="chunked_aligned", max_segs=64, dropped_tokens=0, final_lm_loss=2.9)]
    for i, job in enumerate(jobs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(job))
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    rows = capsys.readouterr().out.splitlines()
    assert rows[3].endswith("baseline: segment-native, no phantom segments")
    assert rows[4].endswith("loss not comparable (69% of tokens dropped)") and "comparable" not in rows[5]
    assert "not comparable: those jobs left documents beyond kernel.max_segs out" in rows[-1]
    assert "note" in (tmp_path / "sweep_summary.csv").read_text().splitlines()[0]
