"""Print the command-line flags of one Megatron-LM checkout's `add_megatron_arguments`, one a line.

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


def main() -> int:
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    sys.meta_path.insert(0, _KernelFinder())
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    flags = sorted({o for action in parser._actions for o in action.option_strings if o.startswith("--")})
    flags.remove("--help")
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
