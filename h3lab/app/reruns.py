"""A session's re-runs of sealed run specs on its own models: the first drift between two of its results and the
replay of a sealed trajectory.

Contract
- `drift(session, a, b) -> DriftReport`: each result's sealed `RunSpec` re-runs exactly as it ran (inputs, schedule,
  mode, ablation factors, reuse) with every operator boundary hashed (`drift.compare`), on the session's DiT of their
  one variant (two variants: a one-line `ValidationError`); arms are labelled `<tag>[+lora]:<hash12>`.
- `drift_lines(report)`: what the REPL prints for it (the summary, the first drift inside a block when it differs,
  a warning when the reference run did not repeat its own hashes, at most three layout notes).
- `verify(session, path)`: replay a sealed trajectory's spec with the session's DiT of its variant
  (`trajectory.verify`); a variant the session does not serve is a one-line `ValidationError`.
- `attention(session, result, block, ...)`: the result's sealed spec re-run with an attention probe at one block
  (`views.attention_probe.attention_view`) on the session's DiT of its variant; the text rows are labelled with the
  prompt's tokens (`components.text_encoder.token_strings`; rows before the prompt -- anchor and reference labels,
  vision blocks -- are "ctx").
- `compare(session, a, b, settings=None, labels=None, drift=True)`: a matched-seed A/B (`views.compare`). A side is a
  `GenerationResult` or a mapping of setting overrides generated on `settings` (its seed for both sides; a side may
  not set another seed) -- with "lora": PATH (or None: no adapter) for that side only, the session's adapter put back
  afterwards. With `drift`, the first drift between the two runs (`drift` above; skipped, with a note, when the two
  ran on different transformers).
Each re-run takes the session's `lock` around its model work and gets the DiT a sealed spec needs (the blocks its
preset runs) and its `models` lookup from the one step they share, `prepared.sealed_dit`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from ..components.store import VARIANTS
from ..research.drift import pass_label  # noqa: F401 - re-exported: the front ends print pass numbers as drift does
from ..errors import H3Error, ValidationError

KEEP_ADAPTER = object()  # a compare side without a "lora" key runs with the session's adapter


def drift(session: Any, a: Any, b: Any):
    """First drift between two `GenerationResult`s of `session` (see the module docstring)."""
    from ..research import drift as D
    from .prepared import sealed_dit

    specs = [r.trajectory.spec for r in (a, b)]
    variants = {spec.variant for spec in specs}
    if len(variants) != 1:
        raise ValidationError(
            f"drift between a {a.settings.task} and a {b.settings.task} run: they use different transformers "
            f"({', '.join(sorted(variants))}); compare two runs of one variant"
        )
    with session.lock:
        variant = variants.pop()
        model, models = sealed_dit(session, variant, [spec.preset for spec in specs])
        arms = [D.Execution(spec, model, label=f"{spec.tag}{'+lora' if spec.adapters else ''}:"
                                                 f"{r.trajectory_hash[:12]}", models=models)
                for spec, r in zip(specs, (a, b))]
        return D.compare(*arms)


def drift_lines(report) -> list[str]:
    lines = [report.summary()]
    if report.first is not None and report.first_in_block is not None and report.first_in_block != report.first:
        lines.append(f"first drift inside a block: {report.first_in_block}")
    if report.a_repeatable is False:
        lines.append("warning: the reference run did not repeat its own hashes (non-deterministic arithmetic)")
    from ..research.drift import metadata_line

    for note in report.metadata[:3]:
        lines.append(f"layout differs: {metadata_line(note)}")
    return lines


def verify(session: Any, path: str | os.PathLike):
    """Replay the sealed trajectory at `path` with `session`'s DiT of its variant (see the module docstring)."""
    from ..run import trajectory as T
    from .prepared import sealed_dit

    traj = T.load(path)
    variant = traj.spec.variant
    if variant not in VARIANTS:
        raise ValidationError(f"trajectory {str(path)!r} ran on model {variant!r}: the session serves "
                              f"{', '.join(VARIANTS)}")
    with session.lock:
        model, models = sealed_dit(session, variant, [traj.spec.preset])
        return T.verify(traj, model, device=session.device, models=models,
                        execution={**session.store.plan.spec_fields(), "adapters": list(session.adapters)})



