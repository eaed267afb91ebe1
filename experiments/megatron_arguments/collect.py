"""Print the command-line flags of one Megatron-LM checkout's `add_megatron_arguments`, one a line; with
`--check FILE`, parse the arguments in FILE (one shell-quoted argument list) with that parser, run Megatron-LM's
`validate_args` on them and build its transformer config from them, and print what came out as JSON.

Run by list_arguments.py with the checkout on PYTHONPATH. Megatron-LM's argument groups are partly generated
from its config dataclasses (megatron/training/argument_utils.py), so the names are read from the parser it
builds, not from the source text. Two things of a GPU machine are stood in for, neither of which defines an
argument: the Triton kernel modules (imported at package import, never called here) and Python 3.12's
`typing.override` on Python 3.11.
"""
import argparse
import importlib.abc
import importlib.machinery
import sys
import types
import typing

import typing_extensions

# Modules whose top level needs Triton: kernels only (MoE paged stash, Mamba SSD ops, fused GDN/CE kernels).
KERNEL_MODULES = ("megatron.core.transformer.moe.ops.paged_stash", "megatron.core.ssm.ops",
                  "megatron.core.fusions.linear_cross_entropy.blackwell.triton",
                  "megatron.core.fusions.fused_pre_gated_delta_rule")


class _Stand(types.ModuleType):
    """A module any attribute of which is another stand-in (a class for CamelCase names, used as a base)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {}) if name[:1].isupper() else _Stand(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):   # decorators (`@triton.jit`) return what they wrap
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Stand(self.__name__)


class _KernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == m or name.startswith(m + ".") for m in KERNEL_MODULES):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stand(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def check(parser, path: str) -> dict:
    """Megatron-LM's own checks of an argument list: parse, validate_args, core_transformer_config_from_args."""
    import contextlib
    import io
    import shlex
    words = shlex.split(open(path).read())
    args = parser.parse_args(words)
    args.rank, args.world_size = 0, 1    # what torchrun's environment gives one process
    from megatron.training.arguments import validate_args
    from megatron.training.argument_utils import core_transformer_config_from_args
    with contextlib.redirect_stdout(io.StringIO()):   # validate_args prints every argument
        validate_args(args)
    config = core_transformer_config_from_args(args)
    keys = ("num_layers", "hidden_size", "multi_latent_attention", "experimental_attention_variant",
            "linear_attention_freq", "moe_layer_freq", "num_moe_experts", "moe_router_topk", "moe_router_num_groups",
            "moe_router_group_topk", "moe_router_score_function", "moe_router_enable_expert_bias",
            "moe_router_topk_scaling_factor", "moe_z_loss_coeff", "mtp_num_layers", "mtp_loss_scaling_factor",
            "rotary_percent", "rope_type", "qk_layernorm", "calculate_per_token_loss", "bf16", "init_method_std")
    return {"arguments": len(words), "validate_args": "passed", "config_class": type(config).__name__,
            "config": {k: getattr(config, k, None) for k in keys},
            "data": {k: getattr(args, k) for k in ("data_path", "split", "seq_length", "micro_batch_size",
                                                   "global_batch_size", "seed", "padded_vocab_size", "lr", "min_lr",
                                                   "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
                                                   "train_iters")}}


def main() -> int:
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    sys.meta_path.insert(0, _KernelFinder())
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    if sys.argv[1:2] == ["--check"]:
        import json
        try:
            result = check(parser, sys.argv[2])
        except (Exception, SystemExit) as err:   # SystemExit: argparse refusing an argument
            result = {"validate_args": "failed", "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(result, default=str))
        return 0
    flags = sorted({o for action in parser._actions for o in action.option_strings if o.startswith("--")})
    flags.remove("--help")
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
