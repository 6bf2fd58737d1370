"""Shared by the stochastic tests and the consistency worker: batches of requests of one prompt, and one item."""

import torch


def batched(inputs, size, seed=1):
    """`size` requests of one prompt: the same text and conditioning rows, fresh noise rows each."""
    g = torch.Generator().manual_seed(seed)
    nv = inputs.num_condition_video_rows
    video = inputs.video.repeat(size, 1, 1)
    video[:, nv:] = torch.randn(video[:, nv:].shape, generator=g)
    audio = torch.randn((size,) + tuple(inputs.audio.shape[1:]), generator=g)
    return inputs.replace(text=inputs.text.repeat(size, 1, 1), video=video, audio=audio)


def item(inputs, b):
    """Batch item `b` of `inputs` as batch-1 inputs."""
    return inputs.replace(text=inputs.text[b:b + 1], video=inputs.video[b:b + 1], audio=inputs.audio[b:b + 1])
