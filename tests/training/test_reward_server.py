"""Rewards from another process (`reward_protocol`, `reward_client`, `reward_server`, `scripts/reward_server.py`), on
loopback: the example server started in a thread on port 0 scores exactly what the same reward scores in process;
the frames, the audio, the prompts, ids and seeds reach it byte for byte; a payload without audio is refused when the
reward needs decoded media; a wrong count, NaN, a non-200, a bad payload, a slow or a dead server are one line each,
with retries and backoff where they apply."""

import importlib.util
import json
import threading
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from h3lab.shapes import ClipSpec, prompt, render_clip
from h3lab.training.reward_client import check_url, post, probe, remote_reward
from h3lab.training.reward_protocol import decode_batch, encode_batch
from h3lab.training.reward_server import make_server
from h3lab.training.rewards import REWARDS, Reward, RewardError, RewardSample, resolve_reward, score

ROOT = Path(__file__).resolve().parents[2]


def samples(n: int = 3, seed: int = 0, audio: bool = True) -> list[RewardSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        spec = ClipSpec(rng.choice(["red", "green", "blue"]), rng.choice(["circle", "square"]),
                        rng.choice(["left", "up"]), seed=int(rng.integers(1000)))
        frames, wave = render_clip(spec)
        out.append(RewardSample(prompt=prompt(spec), seed=int(rng.integers(1 << 40)), index=2 * i + 1, frames=frames,
                                audio=torch.from_numpy(wave) if audio else None))
    return out


@contextmanager
def serving(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_example_server_scores_what_the_reward_scores_in_process():
    batch = samples(3, seed=1)
    with serving(make_server("prompt_match")) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/score")
        remote = resolve_reward(server.url)
        assert remote.needs == "decoded" and remote.batched
        assert torch.equal(score(remote, batch), score(REWARDS["prompt_match"], batch))
        with urllib.request.urlopen(server.url, timeout=5) as reply:  # GET: what it serves
            assert json.loads(reply.read()) == {"format": "h3lab-reward/1", "reward": "prompt_match",
                                                "needs": "decoded"}
        probe(server.url)


def test_frames_audio_prompts_ids_and_seeds_reach_the_reward_byte_for_byte():
    batch = samples(2, seed=2)
    seen = []
    spy = Reward("spy", lambda ss: seen.extend(ss) or [0.5] * len(ss), batched=True)
    with serving(make_server(spy)) as server:
        assert score(remote_reward(server.url), batch).tolist() == [0.5, 0.5]
    assert len(seen) == 2
    for got, sent in zip(seen, batch):
        assert (got.prompt, got.seed, got.index, got.sample_rate) == (sent.prompt, sent.seed, sent.index, 32000)
        assert np.array_equal(got.frames, sent.frames) and got.frames.dtype == np.uint8
        assert got.audio is not None and torch.equal(got.audio, sent.audio), "the audio did not reach the reward"


def test_a_payload_without_audio_is_refused_when_the_reward_needs_decoded_media():
    silent = samples(2, seed=3, audio=False)
    with pytest.raises(RewardError, match="request 1 has no decoded audio"):
        encode_batch(silent)  # the client never sends it
    from safetensors.torch import save  # a third-party client that leaves the audio out

    body = save({f"frames.{i:04d}": torch.from_numpy(s.frames) for i, s in enumerate(silent)}, metadata={
        "h3lab-reward": json.dumps({"format": "h3lab-reward/1", "sample_rate": 32000, "requests": [
            {"request": s.index, "prompt": s.prompt, "seed": s.seed} for s in silent]})})
    assert all(s.audio is None for s in decode_batch(body))
    with serving(make_server("prompt_match")) as server:
        with pytest.raises(RewardError, match=r"HTTP 400 \(the payload lacks audio for request 1: reward "
                                              "'prompt_match' needs decoded media"):
            post(server.url, body, 5.0, 0, 0.0)


def test_bad_requests_to_the_server_are_refused_in_one_line():
    with serving(make_server("prompt_match", max_bytes=4096)) as server:
        cases = [(b"not safetensors", "HTTP 400 (payload header"), (b"\x00" * 16, "HTTP 400"),
                 (b"x" * 5000, "HTTP 413")]
        for body, message in cases:
            with pytest.raises(RewardError, match=message.replace("(", r"\(")) as err:
                post(server.url, body, 5.0, 0, 0.0)
            assert "\n" not in str(err.value)
        with pytest.raises(RewardError, match="HTTP 404"):
            post(server.url.replace("/score", "/other"), b"", 5.0, 0, 0.0)
    bad = samples(1, seed=4)
    bad = [RewardSample("a red fox", 0, 0, frames=bad[0].frames, audio=bad[0].audio)]
    with serving(make_server("prompt_match")) as server:
        with pytest.raises(RewardError, match="HTTP 422 .*prompt 'a red fox': not a shapes prompt"):
            score(remote_reward(server.url), bad)


class Scripted(BaseHTTPRequestHandler):
    """Answers POSTs from a script of (status, body) pairs, one per call."""

    script: list = []
    calls: list = []

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = self.script[min(len(self.calls), len(self.script) - 1)]
        type(self).calls.append(status)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def scripted(script):
    Scripted.script, Scripted.calls = list(script), []
    return HTTPServer(("127.0.0.1", 0), Scripted)


def url_of(server):
    return f"http://127.0.0.1:{server.server_address[1]}/score"


@pytest.mark.parametrize("script, message", [
    ([(200, {"scores": [1.0]})], "1 scores for 2 requests: must be one per request"),
    ([(200, b'{"scores": [NaN, 1.0]}')], "score nan for request 1: must be a finite number"),
    ([(200, {"scores": [1.0, float("inf")]})], "score inf for request 3"),
    ([(200, {"scores": [1.0, True]})], "score True for request 3"),
    ([(200, {"requests": [3, 1], "scores": [1.0, 2.0]})], r"request ids \[3, 1\] are not the ones sent \[1, 3\]"),
    ([(200, b"<html>")], "the reply is not JSON"),
    ([(200, {"score": 1})], "no list 'scores'"),
    ([(400, {"error": "bad frames"})], r"HTTP 400 \(bad frames\)"),
    ([(503, {})], "HTTP 503"),
])
def test_a_bad_reply_is_one_line_naming_the_server(script, message):
    with serving(scripted(script)) as server:
        with pytest.raises(RewardError, match=message) as err:
            score(remote_reward(url_of(server), retries=1, backoff=0.0), samples(2, seed=5))
    assert "\n" not in str(err.value) and url_of(server) in str(err.value)
    assert len(Scripted.calls) == (2 if script[0][0] >= 500 else 1)  # a 5xx is retried, a 4xx and a bad 200 not


def test_retries_with_backoff_then_success():
    sleeps = []
    with serving(scripted([(503, {}), (500, {}), (200, {"scores": [0.25, 0.75]})])) as server:
        reward = remote_reward(url_of(server), retries=2, backoff=0.5, sleep=sleeps.append)
        assert score(reward, samples(2, seed=6)).tolist() == [0.25, 0.75]
    assert Scripted.calls == [503, 500, 200] and sleeps == [0.5, 1.0]


def test_a_dead_or_slow_server_fails_after_its_retries():
    with serving(scripted([(200, {"scores": [0.0]})])) as server:
        url = url_of(server)
    sleeps = []
    with pytest.raises(RewardError, match=r"no answer after 3 tries \(.*refused") as err:
        score(remote_reward(url, retries=2, backoff=0.1, sleep=sleeps.append), samples(1))
    assert sleeps == [0.1, 0.2] and "\n" not in str(err.value)
    with pytest.raises(RewardError, match="no server answers"):
        probe(url, timeout=2.0)

    class Slow(Scripted):
        def do_POST(self):  # noqa: N802
            threading.Event().wait(1.0)
            super().do_POST()

    with serving(HTTPServer(("127.0.0.1", 0), Slow)) as server:
        with pytest.raises(RewardError, match="no answer after 1 tries .*timed out"):
            score(remote_reward(url_of(server), timeout=0.2, retries=0), samples(1))


@pytest.mark.parametrize("url, message", [
    ("ftp://127.0.0.1/score", "must be http://HOST"), ("http:///score", "must be http://HOST"),
    ("http://127.0.0.1:99999/score", "port must be an integer"), ("http://u:p@127.0.0.1/score", "credentials"),
    ("http://127.0.0.1/ score", "must be http://HOST"),
])
def test_bad_urls_are_one_line(url, message):
    with pytest.raises(RewardError, match=message) as err:
        check_url(url)
    assert str(err.value).startswith(f"--reward-server {url!r}")
    for kw, msg in ((dict(timeout=0), "--reward-timeout 0"), (dict(retries=-1), "--reward-retries -1"),
                    (dict(timeout=float("nan")), "--reward-timeout nan")):
        with pytest.raises(RewardError, match=msg):
            remote_reward("http://127.0.0.1:1/score", **kw)


def test_the_script_serves_and_refuses_bad_arguments(capsys):
    spec = importlib.util.spec_from_file_location("reward_server_script", ROOT / "scripts" / "reward_server.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--reward", "shiny", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward 'shiny': not a shipped reward" in err[0]
    assert script.main(["--reward", "http://127.0.0.1:1/score", "--port", "0"]) == 2
    assert "a reward server serves a local reward" in capsys.readouterr().err