def text_labels(session: Any, result: Any, text: str = "word") -> tuple[list[str] | None, list[int] | None]:
    """One label per text row of `result` -- the prompt's tokens on the last rows ("ctx" before them, one word) --
    and, with `text="word"`, the word index of each row so a word the tokenizer split is one region (`text="token"`:
    None, a region per row); (None, None) when the tokenizer cannot say (then the rows are numbered only)."""
    from ..components.text_encoder import prompt_words, token_strings

    if text not in ("word", "token"):
        raise ValidationError(f"text={text!r}: must be 'word' (a region per word) or 'token' (a region per text row)")
    rows = result.layout.num_text_tokens
    try:
        if text == "token":
            tokens, words = token_strings(session.path, result.settings.prompt), None
        else:
            tokens, words = prompt_words(session.path, result.settings.prompt)
    except H3Error:
        return None, None
    if len(tokens) > rows:
        return None, None
    ctx = rows - len(tokens)
    labels = ["ctx"] * ctx + tokens
    if words is None:
        return labels, None
    return labels, [0] * ctx + [w + (1 if ctx else 0) for w in words]


def attention(session: Any, result: Any, block: int, text: str = "word", **options: Any):
    """The attention view of `result` at `block` (see the module docstring); `text` "word" (a region per prompt word)
    or "token" (a region per text row); options: step, heads, query, audio_bin, chunk."""
    from .prepared import sealed_dit
    from ..research.views.attention_probe import attention_view

    spec = result.trajectory.spec
    labels, words = text_labels(session, result, text)
    with session.lock:
        model, models = sealed_dit(session, spec.variant, [spec.preset])
        return attention_view(spec, model, block, text_labels=labels, text_words=words, models=models, **options)


def _side_label(side: Any, fallback: str) -> str:
    if isinstance(side, Mapping):
        return ", ".join(f"{k}={'off' if v is None else v}" for k, v in side.items()) or fallback
    return fallback


def _differences(a: Any, b: Any) -> tuple[str, str]:
    """What tells two results apart in words: the parts of their settings summaries the other lacks, and their
    adapters ("A" / "B" when nothing differs)."""
    from ..adapters.field import describe

    pa, pb = a.settings.summary().split(", "), b.settings.summary().split(", ")
    da, db = [p for p in pa if p not in pb], [p for p in pb if p not in pa]
    la, lb = (describe(r.trajectory.spec.adapters) for r in (a, b))
    if la != lb:
        da, db = da + [la or "no LoRA"], db + [lb or "no LoRA"]
    return ", ".join(da) or "A", ", ".join(db) or "B"


def _generate_side(session: Any, settings: Any, side: Mapping[str, Any]):
    overrides = dict(side)
    if "seed" in overrides:
        raise ValidationError(f"compare side {_side_label(side, '')!r} sets seed={overrides['seed']!r}: a matched-seed "
                              "A/B runs both sides on the settings' seed (pass seed= in the settings)")
    lora = overrides.pop("lora", KEEP_ADAPTER)
    kept = session.adapters
    try:
        if lora is None:
            session.unload_lora()
        elif lora is not KEEP_ADAPTER:
            session.load_lora(lora)
        return session.generate(settings, **overrides)
    finally:
        session.adapters = kept


def compare(session: Any, a: Any, b: Any, settings: Any = None, labels: Sequence[str] | None = None,
            drift: bool = True):
    """The matched-seed A/B of two sides (see the module docstring)."""
    from ..research.views.compare import CompareError, compare_results

    sides = (a, b)
    if any(isinstance(s, Mapping) for s in sides):
        settings = session.settings(settings) if not hasattr(settings, "replace") else settings
    results = [_generate_side(session, settings, s) if isinstance(s, Mapping) else s for s in sides]
    if results[0].seed != results[1].seed:
        raise CompareError(f"seeds {results[0].seed} vs {results[1].seed}: a matched-seed A/B compares two runs of one "
                           "seed")
    if labels is None:
        differ = _differences(*results)
        labels = (_side_label(a, differ[0]), _side_label(b, differ[1]))
    report = None
    if drift:
        try:
            report = session.drift(*results)
        except ValidationError:
            report = None  # two transformers (t2va vs ref2va): nothing to localise
    return compare_results(results[0], results[1], labels, report)
