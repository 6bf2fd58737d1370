"""The wire format between a GRPO / DiffusionNFT job and a reward server (`reward_client.py`, `reward_server.py`):
one HTTP POST per iteration carrying every request of the rollout, one JSON reply with one score per request.

Contract (format `h3lab-reward/1`; no pickle anywhere: tensors travel as safetensors bytes, the rest as JSON)
--------
- Request: `POST <url>` with `Content-Type: application/octet-stream`, body = a safetensors file (bytes) holding,
  for every request i = 0..B-1 of the batch (in the rollout's request order),
      frames.<i:04d>   uint8 (F, H, W, 3)   the decoded frames
      audio.<i:04d>    float32 (2, S)       the decoded stereo soundtrack in [-1, 1] at `sample_rate`
  and in its header metadata one key `h3lab-reward` whose value is the JSON object
      {"format": "h3lab-reward/1", "sample_rate": 32000,
       "requests": [{"request": r, "prompt": "...", "seed": s}, ...]}     (B entries, the same order)
  `request` is the request's id in its rollout (prompt-major: p * G + g), `seed` its initial-noise seed.
- Reply: status 200, `Content-Type: application/json`, body `{"format": "h3lab-reward/1", "requests": [r, ...],
  "scores": [x, ...]}`: one finite number per request, in the order sent; `requests` (optional) echoes the ids. Any
  other status is a failure; a server says why in `{"error": "one line"}`.
- Limits a decoder enforces (`decode_batch`, `decode_scores`): at most `MAX_BATCH` requests, a header of at most
  `MAX_HEADER` bytes, prompts of at most `MAX_PROMPT` characters, exactly the tensor names above (audio may be
  absent for all requests: the server then refuses a reward that needs it), the dtypes and ranks above, finite
  audio; ids distinct integers >= 0. Every refusal is a one-line `ProtocolError` naming the field and the rule.
"""

from __future__ import annotations

import json
import math
import numbers
import struct
from typing import Any, Sequence

import numpy as np
import torch

from .reward_base import RewardError, RewardSample

FORMAT = "h3lab-reward/1"
META_KEY = "h3lab-reward"
CONTENT_TYPE = "application/octet-stream"
MAX_BATCH = 1024
MAX_HEADER = 16 * 1024 * 1024
MAX_PROMPT = 10_000


class ProtocolError(RewardError):
    """A payload or a reply breaks the wire format (module docstring)."""


def _int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ProtocolError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


# ================================================================================================ request
def encode_batch(samples: Sequence[RewardSample]) -> bytes:
    """The request body for `samples` (module docstring); every sample must carry decoded frames and audio."""
    from safetensors.torch import save

    tensors, entries, rates = {}, [], set()
    for i, s in enumerate(samples):
        for what, value in (("frames", s.frames), ("audio", s.audio)):
            if value is None:
                raise RewardError(f"request {s.index} has no decoded {what}: a reward server scores decoded media "
                                  "(the rollout must decode)")
        tensors[f"frames.{i:04d}"] = torch.from_numpy(np.ascontiguousarray(s.frames, dtype=np.uint8))
        tensors[f"audio.{i:04d}"] = torch.as_tensor(s.audio).detach().to("cpu", torch.float32).contiguous()
        entries.append({"request": int(s.index), "prompt": s.prompt, "seed": int(s.seed)})
        rates.add(int(s.sample_rate))
    if len(rates) > 1:
        raise RewardError(f"requests at sample rates {sorted(rates)}: one batch has one sample rate")
    meta = {"format": FORMAT, "sample_rate": rates.pop() if rates else 32000, "requests": entries}
    return save(tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True)})


