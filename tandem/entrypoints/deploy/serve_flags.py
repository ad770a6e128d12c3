"""``tandem deploy`` takes every ``tandem serve`` flag and passes the ones given on to each
replica's server. The flags are ``serve``'s own argparse actions (so ``tandem deploy --help`` and
the CLI reference list them, and a wrong value is refused before anything starts); what a
replica gets is rebuilt from the values that differ from the defaults.

The deployment sets some serve flags itself, per replica: those are not taken here
(``DEPLOYMENT_OWNED``); ``--host``/``--port``/``--api-key``/``--log-level``/``--shutdown-timeout``
are the deployment's own (its router's; the API key and log level reach the servers too).
"""
from __future__ import annotations

import argparse

DEPLOYMENT_OWNED = {"--role", "--pd-address", "--pd-secret-file", "--host", "--port", "--api-key", "--log-level",
                    "--shutdown-timeout", "--model"}


def serve_flag_groups() -> list[tuple[str, list[argparse.Action]]]:
    """``tandem serve``'s argument groups and actions, less the ones the deployment owns."""
    from tandem.entrypoints.engine_arguments import add_serve_arguments

    serve = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(serve)
    groups = []
    for group in serve._action_groups:
        actions = [action for action in group._group_actions
                   if action.option_strings and not set(action.option_strings) & DEPLOYMENT_OWNED]
        if actions:
            groups.append((group.title, actions))
    return groups


def add_serve_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add serve's flags to ``parser`` under their own groups; the actions added."""
    added = []
    for title, actions in serve_flag_groups():
        group = parser.add_argument_group(f"{title} (passed to every replica's tandem serve)")
        for action in actions:
            group._add_action(action)
            added.append(action)
    return added


def serve_arguments(arguments: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The ``tandem serve`` flags that give each replica the values ``arguments`` hold (the
    flags whose value differs from serve's default)."""
    flags: list[str] = []
    for action in actions:
        value = getattr(arguments, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = action.option_strings[0]
            flags.append(positive if value else "--no-" + positive.removeprefix("--"))
        elif action.nargs == 0:  # store_true / store_false
            flags.append(action.option_strings[0])
        elif isinstance(value, (list, tuple)):
            flags += [action.option_strings[0], *(str(item) for item in value)]
        else:
            flags += [action.option_strings[0], str(value)]
    return flags
