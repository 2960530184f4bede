"""``python -m retopk_client.cli``: the same as the ``retopk`` command."""

import sys

from retopk_client.cli import main

if __name__ == "__main__":  # importing this module (e.g. while walking the package) runs nothing
    sys.exit(main())
