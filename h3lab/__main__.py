"""`python -m h3lab` (and `torchrun ... -m h3lab --tp T --cp C`): the CLI, `h3lab.frontends.cli.main`."""

import sys

from .frontends.cli import main

if __name__ == "__main__":
    sys.exit(main())
