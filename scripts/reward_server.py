"""Serve an h3lab reward over HTTP for `h3lab train grpo|nft --reward-server URL` (one process, one request at a time).

    python scripts/reward_server.py --reward prompt_match [--host 127.0.0.1] [--port 8000] [--path /score]
                                    [--max-bytes N] [--verbose]

`--reward` is anything `h3lab.training.rewards.resolve_reward` takes: a shipped NAME (prompt_match, colour_match,
brightness, ...), a weighted sum (`prompt_match:1.0,brightness:0.1`) or `package.module:function` -- so a learned
reward model is one module away. The wire format is `h3lab.training.reward_protocol` (safetensors request, JSON
reply); the server's rules are `h3lab.training.reward_server`'s docstring. It prints one line with its URL when it
listens, and stops on Ctrl-C. Bad arguments are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h3lab.errors import user_message  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reward", default="prompt_match", help="reward spec (default prompt_match)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; default 8000)")
    p.add_argument("--path", default="/score", help="served path (default /score)")
    p.add_argument("--max-bytes", type=int, default=1024 ** 3, help="largest request body accepted (default 1 GiB)")
    p.add_argument("--verbose", action="store_true", help="log one line per request on stderr")
    args = p.parse_args(argv)
    from h3lab.training.reward_server import make_server

    try:
        server = make_server(args.reward, args.host, args.port, args.path, args.max_bytes, args.verbose)
    except Exception as err:  # noqa: BLE001 - one line, exit 2
        print(f"reward_server: error: {user_message(err)}", file=sys.stderr)
        return 2
    print(f"serving reward {server.reward.name!r} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
