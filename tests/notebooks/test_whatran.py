"""`h3lab.execution.whatran`: the "what ran" line from a trace summary (pure), and what strict needs in a running process --
checked in fresh interpreters, because Triton decides interpreter or compiler when the kernels are created. The fresh
interpreters open the random 2-block tiny snapshot (`tiny_snapshot`): when Triton chooses is the same for any
snapshot, and its strict pass runs several times faster under the interpreter than the 6-block embedded default's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from h3lab.execution import whatran

SUMMARY = {"mode": "strict", "device": "cpu", "forwards": 20, "untraced_forwards": 0,
           "ops": {"linear": {"strict": 520}, "attention": {"strict": 80}, "rope": {"strict": 160}}}


def test_strict_all_strict_in_the_interpreter():
    line = whatran.what_ran(SUMMARY, "strict")
    assert line == "strict: 760 strict / 0 torch op calls in 20 forwards (strict kernels in Triton's interpreter, cpu)"
    cuda = whatran.what_ran({**SUMMARY, "device": "cuda:0"}, "strict")
    assert cuda.endswith("(strict Triton kernels, cuda:0)")


def test_auto_that_fell_back_says_so_and_why():
    summary = {**SUMMARY, "mode": "auto", "ops": {"linear": {"torch": 1000}, "rope": {"torch": 230}}}
    reasons = ["auto fallback: linear: device cpu needs TRITON_INTERPRET=1 (Triton's interpreter) for strict mode",
               "auto fallback: rope: device cpu needs TRITON_INTERPRET=1 (Triton's interpreter) for strict mode"]
    assert whatran.what_ran(summary, "auto", reasons) == (
        "auto → torch: 0 strict / 1,230 torch op calls in 20 forwards "
        "(device cpu needs TRITON_INTERPRET=1 (Triton's interpreter) for strict mode)")  # the reason as recorded
    assert whatran.what_ran(summary, "auto").endswith("(reason not recorded)")
    mixed = {**summary, "ops": {"linear": {"strict": 900, "torch": 100}}}
    other = ["auto fallback: linear: linear: K=7 is not a multiple of 16"] * 3
    assert whatran.what_ran(mixed, "auto", other) == (
        "auto → strict + torch: 900 strict / 100 torch op calls in 20 forwards "
        "(strict kernels in Triton's interpreter, cpu; linear: K=7 is not a multiple of 16)")


def test_fast_names_its_backend_not_nothing():
    summary = {**SUMMARY, "mode": "fast", "forwards": 2, "ops": {"linear": {"fast": 256}, "attention": {"fast": 50}}}
    assert whatran.what_ran(summary, "fast") == (
        "fast: 0 strict / 0 torch / 306 fast op calls in 2 forwards (FP8 projections and attention, not strict)")
    mixed = {**summary, "ops": {"linear": {"fast": 250, "torch": 6}}}
    assert whatran.what_ran(mixed, "fast").startswith("fast → torch + fast: 0 strict / 6 torch / 250 fast op calls")


def test_off_audit_overrides_and_ablations():
    off = {**SUMMARY, "mode": "off", "ops": {"linear": {"torch": 1616, "override": 4}}}
    assert whatran.what_ran(off, "off", ablations=["A6"]) == (
        "off: 0 strict / 1,616 torch / 4 override op calls in 20 forwards "
        "(the reference torch arithmetic; 4 planted by ablations); ablations on: A6")
    audit = whatran.what_ran({**SUMMARY, "ops": {"linear": {"torch": 10}}}, "audit")
    assert audit.startswith("audit: 0 strict / 10 torch") and "not strict" in audit
    assert whatran.what_ran({"forwards": 0}, "off") == "off: no forward ran"
    untraced = whatran.what_ran({"forwards": 3, "untraced_forwards": 3, "ops": {}}, "off")
    assert "untraced" in untraced and "backend unknown" in untraced
    # The counts come from the summary: the backend totals.
    assert whatran.backend_counts(off) == {"torch": 1616, "override": 4}


def _fresh(code: str, interpret: bool | None, snapshot) -> dict:
    """Run `code` in a fresh interpreter (TRITON_INTERPRET set, unset or left out), `SNAPSHOT` in it replaced by the
    snapshot folder's repr, and return the JSON it prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    code = textwrap.dedent(code).replace("SNAPSHOT", repr(str(snapshot)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_strict_can_be_set_up_in_a_running_process_before_the_first_kernel(tiny_snapshot):
    got = _fresh("""
        import json, os
        from h3lab import Session; from h3lab.execution import whatran
        before = whatran.strict_setup("cpu")
        session = Session(SNAPSHOT)
        after_session = whatran.strict_setup(session.device)
        enabled = whatran.enable_interpreter()
        r = session.generate("A fox.", width=32, height=32, frames=22, steps=1, seed=1, mode="strict")
        line = whatran.what_ran(r.trajectory.manifest["trace"], "strict")
        print(json.dumps({"before": before.__dict__, "after_session": after_session.__dict__,
                          "enabled": enabled.__dict__, "env": os.environ.get("TRITON_INTERPRET"), "line": line,
                          "now": whatran.strict_setup("cpu").__dict__}))
    """, interpret=False, snapshot=tiny_snapshot)
    assert got["before"]["ready"] is False and got["before"]["can_enable"] is True
    assert "can still be set now" in got["before"]["line"]
    assert got["after_session"]["can_enable"] is True  # a Session creates no Triton kernel
    assert got["enabled"]["ready"] is True and got["env"] == "1"
    assert got["line"].startswith("strict: ") and "/ 0 torch" in got["line"] and "interpreter" in got["line"]
    assert got["now"]["ready"] is True and got["now"]["can_enable"] is False


