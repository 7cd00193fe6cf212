"""The command line's parser (errors in one line, defaults in --help) and its typed argument parsers.

Each typed parser turns one flag's text into a value or raises ArgumentTypeError with "<value> is invalid: <what
works>", which argparse prints as "argument --flag: ...". Rules the engine owns (a request's seed, steps, cfg...) are
checked by the engine's own code (`request_field`), not restated here.
"""
from __future__ import annotations

import argparse
import math
import os
from argparse import ArgumentTypeError

from ..families import TITLES
from ..parallel.plan import MAX_RANKS


class UsageError(Exception):
    """A user error: `main` prints "<prog>: error: <message>" as one line and exits 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the message held
        self.prog = prog


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, without "(default: None)", "(default: False)" or "(default: [])"."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == [] \
                or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) raised as UsageError, and whose subcommands
    show their defaults in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(message, self.prog)


# ---- numbers ---------------------------------------------------------------------------------------------------
def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise ArgumentTypeError(f"{text} is invalid: use an integer >= 1")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ArgumentTypeError(f"{text} is invalid: use a finite number")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise ArgumentTypeError(f"{text} is invalid: use a number > 0")
    return value


def ranks(text: str) -> int:
    value = integer(text)
    if not 1 <= value <= MAX_RANKS:
        raise ArgumentTypeError(f"{text} is invalid: use 1 to {MAX_RANKS} ranks (one rank per GPU)")
    return value


MAX_PIXELS = 16384   # a side, as ComfyUI's latent nodes allow (nodes.MAX_RESOLUTION)


def pixels(text: str) -> int:
    """An image side in pixels: FLUX packs 2x2 latent patches of 8 px, so a multiple of 16, up to MAX_PIXELS."""
    value = integer(text)
    if value < 16 or value % 16 or value > MAX_PIXELS:
        raise ArgumentTypeError(f"{text} is invalid: use a positive multiple of 16 pixels up to {MAX_PIXELS}, e.g. "
                                f"{min(MAX_PIXELS, max(16, round(value / 16) * 16))}")
    return value


def int_list(text: str, item=positive_int, example: str = "1,16,64") -> list[int]:
    """Comma-separated integers, each checked by `item`."""
    try:
        return [item(part.strip()) for part in text.split(",")]
    except ArgumentTypeError as e:
        raise ArgumentTypeError(f"{text!r}: {e}; give comma-separated integers, e.g. {example}") from None


def request_field(name: str, convert):
    """A flag that sets GenerateRequest.<name>: converted by `convert`, then checked by the request's own
    check_scalars (the rule the ranks apply too), its message naming the value and what works."""
    def parse(text: str):
        from ..generate.request import GenerateRequest

        value = convert(text)
        try:
            GenerateRequest(model="", cond=None, pooled=None, latent_raw=None, **{name: value}).check_scalars()
        except ValueError as e:
            head, _, rest = str(e).partition(" ")  # "steps=0 is invalid: ..." -> "0 is invalid: ..."
            raise ArgumentTypeError(f"{text} {rest}" if head.startswith(f"{name}=") else str(e)) from None
        return value
    parse.__name__ = name
    return parse


seed = request_field("seed", integer)


# ---- names -----------------------------------------------------------------------------------------------------
def name_list(valid):
    """Comma-separated names, each one of `valid`."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",")]
        unknown = [n for n in names if n not in valid]
        if unknown:
            raise ArgumentTypeError(f"{', '.join(map(repr, unknown))} is not one of {', '.join(valid)}: give "
                                    f"comma-separated names from that list")
        return names
    return parse


def model_name(among=None):
    """Any name of a model (a variant, a family's alias such as ltx23, a one-variant family) as its canonical variant
    name (families.variant, the resolver every command uses); `among`: the variants the command takes (default all)."""
    def parse(text: str) -> str:
        from .. import families

        try:
            name = families.variant(text)
        except ValueError as e:
            raise ArgumentTypeError(str(e)) from None
        if among is not None and name not in among:
            raise ArgumentTypeError(f"{text} is {name}, which this command does not take: use one of "
                                    f"{', '.join(among)}")
        return name
    parse.__name__ = "model name"
    return parse


