"""Optional test dependencies: the oracles of the `parity` extra (CPU torch, fla-core, transformers, megatron-core).

`require(module)` imports and returns `module`. The test, or the whole file when called at module level, is
skipped only when the distribution that provides it is not installed at all; an installed package that fails
to import raises, so a broken install fails instead of passing as a missing extra. `lazy(module, name)` is a
module-level stand-in that calls `require` on first use, so that a file's tests which need no oracle run
without the extra. `installed(module)` skips the file at collection as `require` does, but leaves the import
to first use: megatron-core takes 6 to 10 s to import, which every pytest worker would otherwise pay while
collecting.
"""
from __future__ import annotations

import importlib
import importlib.util

import pytest


def _skip_unless_installed(module: str) -> None:
    top = module.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{top} is not installed: the oracles come with the parity extra (pip install -e '.[parity]')",
                    allow_module_level=True)


def require(module: str):
    _skip_unless_installed(module)
    return importlib.import_module(module)


def installed(module: str, name: str | None = None) -> "lazy":
    _skip_unless_installed(module)
    return lazy(module, name)


class lazy:  # noqa: N801  (used like a module or a class imported from one)
    def __init__(self, module: str, name: str | None = None):
        self._module, self._name = module, name

    def _target(self):
        found = require(self._module)
        return found if self._name is None else getattr(found, self._name)

    def __getattr__(self, attr):
        return getattr(self._target(), attr)

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)
