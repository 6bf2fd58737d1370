"""h3kernels: the strict operator library of h3lab (the `kernels/` folder, imported as `h3kernels`).

One operator per file: the private `@triton.jit` kernel(s), a host launcher that validates its inputs, an autograd
wrapper (forward + backward), the float32 torch reference, and a docstring contract (accumulator dtype, reduction
axis and order, tile sizes fixing that order, cast points, split policy, refused shapes). Each file registers its
ops in `registry.STRICT_OPS` under the op names of `h3lab.execution.runtime.REFERENCE_OPS`. This package imports only
torch and triton.
"""


if __name__ == "kernels":
    # Imported as the top-level `kernels` from a checkout's root (the current directory is on sys.path under
    # `python -m ...`): that name belongs to the PyPI `kernels` distribution, which transformers (>= 5.25 requires
    # it) and diffusers import. Hand the import over to that distribution, found on sys.path without this checkout;
    # without it, stay an empty module without a file, as a bare namespace folder would be, so that availability
    # probes (transformers' `_is_package_available`) read "not installed". This folder itself is only `h3kernels`.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        __file__ = None  # noqa: F811 - the probes' sign of a namespace folder, not an install
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
else:
    from . import _interpreter_dot, _interpreter_patching, registry  # noqa: F401

    _interpreter_dot.install()  # CPU interpreter only: a dot whose bytes do not depend on a row's tile position
    _interpreter_patching.install()  # CPU interpreter only: the language patched once per launch (same bytes)
