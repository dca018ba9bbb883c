"""`python -m adapters.harnesses --pins`: each harness's pinned package, one per line, for
scripts/install_agents.sh: `<harness> <registry> <package> <version> <binary> <venv or ->`."""

from __future__ import annotations

import argparse

from adapters.harnesses import HARNESSES


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m adapters.harnesses", description=__doc__)
    parser.add_argument("--pins", action="store_true", required=True, help="print the pinned packages")
    parser.parse_args()
    for name, harness in HARNESSES.items():
        if (package := harness.package) is not None:
            print(name, package.registry, package.name, package.version, package.binary, package.venv or "-")


if __name__ == "__main__":
    main()
