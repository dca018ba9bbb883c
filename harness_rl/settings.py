"""The vocabulary every part's settings Struct is written in (the proxy's, the learner's, the run's).

A field declares its help text once, with `setting`, and the command-line flags (`harness_rl.flags`),
`--print-config` and the config files are all derived from it. Light on purpose: msgspec only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


def setting(description: str, flag: str | None = "", *, internal: bool = False, required: bool = False) -> msgspec.Meta:
    """A field's help text; `flag=None` keeps it off the command line, a string renames its flag.

    `internal` fields are set by whoever starts the part (a training run sets its proxy's upstream and
    store itself); a command offers them as flags only when it asks for them. `required` fields have
    an empty default that a preset or the user must fill (the help says so).
    """
    return msgspec.Meta(description=description, extra={"flag": flag, "internal": internal, "required": required})


AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
AtLeastZero = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class ConfigError(ValueError):
    """A setting that cannot run: `setting` names the flag (or config key), `str()` is the one line to print."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
