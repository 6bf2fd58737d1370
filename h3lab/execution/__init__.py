"""The execution layer: how one forward runs, whatever the model and the request.

- `runtime.py`      modes, `REFERENCE_OPS` (the `off` table = the op signatures), the `Ops` dispatcher, the `Trace`
- `fast.py`         the `fast` op table; `fast_weights.py` its weight forms
- `context.py`      the execution context: what a forward depends on, in one value whose digest keys the graphs
- `graphs.py`       CUDA graphs of whole forwards; `module_tree.py` the module walk they use
- `devices.py`      the device a session or job runs on
- `arithmetic.py`   the arithmetic classes (which machines give the same non-strict bytes)
- `whatran.py`      which backends served a generation's op calls; whether strict can run in this process

May import: the shared foundations at the top of `h3lab` (errors, io_utils, hashing, config) and `h3kernels`
(`runtime` and `fast` only). Never the model, the run spec or anything above them.
"""
