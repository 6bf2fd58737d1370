"""The interpreter's language patching done once per launch (CPU, TRITON_INTERPRET=1 only; speed, never arithmetic).

Triton's interpreter runs a kernel by rebinding `triton.language`'s builtins to interpreted ones: a launch
(`GridExecutor.__call__`) patches the modules the kernel's globals hold, runs every program of the grid, then
restores them. It also re-patches on every call of a `@triton.jit` helper from inside the kernel
(`InterpretedFunction.__call__`), which rescans each module with `inspect.getmembers` — measured on a strict LoRA
gradient of the training tests: 2,917 patchings for 158 launches, 28% of the interpreter's time, and the helper's
patch finds nothing left to patch (the launch already replaced every builtin; what it re-sets is equivalent).

`install()` makes a launch patch both `triton.language` and `triton.language.core` (Triton's own helpers, such as
`tl.sum`, see the second; a kernel's globals usually hold only the first) and restore both when it ends, and makes a
helper call skip the patching when a launch of this thread is running (it has patched every language module a
helper's globals can hold); any other call (a launch itself, a helper that sees a module the
launch did not patch, anything outside a launch) patches exactly as Triton does. Nothing a kernel computes changes,
so no byte can: the arithmetic is the interpreter's own, and on the GPU the interpreter is never used. If Triton's
interpreter no longer has the two entry points this relies on, `install()` leaves it untouched and returns False.
"""

from __future__ import annotations

import inspect
import os
import threading

_state = threading.local()  # .launches: a stack of frozensets (the ids of the language modules each running launch patched)


class _Unpatched:
    """The scope of a skipped patching: nothing was changed, so nothing is restored."""

    @staticmethod
    def restore() -> None:
        return None


def _launches() -> list:
    stack = getattr(_state, "launches", None)
    if stack is None:
        stack = _state.launches = []
    return stack


def _cache_lookups(interpreter, tl) -> None:
    """Two per-launch lookups of the interpreter answered from tables built once (same answers, so same bytes):
    `_patch_builtin`'s `inspect.getmembers` scan of each language object (10 scans a launch: 19,000 for the 1,900
    launches of a strict LoRA gradient, 7% of its time), read here before any launch has patched anything, and
    `_get_np_dtype`, which rebuilt its dtype table on every call (261,000 calls, 6%). An object or dtype not in the
    tables takes Triton's own path."""
    patch_builtin = getattr(interpreter, "_patch_builtin", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if patch_builtin is None or getattr(interpreter, "_patch_attr", None) is None or np_dtype is None:
        return
    objects = (tl, tl.core, tl.core.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None))
    builtins = {obj: [(name, member) for name, member in inspect.getmembers(obj) if tl.core.is_builtin(member)]
                for obj in objects if obj is not None}  # modules and classes: hashed by identity

    def cached_patch_builtin(pkg, builder, scope):
        known = builtins.get(pkg)
        if known is None:
            return patch_builtin(pkg, builder, scope)
        for name, member in known:
            interpreter._patch_attr(pkg, name, member, builder, scope)  # looked up per call, as Triton's own does

    pointer = np_dtype(tl.pointer_type(tl.float32))
    by_name: dict = {}

    def cached_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        if type(scalar) is not tl.dtype:  # a dtype subclass: Triton's own lookup
            return np_dtype(tt_dtype)
        found = by_name.get(scalar.name)
        if found is None:
            found = by_name[scalar.name] = np_dtype(tt_dtype)
        return found

    cached_patch_builtin._h3_original = patch_builtin  # for tests that compare against Triton's own lookups
    cached_np_dtype._h3_original = np_dtype
    interpreter._patch_builtin = cached_patch_builtin
    interpreter._get_np_dtype = cached_np_dtype


def install() -> bool:
    """Patch the interpreter when TRITON_INTERPRET=1; idempotent. True when helper calls reuse their launch's patching."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if patch_lang is None or grid_call is None:
        return False
    if getattr(patch_lang, "_h3_once", False):
        return True
    import triton.language as tl

    languages = (tl, tl.core)
    cache: dict = {}

    def languages_of(fn) -> frozenset:
        found = cache.get(fn)
        if found is None:
            found = cache[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in languages)
        return found

    class _BothLanguages:  # what `_patch_lang` reads of a function: the modules its globals hold
        __globals__ = {"tl": tl, "core": tl.core}

    every = frozenset(id(m) for m in languages)

    class _Scopes:
        def __init__(self, *scopes):
            self.scopes = scopes

        def restore(self) -> None:
            for scope in reversed(self.scopes):
                scope.restore()

    def patched_once(fn):
        stack = _launches()
        if stack and stack[-1] is not None and languages_of(fn) <= stack[-1]:
            return _Unpatched
        scope = patch_lang(fn)
        if stack and stack[-1] is None:  # the launch's own patching: cover both modules for its helpers
            stack[-1] = every
            if languages_of(fn) != every:
                scope = _Scopes(scope, patch_lang(_BothLanguages))
        return scope

    def launch(self, *args, **kwargs):
        stack = _launches()
        stack.append(None)  # filled by the launch's own call of _patch_lang
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            stack.pop()

    _cache_lookups(interpreter, tl)
    patched_once._h3_once = True
    patched_once._h3_originals = (patch_lang, grid_call)  # for tests that compare against Triton's own patching
    interpreter._patch_lang = patched_once
    interpreter.GridExecutor.__call__ = launch
    return True
