"""``python -m fxdebug``: the command line (see ``fxdebug.cli.main``)."""

import sys

from fxdebug.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
