"""`python -m harness_rl.torchrun ARGS`: torchrun itself, except that a run stopped by Ctrl-C or SIGTERM ends with
that signal's exit status (130 for Ctrl-C) instead of torchrun's traceback.

Rank 0 has already said what it saved; torchrun's own handling is kept (it passes the signal to every process
and waits its `--shutdown-timeout`, 30 s by default, for them to finish).
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as stop:
        sys.exit(128 + int(stop.sigval))
