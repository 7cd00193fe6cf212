"""`python -m engine`: the command line (engine/cli)."""
import os
import sys

if sys.argv[1:2] == ["worker"]:  # c10d's C++ log lines (connect retries) would bury the worker's own one-line messages
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from .cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
