"""Sub-commands of the ``orgel`` CLI, one module each (see :mod:`orgel.cli`)."""
