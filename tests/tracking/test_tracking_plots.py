"""Plots are real PNG files of non-trivial size, and bad inputs say what is missing."""

import pytest

from lingpack.tracking.parity import compute_parity
from lingpack.tracking.plots import plot_loss_curves, plot_parity, plot_phantom_overhead

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, len(data)


def test_loss_curves(tmp_path):
    runs = {"lingpack": [{"step": s, "tokens": 4096 * s, "lm_loss": 10 / s ** 0.5} for s in range(1, 50)],
            "megatron": [{"step": s, "tokens": 4096 * s, "lm_loss": 10.01 / s ** 0.5} for s in range(1, 50, 5)]}
    _assert_png(plot_loss_curves(runs, tmp_path / "loss.png", x="tokens"))
    with pytest.raises(ValueError, match="no run has both 'step' and 'mtp_loss'"):
        plot_loss_curves(runs, tmp_path / "none.png", metric="mtp_loss")


def test_parity_plot(tmp_path):
    megatron = {s: 10.0 - 0.1 * s for s in range(1, 40)}
    lingpack = {s: v * (1 + (2e-4 if s == 17 else 1e-6 * (s % 3))) for s, v in megatron.items()}
    result = compute_parity(megatron, lingpack, tolerance=1e-4)
    _assert_png(plot_parity(result, tmp_path / "deep" / "parity.png"))


@pytest.mark.parametrize("kind", ["line", "bar"])
def test_phantom_overhead_plot(tmp_path, kind):
    rows = [{"design": design, "max_segs": m, "ratio": 1.0 + k * m / 64}
            for k, design in enumerate(["dense-mask", "cu_seqlens"], start=1) for m in (1, 4, 16, 64)]
    _assert_png(plot_phantom_overhead(rows, tmp_path / f"phantom_{kind}.png", kind=kind))
    with pytest.raises(ValueError, match=r"lack columns \['speedup'\]"):
        plot_phantom_overhead(rows, tmp_path / "x.png", y="speedup")
