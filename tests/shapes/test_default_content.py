"""The embedded default makes what a prompt says (measured on decoded output, not on a hash): a held-out prompt's
clip shows the prompted colour moving the prompted way. The soundtrack is not asserted: the shipped audio VAE did
not learn it (README, "The embedded default")."""

from h3lab.shapes import matches, measure


def test_held_out_prompt_shows_its_colour_and_direction():
    from h3lab import Session

    session = Session(None, device="cpu")
    result = session.generate("a red circle moves left, a high tone", width=64, height=64, frames=22, steps=20,
                              seed=42, mode="off")
    m = measure(result.frames, result.audio.numpy(), result.sample_rate)
    ok = matches(m, "red", "circle", "left")
    assert ok["colour"] and ok["direction"], m
    assert m.displacement[0] < -10  # the centroid travels left by more than 10 of 64 pixels
