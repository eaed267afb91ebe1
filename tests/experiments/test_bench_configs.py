"""The benchmark scripts build the models they name from the committed configs, as run.py resolves them."""
from experiments.bench_train import bench


def test_bench_train_resolves_every_model():
    for name in bench.MODELS:
        cfg, B, T = bench.model_config(name)
        assert cfg.vocab_size % 128 == 0 and cfg.vocab_size >= 258, (name, cfg.vocab_size)  # follows the data
        assert B * T > 0
    assert bench.model_config("small24")[0].num_layers == 24
