"""The embedded default makes what a prompt says (measured on decoded output, not on a hash): a held-out prompt's
clip shows the prompted colour moving the prompted way and sounds the prompted tone, panned the way it moves."""

from h3lab.shapes import matches, measure


def test_held_out_prompt_shows_and_sounds_what_it_says():
    from h3lab import Session

    session = Session(None, device="cpu")
    result = session.generate("a blue square moves right, a middle tone", width=64, height=64, frames=22, steps=20,
                              seed=42, mode="off")
    m = measure(result.frames, result.audio.numpy(), result.sample_rate)
    assert matches(m, "blue", "square", "right") == {"colour": True, "direction": True, "tone": True, "pan": True}, m
    assert m.displacement[0] > 10  # the centroid travels right by more than 10 of 64 pixels
    assert abs(m.frequency - 440.0) < 20  # the square's middle tone
