"""The model's packing-invariance test (tests/models/test_ling3.py) with each Pallas KDA kernel selected.

Packed rows and the same documents run one per row give equal logits, losses, expert loads and every
parameter gradient: the Pallas forward and backward kernels carry no state across documents.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))   # test_ling3 imports packing_cases bare
import test_ling3  # noqa: E402


@pytest.mark.parametrize("kda_impl", ["pallas_varlen", "pallas_segment"])
def test_ling3_packed_equals_per_document_with_pallas_kda(kda_impl):
    test_ling3.test_packed_equals_per_document(kda_impl, "dot_product")
