"""`python -m harness_rl`: the `harness-rl` command (what torchrun starts: `torchrun ... -m harness_rl train`)."""

import sys

from harness_rl.cli import main

sys.exit(main())
