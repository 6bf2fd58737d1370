"""Rewards computed by another process: a reward server at `http://HOST:PORT/PATH` (`--reward-server URL`, or the URL
as a reward spec in the Python API), called once per iteration with the whole rollout batch.

Contract
--------
- `remote_reward(url, timeout=60, retries=2, backoff=0.5)` is a batched `Reward` named by the URL, `needs="decoded"`
  (the rollout decodes; frames and audio both travel: `reward_protocol`). Standard library only (`urllib.request`);
  environment proxies are not used (a reward server is a local or cluster service); credentials in the URL are
  refused (they would be sealed in the run's records).
- One call = one POST of `reward_protocol.encode_batch(samples)`, at most `timeout` seconds each. A connection that
  fails, a timeout or a 5xx status is tried again up to `retries` more times, sleeping `backoff * 2**k` seconds
  before try k + 1; a 4xx status (the server refused the payload) is not retried. Then any failure -- no answer, a
  status other than 200, a reply that is not the format, a wrong count of scores, a NaN or an infinity -- is one
  `RewardError` line naming the URL and what went wrong. The GRPO / NFT iteration that asked fails with it, before
  any optimiser step, so the job's checkpoint of the iteration before stays as it was (`--resume` continues).
- `check_url(url)` checks the spelling only (http or https, a host, a valid port, no credentials); `probe(url,
  timeout)` is one GET that any HTTP answer passes (the example server answers its reward's name; a 404 or 405
  also shows a server is there): a job calls it before any model loads, so a dead server fails in seconds.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Sequence

from .reward_protocol import CONTENT_TYPE, decode_scores, encode_batch
from .reward_base import Reward, RewardError, RewardSample

MAX_REPLY = 16 * 1024 * 1024
_NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, socket.timeout)


def check_url(url: str, flag: str = "--reward-server") -> str:
    """`url` when it is http(s)://HOST[:PORT][/PATH] without credentials; else a one-line `RewardError`."""
    rule = "must be http://HOST[:PORT]/PATH (or https://)"
    if not isinstance(url, str) or any(c.isspace() for c in url):
        raise RewardError(f"{flag} {url!r}: {rule}")
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise RewardError(f"{flag} {url!r}: the port must be an integer in [0, 65535]") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RewardError(f"{flag} {url!r}: {rule}")
    if parts.username is not None or parts.password is not None:
        raise RewardError(f"{flag} {url!r}: credentials in the URL are refused (they would be sealed in the run)")
    return url


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _reason(err: BaseException) -> str:
    reason = getattr(err, "reason", None) or err
    return " ".join(str(reason).split())[:160] or type(err).__name__


def probe(url: str, timeout: float = 5.0) -> None:
    """One GET of `url`: any HTTP answer passes; no answer is a one-line `RewardError` (module docstring)."""
    check_url(url)
    try:
        with _opener().open(urllib.request.Request(url, method="GET"), timeout=timeout) as reply:
            reply.read(MAX_REPLY)
    except urllib.error.HTTPError:
        return  # a server answered
    except _NETWORK_ERRORS as err:
        raise RewardError(f"--reward-server {url}: no server answers ({_reason(err)})") from None


def post(url: str, body: bytes, timeout: float, retries: int, backoff: float,
         sleep: Callable[[float], None] = time.sleep) -> bytes:
    """The 200 reply body of one POST, with the retries of the module docstring."""
    for attempt in range(retries + 1):
        last = attempt == retries
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": CONTENT_TYPE, "Accept": "application/json"})
        try:
            with _opener().open(request, timeout=timeout) as reply:
                data = reply.read(MAX_REPLY + 1)
            if len(data) > MAX_REPLY:
                raise RewardError(f"reward server {url}: a reply over {MAX_REPLY} bytes")
            return data
        except urllib.error.HTTPError as err:
            detail = _error_detail(err)
            if err.code < 500 or last:
                raise RewardError(f"reward server {url}: HTTP {err.code}{detail}") from None
        except _NETWORK_ERRORS as err:
            if last:
                raise RewardError(f"reward server {url}: no answer after {retries + 1} tries "
                                  f"({_reason(err)})") from None
        sleep(backoff * 2 ** attempt)
    raise AssertionError("unreachable")  # pragma: no cover


def _error_detail(err: urllib.error.HTTPError) -> str:
    try:
        text = err.read(4096).decode("utf-8", "replace")
        message = json.loads(text).get("error", "")
    except (ValueError, AttributeError, OSError):
        message = ""
    return f" ({' '.join(str(message).split())[:200]})" if message else ""


def _real(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def check_options(timeout: float, retries: int, backoff: float = 0.5) -> tuple[float, int, float]:
    """(timeout, retries, backoff) when the timeout is a finite number > 0, retries an integer >= 0 and the
    backoff a finite number >= 0; else a one-line `RewardError` naming the flag."""
    if not _real(timeout) or timeout <= 0:
        raise RewardError(f"--reward-timeout {timeout!r}: must be a finite number of seconds > 0")
    if isinstance(retries, bool) or not isinstance(retries, numbers.Integral) or retries < 0:
        raise RewardError(f"--reward-retries {retries!r}: must be an integer >= 0")
    if not _real(backoff) or backoff < 0:
        raise RewardError(f"reward server backoff {backoff!r}: must be a finite number of seconds >= 0")
    return float(timeout), int(retries), float(backoff)


def remote_reward(url: str, timeout: float = 60.0, retries: int = 2, backoff: float = 0.5,
                  sleep: Callable[[float], None] = time.sleep) -> Reward:
    """The batched `Reward` of the server at `url` (module docstring)."""
    url = check_url(url)
    timeout, retries, backoff = check_options(timeout, retries, backoff)

    def fn(samples: Sequence[RewardSample]) -> list[float]:
        samples = list(samples)
        reply = post(url, encode_batch(samples), timeout, retries, backoff, sleep)
        return decode_scores(reply, [int(s.index) for s in samples], f"reward server {url}")

    return Reward(url, fn, needs="decoded", batched=True)
