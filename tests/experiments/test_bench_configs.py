"""The benchmark scripts build the models they name from the committed configs, as run.py resolves them."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_resolves_every_model():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "experiments" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_train", module)
    spec.loader.exec_module(module)
    for name in module.MODELS:
        cfg, B, T = module.model_config(name)
        assert cfg.vocab_size % 128 == 0 and cfg.vocab_size >= 258, (name, cfg.vocab_size)  # follows the data
        assert B * T > 0
    assert module.model_config("small24")[0].num_layers == 24
