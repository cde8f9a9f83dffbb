"""Names the command line offers, in a module that imports no torch: ``orgel --help`` and
every command's parser read them without starting torch (:mod:`orgel.cli`)."""

from __future__ import annotations

#: precision name -> the name in torch of its autocast dtype (None: no autocast);
#: :data:`orgel.precision.PRECISIONS` holds the dtypes themselves
PRECISION_DTYPES: dict[str, str | None] = {
    "32": None,
    "32-true": None,
    "bf16-mixed": "bfloat16",
    "16-mixed": "float16",
}

#: the models ``orgel demo`` trains (:mod:`orgel.explicit.demo`)
DEMO_MODELS = ("gpt", "vit", "clip", "unet")
