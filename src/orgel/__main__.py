"""``python -m orgel``: the ``orgel`` command (:mod:`orgel.cli`)."""

import sys

from orgel.cli import main

sys.exit(main())