# ---- files -----------------------------------------------------------------------------------------------------
def shown(path: str) -> str:
    """A path as a line can print it: bytes that are not UTF-8 (which Python holds as surrogate escapes) as \\xNN."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        try:
            return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:   # a surrogate no file name decodes to
            return path.encode("utf-8", "backslashreplace").decode("utf-8")


def readable_by_ranks(text: str) -> str:
    """A path the job can carry: its JSON and safetensors take UTF-8 paths only, so a name holding other bytes is
    refused here rather than failing on a rank."""
    if shown(text) != text:
        raise ArgumentTypeError(f"{shown(text)} is not a UTF-8 path: the ranks and safetensors read UTF-8 file names "
                                f"only; rename the file or a folder above it (or link to it) under a UTF-8 name")
    return text


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise ArgumentTypeError(f"{shown(text)} is not a file" if os.path.exists(text) else
                                f"{shown(text)} does not exist")
    return readable_by_ranks(text)


def lora(text: str) -> tuple[str, float]:
    """PATH or PATH:STRENGTH (strength 1.0 when absent; a path that itself holds ':' works when the file exists)."""
    path, sep, strength = text.rpartition(":")
    if not sep or os.path.isfile(text):
        return existing_file(text), 1.0
    try:
        return existing_file(path), finite_float(strength)
    except ArgumentTypeError as e:
        raise ArgumentTypeError(f"{text}: {e}; give PATH or PATH:STRENGTH, e.g. style.safetensors:0.8") from None


def model_source(text: str) -> str:
    """A model checkpoint file (one of the families in engine/families), a diffusers folder or synthetic:<variant>[:tiny], read from its headers."""
    from ..models.load import inspect_model

    from .. import families

    readable_by_ranks(text)
    if not os.path.lexists(text) and not text.startswith("synthetic:"):
        try:   # a model's name where its file belongs
            family, name = families.resolve(text)
        except ValueError:
            pass
        else:
            sources = f"synthetic:{name}:tiny" if name else \
                f"synthetic:<variant>:tiny with one of {', '.join(family.variants)}"
            raise ArgumentTypeError(f"{text} is a model's name, not a file or folder here: give its checkpoint, or "
                                    f"{sources} for tiny random weights")
    try:
        inspect_model(text)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        works = f"; give a {TITLES} checkpoint: .safetensors, .gguf or a diffusers folder" \
            if "not a safetensors file" in str(e) and "checkpoints are read" not in str(e) else ""
        raise ArgumentTypeError(f"{e}{works}") from None
    return text


def checkpoint_file(text: str) -> str:
    """A single-file model checkpoint."""
    return model_source(existing_file(text))


def output_file(suffix: str, what: str):
    """A file to write `what` to, ending in `suffix`: a regular file or a new name in a folder where a file can be
    created, checked before any work (output.check), so no result is lost and no special file replaced."""
    def parse(text: str) -> str:
        from .output import check
        return check(text, suffix, what)
    parse.__name__ = "output file"
    return parse


def output_dir(text: str) -> str:
    """A folder to write into, created if missing: an existing folder where a file can be created, or a new one that
    can be made (output.check_dir)."""
    from .output import check_dir
    return check_dir(text)


# ---- devices ---------------------------------------------------------------------------------------------------
def gpu_list(text: str) -> list[int]:
    """Distinct visible CUDA device indices, one rank each."""
    import torch

    gpus = int_list(text, item=integer, example="0,1")
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ArgumentTypeError(f"{text} is invalid: give distinct GPU indices >= 0, e.g. 0,1")
    if not torch.cuda.is_available():
        raise ArgumentTypeError(f"{text} needs CUDA, and this torch ({torch.__version__}) sees no CUDA device: "
                                f"leave out --gpus to run on the CPU")
    count = torch.cuda.device_count()
    if max(gpus) >= count:
        raise ArgumentTypeError(f"{text} names GPU {max(gpus)} but only {count} are visible: use indices "
                                f"0..{count - 1}")
    return gpus


# ---- plans -----------------------------------------------------------------------------------------------------
def plan_choice(text: str):
    """`auto`, `fastest`, or explicit degrees such as ulysses4,ring2 (ParallelPlan.parse)."""
    from ..errors import PlanError
    from ..parallel.plan import PLAN_MODES, ParallelPlan

    if text.strip().lower() in PLAN_MODES:
        return text.strip().lower()
    try:
        return ParallelPlan.parse(text)
    except PlanError as e:
        raise ArgumentTypeError(f"{e}; or auto, fastest") from None
