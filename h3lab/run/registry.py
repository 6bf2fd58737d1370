"""What a `RunSpec` names but does not hold: registries of providers keyed by name, filled by the rooms that own them.

A run spec stays plain data (JSON plus sealed tensors), so everything behavioural it refers to -- a stepper, an
extension field's provider -- is looked up by name at run time. A higher room (the ablation matrix, the arms, later
the distributed, training and speed-preset rooms) registers its entries when it is imported; the run-spec room never
imports it at module level. `Registry.get(name)` imports the module declared for a name (`modules`) the first time the
name is asked for and it is not registered yet, so a spec that names, say, the `diffusers` stepper works without the
caller importing `h3lab.research.arms` first. A name nobody provides is `None`; callers turn that into a one-line
`RunSpecError` (fail closed).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import H3Error


class RunSpecError(H3Error):
    """A run description, its inputs or a value it names breaks a rule; the message names the value and the rule."""


class Registry:
    """name -> provider, with a lazy import of the module that provides a name (see the module docstring)."""

    def __init__(self, kind: str, modules: dict[str, str] | None = None):
        self.kind = kind
        self.modules = dict(modules or {})  # name -> module that registers it on import
        self._entries: dict[str, Any] = {}

    def register(self, name: str, provider: Any, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise RunSpecError(f"{self.kind} name {name!r}: must be a non-empty string")
        if name in self._entries and not replace and self._entries[name] is not provider:
            raise RunSpecError(f"{self.kind} {name!r} is already registered (pass replace=True to replace it)")
        self._entries[name] = provider

    def unregister(self, name: str) -> Any:
        """Remove `name` (tests, a room that withdraws a provider); returns what was registered, or None."""
        return self._entries.pop(name, None)

    def get(self, name: str) -> Any:
        """The provider of `name`, importing its declared module on first use; None when nobody provides it."""
        if name not in self._entries and name in self.modules:
            module = self.modules[name]
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name is None or not module.startswith(err.name):
                    raise  # the provider module exists but is broken: say so, do not hide it
        return self._entries.get(name)

    def where(self, name: str) -> str:
        """Who would provide `name` (for error messages)."""
        return self.modules.get(name, "no module is declared for it")

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(set(self._entries) | set(self.modules)))

    def registered(self) -> tuple[tuple[str, Any], ...]:
        """(name, provider) of every name registered so far, in registration order (no module is imported)."""
        return tuple(self._entries.items())
