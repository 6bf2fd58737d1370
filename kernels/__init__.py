"""h3kernels: the strict operator library of h3lab (the `kernels/` folder, imported as `h3kernels`).

One operator per file: the private `@triton.jit` kernel(s), a host launcher that validates its inputs, an autograd
wrapper (forward + backward), the float32 torch reference, and a docstring contract (accumulator dtype, reduction
axis and order, tile sizes fixing that order, cast points, split policy, refused shapes). Each file registers its
ops in `registry.STRICT_OPS` under the op names of `h3lab.runtime.REFERENCE_OPS`. This package imports only
torch and triton.
"""

from . import _interpreter_dot, _interpreter_patching, registry  # noqa: F401

_interpreter_dot.install()  # CPU interpreter only: a dot whose bytes do not depend on a row's tile position
_interpreter_patching.install()  # CPU interpreter only: the language patched once per launch (speed, same bytes)
