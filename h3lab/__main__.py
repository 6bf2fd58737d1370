"""`python -m h3lab` (and `torchrun ... -m h3lab --tp T --cp C`): the CLI, `h3lab.cli.main`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
