"""A zoo of architectures nobody on the project wrote, for coverage: Hugging Face and others.

Every entry is a function of no arguments that returns a
:class:`orgel.models.ZooWorkload` ``(model, inputs, targets, loss_fn)`` built
from a config with random weights (nothing is downloaded), with dropout 0 and
a batch of 4 that splits into 2 micro-batches. :func:`archs` maps a name to its
builder; :func:`archzoo.check.orgel_check` runs one through ``orgel.pipeline``
and compares it with one process.
"""

from __future__ import annotations

from collections.abc import Callable

from orgel.models import ZooWorkload

Builder = Callable[[], ZooWorkload]


def archs() -> dict[str, Builder]:
    """name -> builder, every architecture of the zoo (the modules are imported on first use)."""
    from archzoo import cnn, cnn_mobile, cnn_other, hf, misc, misc_regions

    return {**hf.BUILDERS, **cnn.BUILDERS, **cnn_mobile.BUILDERS, **cnn_other.BUILDERS,
            **misc.BUILDERS, **misc_regions.BUILDERS}


__all__ = ["Builder", "archs"]
