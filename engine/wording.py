"""Whose words an error uses for what to change. The engine's checks name a setting by a neutral key (`say`) or an
explicit plan (`plan`), and the reader renders it: the engine's API and command line by the engine's own names (the
default: `fp8 weights`, `plan ulysses2`, `deadline compute_s`), the ComfyUI nodes by the node and input to change
(`the xDiT Engine's weight_dtype fp8_e4m3fn`, `xDiT Engine: plan explicit with ulysses 2`, `timeout_s`).

The node layer sets its reader around a call with `speaking(NODES)` (also a decorator). A context variable rather than
an argument: the messages are made deep inside checks (plans, memory, conditioning, deadlines) that know nothing of
their caller, and the reader only words them; it is set per call, so nothing outlives the call that set it."""
from __future__ import annotations

import contextlib
import contextvars

ENGINE, NODES = "engine", "nodes"
_READER = contextvars.ContextVar("xdit_reader", default=ENGINE)

# key -> reader -> template (str.format fields: the values the message passes); a missing reader uses ENGINE's
PHRASES: dict[str, dict[str, str]] = {
    # an explicit plan against the rank count (ParallelPlan.check_world)
    "plan needs ranks": {
        ENGINE: "plan {factors} needs {need} ranks but the engine has {ranks}: make the product of the degrees equal "
                "the number of ranks",
        NODES: "xDiT Engine: {plan} needs {need} GPUs but gpus lists {ranks}: list {need} GPUs in gpus, or degrees "
               "whose product is {ranks}",
    },
    # an explicit plan as the subject of a sentence ("... cannot run this job", "... does not fit")
    "plan subject": {ENGINE: "plan {plan}", NODES: "xDiT Engine: {plan}"},
    "no plan fits the ranks": {
        ENGINE: "no plan for this job fits {ranks} ranks: change the rank count",
        NODES: "no plan for this job fits {ranks} GPUs: change the xDiT Engine's gpus",
    },
    "change ranks or size": {
        ENGINE: "change the rank count or the size",
        NODES: "change the xDiT Engine's gpus or the latent's size",
    },
    # memory: what makes the weights smaller
    "lighter weights": {
        ENGINE: "use fp8 weights, bf16, fewer CPU ranks or a machine with more memory",
        NODES: "set the xDiT Engine's weight_dtype to fp8_e4m3fn or bf16, list fewer gpus, or use a machine with more "
               "memory",
    },
    "stages do not fit": {
        ENGINE: "use more stages, fp8 weights or a smaller image",
        NODES: "set a larger pipefusion or weight_dtype fp8_e4m3fn on the xDiT Engine, or use a smaller image",
    },
    "fp8 would fit": {
        ENGINE: "fp8 weights would fit ({gib:.1f} GiB of weights)",
        NODES: "the xDiT Engine's weight_dtype fp8_e4m3fn would fit ({gib:.1f} GiB of weights)",
    },
    "plan would fit": {
        ENGINE: "explicit {plan} fits ({detail})",
        NODES: "{plan} fits ({detail})",
    },
    "more gpus would fit": {
        ENGINE: "{n} GPUs would fit (sequence parallel splits the activations)",
        NODES: "{n} GPUs in the xDiT Engine's gpus would fit (sequence parallel splits the activations)",
    },
    # the compute deadline of a job
    "compute deadline": {
        ENGINE: "deadline compute_s",
        NODES: "the xDiT Engine's timeout_s: raise it for longer jobs",
    },
    # the conditioning inputs
    "cond": {ENGINE: "cond", NODES: "positive"},
    "neg_cond": {ENGINE: "neg_cond", NODES: "negative"},
    "pooled": {ENGINE: "pooled", NODES: "positive's pooled_output"},
    "neg_pooled": {ENGINE: "neg_pooled", NODES: "negative's pooled_output"},
}

# plan degree -> how the nodes' inputs set it (above 1), in the xDiT Engine's input order
_NODE_DEGREES = {"ulysses": "ulysses {}", "ring": "ring {}", "cfg": "cfg_parallel true", "dp": "dp {}",
                 "pipefusion": "pipefusion {}", "shard": "shard {}"}


def reader() -> str:
    return _READER.get()


def speaking(to: str):
    """Messages made inside the block (or the decorated function) are in `to`'s words: ENGINE or NODES."""
    if to not in (ENGINE, NODES):
        raise ValueError(f"reader {to!r} is unknown: use {ENGINE} or {NODES}")
    return _speaking(to)


@contextlib.contextmanager
def _speaking(to: str):
    token = _READER.set(to)
    try:
        yield
    finally:
        _READER.reset(token)


def say(key: str, **values) -> str:
    """The phrase for `key` in the current reader's words, with `values` filled in."""
    phrases = PHRASES[key]
    return phrases.get(reader(), phrases[ENGINE]).format(**values)


def plan(p) -> str:
    """An explicit plan (ParallelPlan) as the current reader sets it."""
    if reader() == ENGINE:
        return p.describe()
    given = [_NODE_DEGREES[n].format(getattr(p, n)) for n in _NODE_DEGREES if getattr(p, n) > 1]
    return "plan explicit with " + (", ".join(given) if given else "every degree 1")
