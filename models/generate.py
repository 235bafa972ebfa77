"""``python -m models.generate``: the entry point of the generation CLI and the demo;
the command line is :mod:`models.cli.generate`."""

import sys

from models.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
