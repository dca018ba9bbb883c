"""What every benchmark script shares: a `--quick` mode, and the machine's load printed beside its figures.

`--quick` runs the same code at sizes that take seconds, not minutes; tests/test_benchmarks_quick.py runs every
script that way, so a changed interface fails a test rather than the next person's measurement. Figures from a
quick run only show that the benchmark still works; the sizes measured are the defaults.
"""

from __future__ import annotations

import argparse
import os


def parse_args(parser: argparse.ArgumentParser, quick: dict[str, object], argv: list[str] | None = None,
               what: str = "the same code at small sizes, in seconds") -> argparse.Namespace:
    """The arguments, `--quick` among them: with it, `quick`'s sizes replace the defaults (flags given still win).
    `what` is its help, for a script whose quick run is more than smaller sizes."""
    sizes = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"{what} ({sizes})" if sizes else what)
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args


def load_average() -> str:
    """The machine's load average over 1, 5 and 15 minutes, as every benchmark prints it beside its figures."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
