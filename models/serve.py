"""``python -m models.serve``: the entry point of the OpenAI-compatible server; the
command line is :mod:`models.cli.serve`, the app :mod:`models.serving.server`."""

import sys

from models.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
