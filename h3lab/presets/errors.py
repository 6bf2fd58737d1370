"""`PresetError`: a speed preset's value, or its combination with the run, breaks a rule (one line naming both)."""

from __future__ import annotations

from ..errors import ValidationError


class PresetError(ValidationError):
    """A preset value or combination is refused; the message names the value and the rule."""
