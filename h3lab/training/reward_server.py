"""A reward server for `--reward-server`: any reward h3lab can resolve (a shipped NAME such as `prompt_match`, a
weighted sum, `package.module:function`) served over HTTP in one process (`http.server`, one request at a time).
`scripts/reward_server.py` is its command line; tests start it in a thread on port 0.

Contract
--------
- `make_server(reward, host="127.0.0.1", port=0, path="/score", max_bytes=MAX_BYTES)` binds (port 0: a free port,
  `server.url` names it) and returns the server; `serve_forever()` runs it, `shutdown()` stops it.
- `GET <path>` answers 200 `{"format", "reward", "needs"}` (what `reward_client.probe` reads).
- `POST <path>` with a `reward_protocol` body answers 200 and the scores. Refusals, each a JSON `{"error": "one
  line"}`: another path 404; no or a bad `Content-Length` 411 / 400; a body over `max_bytes` 413 (not read); a body
  that is not the format (`reward_protocol.decode_batch`) 400; a payload without audio while the reward needs decoded
  media 400 (it names the request); a reward that refuses a request (e.g. a prompt `prompt_match` cannot read) 422.
  A reward that raises anything else is answered 500 with its one line; the server keeps serving.
- Input handling: the body is read only up to its declared length (bounded by `max_bytes`), parsed by safetensors
  and JSON only (never pickle), every field checked before the reward sees it; the server binds to loopback unless
  told otherwise and logs one line per request to stderr only when `verbose`.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

from ..errors import H3Error, first_line, user_message
from .reward_protocol import FORMAT, ProtocolError, decode_batch, encode_scores
from .rewards import Reward, RewardError, resolve_reward, score

MAX_BYTES = 1024 * 1024 * 1024


class RewardServer(HTTPServer):
    """`HTTPServer` holding the reward, the served path and the body limit (module docstring)."""

    def __init__(self, reward: Reward, address: tuple[str, int], path: str, max_bytes: int, verbose: bool):
        self.reward, self.path, self.max_bytes, self.verbose = reward, path, int(max_bytes), verbose
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}{self.path}"


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def _reply(self, status: int, body: dict | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, {"error": " ".join(message.split())[:500]})

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        if self.server.verbose:
            sys.stderr.write(f"reward server: {self.address_string()} {format % args}\n")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != self.server.path:
            return self._error(404, f"no such path {self.path!r}: the reward is at {self.server.path!r}")
        reward = self.server.reward
        self._reply(200, {"format": FORMAT, "reward": reward.name, "needs": reward.needs})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path != self.server.path:
            return self._error(404, f"no such path {self.path!r}: the reward is at {self.server.path!r}")
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(411, "Content-Length is required")
        if not length.isdigit():
            return self._error(400, f"Content-Length {length!r}: must be a byte count")
        if int(length) > self.server.max_bytes:
            self.close_connection = True
            return self._error(413, f"a body of {length} bytes: the limit is {self.server.max_bytes}")
        body = self.rfile.read(int(length))
        try:
            samples = decode_batch(body)
        except ProtocolError as err:
            return self._error(400, str(err))
        reward = self.server.reward
        if reward.needs == "decoded":
            lacking = next((s.index for s in samples if s.audio is None), None)
            if lacking is not None:
                return self._error(400, f"the payload lacks audio for request {lacking}: reward {reward.name!r} "
                                        "needs decoded media (frames and audio)")
        try:
            values = score(reward, samples)
        except RewardError as err:
            return self._error(422, str(err))
        except Exception as err:  # noqa: BLE001 - one line to the client, the server keeps serving
            why = user_message(err) if isinstance(err, H3Error) else f"{type(err).__name__}: {first_line(str(err))}"
            return self._error(500, f"reward {reward.name!r} failed: {why}")
        self._reply(200, encode_scores(samples, values.tolist()))


def make_server(reward: str | Reward, host: str = "127.0.0.1", port: int = 0, path: str = "/score",
                max_bytes: int = MAX_BYTES, verbose: bool = False) -> RewardServer:
    """A bound server for `reward` (a spec `rewards.resolve_reward` takes, or a `Reward`; not a URL)."""
    if isinstance(reward, str) and reward.startswith(("http://", "https://")):
        raise RewardError(f"--reward {reward!r}: a reward server serves a local reward, not another server")
    if not isinstance(path, str) or not path.startswith("/") or any(c.isspace() for c in path):
        raise RewardError(f"--path {path!r}: must start with '/' and hold no blanks")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise RewardError(f"--max-bytes {max_bytes!r}: must be an integer >= 1")
    return RewardServer(resolve_reward(reward), (host, int(port)), path, max_bytes, verbose)
