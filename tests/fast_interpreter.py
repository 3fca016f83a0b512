"""Triton's CPU interpreter without its repeated patching (tests only; kernels and results unchanged).

Under TRITON_INTERPRET=1 every launch patches `triton.language` (each builtin of tl, tl.core, tl.math and the
tensor class, found by `inspect.getmembers`) so that it runs on numpy, and triton 3.6 redoes that whole patch
on every call of a `@triton.jit` helper inside the kernel, for every program of the grid: on the KV attention
kernels that re-patching is ~40% of the interpreter's time. The patch is the same each time (the same
interpreter builder), and the launch's own patch is undone when the launch ends, so here a helper call
patches only the language modules its launch has not patched yet (a helper in another module that names
`tl.core` still gets that module patched, as before); everything else runs as Triton wrote it.

`install()` applies this to triton 3.6's interpreter only, checked by the names it replaces; on any other
version it changes nothing (the suite is then slower, not different). tests/conftest.py installs it.
"""

from __future__ import annotations

import inspect

# triton 3.6's InterpretedFunction.__call__, the code `helper` below replaces (compared token by token)
_HELPER_CALL = """
    def __call__(self, *args, **kwargs):
        # This is a device function call
        _patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e
"""
_launch_langs: list[set[int]] = []  # per active launch: ids of the language modules already patched


def install() -> bool:
    import triton
    import triton.language as tl

    if not triton.__version__.startswith("3.6"):
        return False
    try:
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    names = ("GridExecutor", "InterpretedFunction", "_patch_lang", "InterpreterError")
    if not all(hasattr(itp, n) for n in names):
        return False
    grid_call, fn_call = itp.GridExecutor.__call__, itp.InterpretedFunction.__call__
    if getattr(fn_call, "_moec_fast", False):
        return True
    if inspect.getsource(fn_call).split() != _HELPER_CALL.split():  # not the code this replaces: leave it
        return False
    langs_of: dict[int, frozenset[int]] = {}

    def langs(fn) -> frozenset[int]:  # the modules _patch_lang(fn) patches: tl / tl.core as fn's globals name them
        key = id(fn)
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[key]

    def launch(self, *args, **kwargs):
        _launch_langs.append(set(langs(self.fn)))  # the original __call__ patches these for the launch
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _launch_langs.pop()

    def helper(self, *args, **kwargs):  # triton 3.6's InterpretedFunction.__call__, minus the repeated patch
        need = langs(self.fn)
        done = _launch_langs[-1] if _launch_langs else None
        if done is None or not need <= done:
            itp._patch_lang(self.fn)
            if done is not None:
                done |= need
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise itp.InterpreterError(repr(e)) from e

    helper._moec_fast = True
    itp.GridExecutor.__call__ = launch
    itp.InterpretedFunction.__call__ = helper
    return True
