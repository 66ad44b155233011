"""``python -m service.local.cli``: the ``bnadapt`` command."""

import sys

from service.local.cli import main

if __name__ == "__main__":
    sys.exit(main())
