"""OmegaConf resolvers the YAML in conf/ uses; registered by run.py before Hydra composes, and by lingpack.config.

    ${lingpack.null_or:VALUE,IF_NULL,OTHERWISE}   IF_NULL when VALUE is null, else OTHERWISE

(conf/experiment/phantom_sweep.yaml picks the kernel from kernel.max_segs with it: null is the
segment-native baseline job of the sweep.)
"""

from omegaconf import OmegaConf


def _null_or(value, if_null, otherwise):
    return if_null if value is None else otherwise


def register() -> None:
    """Register every resolver once per process (safe to call again)."""
    if not OmegaConf.has_resolver("lingpack.null_or"):
        OmegaConf.register_new_resolver("lingpack.null_or", _null_or)
