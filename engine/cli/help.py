"""The help formatter every subcommand's parser shares."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that shows each flag's default, except where the help already
    says it (a default of None means something the help spells out, as "the model's").
    ``_get_help_string`` is the hook argparse's own ArgumentDefaultsHelpFormatter overrides."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
