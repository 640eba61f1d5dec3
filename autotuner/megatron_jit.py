"""Megatron's ``jit_fuser`` applied at a function's first call instead of at import.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and Megatron decorates 38 functions with it as its
modules are imported. Each decoration costs about 50 ms (torch._dynamo's ``optimize`` looks up and sets up
the backend), the first imports torch._dynamo and torch._inductor: about 2.5 s of every process that builds
a model, though torch.compile compiles nothing until a call. A finder on ``sys.meta_path`` runs that module
as it is, then wraps its ``jit_fuser`` so that each function gets the same decorator at its first call:
the same compiled function, its cost paid only by a process that calls one. Installed when autotuner is
imported; inert where Megatron was imported first.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"


def at_first_call(decorator: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """``decorator``, applied to each function when it is first called rather than when it is defined."""

    def decorate(function: Callable) -> Callable:
        decorated: Callable | None = None

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal decorated
            if decorated is None:
                decorated = decorator(function)
            return decorated(*args, **kwargs)

        return call

    return decorate


class _JitModuleLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.jit_fuser = at_first_call(module.jit_fuser)


class _JitModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != JIT_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _JitModuleLoader(spec.loader)
                sys.meta_path.remove(self)  # the module is imported once: no other import asks this finder
                return spec
        return None


def defer_jit_fuser() -> None:
    """Install the finder (once; it leaves ``sys.meta_path`` when it has wrapped the module)."""
    if not any(isinstance(finder, _JitModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _JitModuleFinder())
