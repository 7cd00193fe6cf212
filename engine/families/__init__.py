"""The model families the engine runs, one module each: adding a family is adding its module here.

`get(name)` gives a family by the name a CheckpointInfo holds; `by_variant(variant)` by a variant name;
`resolve(name)` and `variant(name)` take any name a user types for a model (a variant, one of a family's
variant_aliases, a family name), the one resolver every command uses; `FAMILIES` lists them in detection order;
`TITLES` names them for help texts.
"""
from __future__ import annotations

from . import flux, flux2, hunyuanvideo15, krea2, ltx23, minimax_h3, qwen_image, sd3, wan
from .base import Family

FAMILIES: tuple[Family, ...] = (flux.FAMILY, sd3.FAMILY, qwen_image.FAMILY, flux2.FAMILY, wan.FAMILY,
                                 minimax_h3.FAMILY, ltx23.FAMILY, krea2.FAMILY, hunyuanvideo15.FAMILY)
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


def resolve(name: str) -> tuple[Family, str | None]:
    """(family, variant) for any name of a model, case and spaces aside: a variant (ltx-2.3) or one of a family's
    variant_aliases (ltx23, h3) gives its variant; a family name (flux, ltx23) gives (family, None) unless it is an
    alias too. Raises ValueError naming every name that works."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key in _BY_VARIANT:
        return _BY_VARIANT[key], key
    for family in FAMILIES:
        if key in family.variant_aliases:
            return family, family.variant_aliases[key]
    if key in _BY_NAME:
        return _BY_NAME[key], None
    raise ValueError(f"{name!r} is not a model the engine knows: use a variant ({', '.join(VARIANTS)}) or a family "
                     f"({', '.join(_BY_NAME)})")


def variant(name: str) -> str:
    """The one canonical variant name for any name of a model (resolve); a family name only where the family has one
    variant. Raises ValueError naming what works."""
    family, found = resolve(name)
    if found is None and len(family.variants) == 1:
        found = family.variants[0]
    if found is None:
        raise ValueError(f"{name!r} is the {family.title} family, which has several models: name one, "
                         f"{' or '.join(family.variants)}")
    return found
