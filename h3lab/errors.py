"""User-facing errors. Each message is one line naming the offending value and the rule it breaks; front ends
print `str(err)` and keep the session."""


class H3Error(ValueError):
    """Base of every error a user can cause with bad input (paths, settings, media, checkpoints)."""


class CheckpointError(H3Error):
    """A snapshot or checkpoint file is missing, malformed, or does not match the config (names file and key)."""


class ValidationError(H3Error):
    """A generation setting breaks a rule (geometry, duration, references, anchors)."""