def _header(body: bytes) -> dict:
    if len(body) < 8:
        raise ProtocolError(f"payload of {len(body)} bytes: not a safetensors file")
    (n,) = struct.unpack("<Q", body[:8])
    if n > MAX_HEADER or n > len(body) - 8:
        raise ProtocolError(f"payload header of {n} bytes: must be at most {min(MAX_HEADER, len(body) - 8)}")
    try:
        header = json.loads(body[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("payload header: not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("payload header: not a JSON object")
    return header


def decode_batch(body: bytes) -> list[RewardSample]:
    """The `RewardSample`s of a request body (module docstring), checked; `index` is each request's id."""
    from safetensors.torch import load

    header = _header(body)
    meta_text = (header.get("__metadata__") or {}).get(META_KEY)
    if not isinstance(meta_text, str):
        raise ProtocolError(f"payload metadata lacks {META_KEY!r}: not an {FORMAT} payload")
    try:
        meta = json.loads(meta_text)
    except ValueError:
        raise ProtocolError(f"payload metadata {META_KEY!r}: not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ProtocolError(f"payload format {meta.get('format') if isinstance(meta, dict) else meta!r}: must be "
                            f"{FORMAT!r}")
    rate = _int("sample_rate", meta.get("sample_rate"), 1)
    entries = meta.get("requests")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_BATCH:
        raise ProtocolError(f"payload requests: must be a list of 1 to {MAX_BATCH} entries")
    ids, prompts, seeds = [], [], []
    for k, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ProtocolError(f"payload requests[{k}]: must be an object with request, prompt, seed")
        ids.append(_int(f"requests[{k}].request", e.get("request")))
        seeds.append(_int(f"requests[{k}].seed", e.get("seed")))
        prompt = e.get("prompt")
        if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT:
            raise ProtocolError(f"payload requests[{k}].prompt: must be a string of at most {MAX_PROMPT} characters")
        prompts.append(prompt)
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"payload request ids {ids}: must be distinct")
    names = {f"frames.{i:04d}" for i in range(len(ids))}
    audio_names = {f"audio.{i:04d}" for i in range(len(ids))}
    have = set(header) - {"__metadata__"}
    if not names <= have or have - names - audio_names or have & audio_names not in (set(), audio_names):
        raise ProtocolError(f"payload tensors {sorted(have)[:4]}...: must be frames.NNNN (and audio.NNNN) for each of "
                            f"the {len(ids)} requests, nothing else")
    try:
        tensors = load(body)
    except Exception as err:  # noqa: BLE001 - safetensors' own parse errors, reported as one line
        raise ProtocolError(f"payload: not a valid safetensors file ({str(err).splitlines()[0][:120]})") from None
    out = []
    for i, (r, prompt, seed) in enumerate(zip(ids, prompts, seeds)):
        frames = tensors[f"frames.{i:04d}"]
        if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape) < 1:
            raise ProtocolError(f"payload frames.{i:04d} {frames.dtype} {tuple(frames.shape)}: must be uint8 "
                                "(frames, height, width, 3)")
        audio = tensors.get(f"audio.{i:04d}")
        if audio is not None and (audio.dtype != torch.float32 or audio.ndim != 2 or audio.shape[0] != 2 or
                                  audio.shape[1] < 1 or not bool(torch.isfinite(audio).all())):
            raise ProtocolError(f"payload audio.{i:04d} {audio.dtype} {tuple(audio.shape)}: must be finite float32 "
                                "(2, samples)")
        out.append(RewardSample(prompt=prompt, seed=seed, index=r, frames=frames.numpy(), audio=audio,
                                sample_rate=rate))
    return out


# ================================================================================================== reply
def encode_scores(samples: Sequence[RewardSample], scores: Sequence[float]) -> bytes:
    """The reply body: the requests' ids and their scores, in order."""
    return json.dumps({"format": FORMAT, "requests": [int(s.index) for s in samples],
                       "scores": [float(x) for x in scores]}).encode()


def decode_scores(body: bytes, requests: Sequence[int], where: str) -> list[float]:
    """One finite float per request from a reply body (module docstring); `where` names the server in errors."""
    try:
        reply = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"{where}: the reply is not JSON ({body[:60]!r})") from None
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise ProtocolError(f"{where}: the reply has no list 'scores'")
    if len(scores) != len(requests):
        raise ProtocolError(f"{where}: {len(scores)} scores for {len(requests)} requests: must be one per request")
    echoed = reply.get("requests")
    if echoed is not None and echoed != list(requests):
        raise ProtocolError(f"{where}: the reply's request ids {echoed[:8]} are not the ones sent {list(requests)[:8]}")
    out = []
    for r, x in zip(requests, scores):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise ProtocolError(f"{where}: score {x!r} for request {r}: must be a finite number")
        out.append(float(x))
    return out
