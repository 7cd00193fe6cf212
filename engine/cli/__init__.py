"""The command line, `python -m engine demo | generate | plan | make-tiny | bench | worker ...`.

Exit codes: 0 done; 1 the engine failed at run time (EngineError: a rank died, a deadline passed), a finished result
could not be written where asked (it is kept elsewhere, and the message says where) or a demo check failed; 2 a user
error, found before any rank starts wherever no rank is needed to know; 130 interrupted (Ctrl-C), the ranks killed and
their shared memory removed. Every error is one line on stderr, never a traceback.
"""
from __future__ import annotations

import sys

from ..errors import EngineError
from ..families import TITLES
from .args import UsageError, shown
from . import output
from .output import ResultNotWritten

PROG = "python -m engine"


def build_parser():
    from . import bench, calibrate, demo, generate, plan, tiny, worker
    from .args import Parser

    parser = Parser(prog=PROG, description=f"Multi-GPU engine for {TITLES}: runs ComfyUI's KSampler on a group "
                                           f"of rank processes")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,generate,plan,calibrate,make-tiny,bench,worker}")
    for module in (demo, generate, plan, calibrate, tiny, bench, worker):
        module.register(sub)
    return parser


def _error(prog: str, message: str) -> None:
    print(f"{prog}: error: {shown(message)}", file=sys.stderr, flush=True)   # a path of non-UTF-8 bytes as \xNN


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (never raises SystemExit)."""
    prog = PROG
    try:
        parser = build_parser()
        try:
            a, unknown = parser.parse_known_args(argv)
        except SystemExit as e:  # --help
            return e.code if isinstance(e.code, int) else 0
        prog = a.parser.prog
        if unknown:  # named by the subcommand's parser, not the top one
            a.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        output.refuse_outputs_that_are_inputs(a)   # every command: no output replaces what the job reads
        return a.run(a)
    except UsageError as e:
        _error(e.prog or prog, str(e))
        return 2
    except EngineError as e:  # the message's first line says what failed; the rest is a rank's log tail
        _error(prog, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return 1
    except ResultNotWritten as e:  # the job finished, its output path failed: the message says where the result is
        _error(prog, str(e))
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted: stopped; no rank or shared memory is left behind", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
