"""The A/B numbers of `h3lab.research.views.compare` on fresh random media: PSNR follows its formula, SSIM is 1 for equal
frames, symmetric and below 1 otherwise, the log-spectral distance is 0 for equal tracks and symmetric, the RMS ratio
of a scaled track is the scale, and every number repeats its bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from h3lab.research.views.compare import (CompareError, frame_psnr, frame_ssim, log_spectral_distance, rms_ratio,
                                 shapes_reads)


def test_frame_numbers():
    rng = np.random.default_rng()
    a = rng.integers(0, 256, (3, 20, 24, 3), dtype=np.uint8)
    b = a.copy()
    b[1] = np.clip(a[1].astype(int) + 10, 0, 255).astype(np.uint8)
    psnr = frame_psnr(a, b)
    mse = ((a[1].astype(np.float64) - b[1]) ** 2).mean()
    assert math.isinf(psnr[0]) and psnr[1] == 10 * math.log10(255 ** 2 / mse)
    ssim = frame_ssim(a, b)
    assert ssim[0] == 1.0 and ssim[2] == 1.0 and -1 <= ssim[1] < 1
    assert np.array_equal(frame_ssim(b, a), ssim) and np.array_equal(frame_ssim(a, b), ssim)  # repeatable bytes
    with pytest.raises(CompareError, match="one size and length"):
        frame_psnr(a, b[:2])


def test_audio_numbers():
    rng = np.random.default_rng()
    a = rng.standard_normal((2, 8000)).astype(np.float32) * 0.1
    b = a * 0.5
    assert log_spectral_distance(a, a) == 0.0 and rms_ratio(a, a) == 1.0
    assert abs(rms_ratio(a, b) - 0.5) < 1e-7
    d = log_spectral_distance(a, b)
    assert abs(d - 20 * math.log10(2)) < 1e-9  # a uniform gain of 1/2 is 6.02 dB in every bin
    c = rng.standard_normal((2, 8000)) * 0.1
    assert log_spectral_distance(a, c) == log_spectral_distance(c, a) > 0
    assert rms_ratio(np.zeros((2, 100)), np.zeros((2, 100))) == 1.0


def test_shapes_reads_only_judge_shapes_prompts():
    from h3lab.shapes import ClipSpec, render_clip

    frames, audio = render_clip(ClipSpec("red", "circle", "left"))
    good = shapes_reads(frames, audio, 32000, "a red circle moves left, a high tone")
    assert good["match"] == {"colour": True, "direction": True, "tone": True, "pan": True}
    assert shapes_reads(frames, audio, 32000, "a fox in the snow")["match"] is None
