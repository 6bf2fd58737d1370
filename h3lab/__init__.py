"""h3lab: a research workbench for MiniMax-H3 (see README.md and docs/ARCHITECTURE.md).

Public names: `H3Config`, `H3Transformer`, `Session`. The packages, bottom layer first: the foundations here
(`errors`, `io_utils`, `hashing`, `config`), `schema`, `execution`, `checkpoint`, `run`, `model`, `adapters`,
`stochastic`, `presets`, `distributed`, `shapes`, `training`, `components`, `research`, `app`, `frontends`
(tests/foundation/test_imports.py holds the rules). `H3Transformer` and `Session` are lazy attributes (PEP 562):
`import h3lab` loads only the config, so a submodule may import `__version__` from the package without a cycle.
"""

from __future__ import annotations

from typing import Any

from .config import H3Config

__version__ = "0.1.0"
__all__ = ["H3Config", "H3Transformer", "Session", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "H3Transformer":
        from .model import H3Transformer

        return H3Transformer
    if name == "Session":
        from .app.session import Session

        return Session
    raise AttributeError(f"module 'h3lab' has no attribute {name!r}")
