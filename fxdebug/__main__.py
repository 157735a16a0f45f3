"""``python -m fxdebug``: the command line (see ``fxdebug.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
