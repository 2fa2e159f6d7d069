"""The engine's command-line flags, one per `EngineArgs` field (`--tp-size` -> `tp_size`), shared by every
subcommand that builds an engine (generate, serve, bench)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from tandem.engine.engine import EngineArgs


# Other spellings of a flag that users know from other engines (SGLang's name for prefix caching).
ALIASES = {"disable_prefix_caching": ("--disable-radix-cache",)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        hint = hints[f.name]
        if hint is bool and f.default:  # (a flag that is on by default is turned off by name: on|off)
            group.add_argument(*flags, dest=f.name, choices=["on", "off"], default="on")
            continue
        if hint is bool:
            group.add_argument(*flags, dest=f.name, action="store_true", default=f.default)
            continue
        base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
        group.add_argument(*flags, dest=f.name, type=base[0], default=f.default, metavar=f.name.upper())


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """The Engine keyword arguments the flags gave (an on|off flag as a bool)."""
    hints = typing.get_type_hints(EngineArgs)
    return {f.name: getattr(ns, f.name) == "on" if hints[f.name] is bool and f.default else getattr(ns, f.name)
            for f in dataclasses.fields(EngineArgs)}