def test_after_the_first_generation_strict_needs_a_fresh_kernel(tiny_snapshot):
    got = _fresh("""
        import json, os
        from h3lab import Session; from h3lab.execution import whatran
        session = Session(SNAPSHOT)
        off = session.generate("A fox.", width=32, height=32, frames=22, steps=1, seed=1, mode="off")
        auto = session.generate("A fox.", width=32, height=32, frames=22, steps=1, seed=1, mode="auto")
        compiled = whatran.strict_setup("cpu")
        enabled = whatran.enable_interpreter()  # too late: must not set it
        env = os.environ.get("TRITON_INTERPRET")
        reasons = [r.fallback for r in auto.trace.fallbacks]
        line = whatran.what_ran(auto.trajectory.manifest["trace"], "auto", reasons)
        recorded = sorted({whatran.fallback_reason(r) for r in reasons})
        os.environ["TRITON_INTERPRET"] = "1"  # what a user might try by hand
        late = whatran.strict_setup("cpu")
        try:
            session.generate("A fox.", width=32, height=32, frames=22, steps=1, seed=1, mode="auto")
            auto_late = "ran"
        except Exception as err:
            auto_late = f"{type(err).__name__}: {err}"
        print(json.dumps({"compiled": compiled.__dict__, "enabled": enabled.__dict__, "env": env, "line": line,
                          "recorded": recorded,
                          "late": late.__dict__, "auto_late": auto_late, "cuda": whatran.strict_setup("cuda").ready}))
    """, interpret=False, snapshot=tiny_snapshot)
    c = got["compiled"]
    assert c["ready"] is False and c["can_enable"] is False and c["auto_ok"] is True
    assert "restart the kernel" in c["line"]
    assert got["enabled"]["ready"] is False and got["env"] is None
    assert got["line"].startswith("auto → torch: 0 strict / ")
    assert any(got["line"].endswith(f"({reason})") for reason in got["recorded"])  # quoted, not invented
    # Set by hand after the kernels exist: strict is still impossible, and what the line says about auto is what
    # happens -- where auto calls kernels on the CPU it breaks too (the panel then refuses it up front).
    assert got["late"]["ready"] is False
    assert got["late"]["auto_ok"] == (got["auto_late"] == "ran"), got
    assert got["auto_late"] == "ran" or "driver" in got["auto_late"]
    assert got["cuda"] is True
