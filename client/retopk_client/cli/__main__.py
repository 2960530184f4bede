"""``python -m retopk_client.cli``: the same as the ``retopk`` command."""

import sys

from retopk_client.cli import main

sys.exit(main())
