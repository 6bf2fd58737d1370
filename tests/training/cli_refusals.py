"""The refusal table check `h3lab train grpo` and `h3lab train nft` share: each bad argument list exits 2 with one
stderr line naming the value and the rule, fast, before any session is built and without touching `--out`."""

from __future__ import annotations

import time

from h3lab.frontends import train

LIMIT_S = 5.0


class Tripwire(BaseException):
    """Raised if a bad argument got as far as building a session."""


def assert_each_refused(command: str, cases, out, monkeypatch, capsys, limit_s: float = LIMIT_S) -> None:
    """`cases`: (name, argv, message) rows for `h3lab train <command>`, each run with `--mode off`."""
    import h3lab.app.session as session_module

    def tripwire(*a, **k):
        raise Tripwire("a session was built")

    monkeypatch.setattr(session_module, "Session", tripwire)
    for name, argv, message in cases:
        t0 = time.perf_counter()
        code = train.main([command, *argv, "--mode", "off"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(err) == 1 and err[0].startswith(f"h3lab train {command}: error: "), (name, err)
        assert message in err[0], (name, err[0])
        assert "Traceback" not in err[0], err[0]
        assert time.perf_counter() - t0 < limit_s, name
        assert not out.exists(), name
