"""The model families the engine runs, one module each: adding a family is adding its module here.

`get(name)` gives a family by the name a CheckpointInfo holds; `by_variant(variant)` by a variant name; `FAMILIES`
lists them in detection order; `TITLES` names them for help texts.
"""
from __future__ import annotations

from . import flux, flux2, ltx23, minimax_h3, qwen_image, sd3, wan
from .base import Family

FAMILIES: tuple[Family, ...] = (flux.FAMILY, sd3.FAMILY, qwen_image.FAMILY, flux2.FAMILY, wan.FAMILY,
                                 minimax_h3.FAMILY, ltx23.FAMILY)
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_VARIANT = {v: f for f in FAMILIES for v in f.variants}
VARIANTS = tuple(_BY_VARIANT)
TITLES = ", ".join(f.title for f in FAMILIES)   # "FLUX.1, SD3/SD3.5, ..." for help texts


def get(name: str) -> Family:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"model family {name!r} is unknown: use one of {', '.join(_BY_NAME)}") from None


def by_variant(variant: str) -> Family:
    try:
        return _BY_VARIANT[variant]
    except (KeyError, TypeError):
        raise ValueError(f"model variant {variant!r} is unknown: use one of {', '.join(VARIANTS)}") from None


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)
