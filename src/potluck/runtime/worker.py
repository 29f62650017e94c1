"""One rank under torchrun: ``python -m potluck.runtime.worker --plan plan.json [flags]``.

:func:`worker_args` turns :class:`TrainOptions` into these flags (used to
write the per-machine torchrun commands) and :func:`parse_options` reads them
back, each value as its field's type, so the two never drift apart. A flag left at
what ``potluck train`` uses by default is not written: the commands run on other
machines, whose potluck has its own shipped corpus (``--data`` is written only for
other data; ``--no-data`` for random tokens). A user error ends the rank with one
logged line and the error's exit code. With ``--elastic`` under torchrun, every rank
first agrees with the others on the plan for the machines that are there
(:mod:`potluck.runtime.elastic.rendezvous`).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
from dataclasses import Field, fields
from functools import cache
from typing import Any, get_args, get_type_hints

from potluck.errors import PotluckError
from potluck.plans import load_plan
from potluck.runtime.options import LAUNCHER_ONLY, TrainOptions

log = logging.getLogger("potluck.worker")


@cache
def _defaults() -> TrainOptions:
    """What ``potluck train`` trains with when no flag is given: the shipped corpus, on the
    machine the rank runs on."""
    from potluck.data.corpus import builtin_corpus_path

    return TrainOptions(data=str(builtin_corpus_path()))


def _worker_fields() -> list[Field]:
    """The options a rank takes as flags (not the launcher's own, :data:`LAUNCHER_ONLY`)."""
    return [field for field in fields(TrainOptions) if field.name not in LAUNCHER_ONLY]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def worker_args(options: TrainOptions) -> list[str]:
    """The flags that reproduce ``options`` (only those that differ from ``potluck train``'s
    defaults, so that no path of this machine's install is written)."""
    args: list[str] = []
    for field in _worker_fields():
        value = getattr(options, field.name)
        if value == getattr(_defaults(), field.name):
            continue
        if isinstance(value, bool):
            args.append(_flag(field.name) if value else _flag(f"no_{field.name}"))
        elif value is None:
            args.append(_flag(f"no_{field.name}"))
        else:
            args.extend([_flag(field.name), str(value)])
    return args


@cache
def _hints() -> dict[str, Any]:
    return get_type_hints(TrainOptions)


def _value_type(name: str) -> type:
    """The type of field ``name``'s values, ``None`` aside (``int | None`` reads as int)."""
    hint = _hints()[name]
    (kind,) = [k for k in get_args(hint) or (hint,) if k is not type(None)]
    return kind


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="potluck.runtime.worker")
    parser.add_argument("--plan", required=True)
    for field in _worker_fields():
        default, kind = getattr(_defaults(), field.name), _value_type(field.name)
        if kind is bool:
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction,
                                default=default)
            continue
        parser.add_argument(_flag(field.name), type=kind, default=default)
        parser.add_argument(_flag(f"no_{field.name}"), dest=field.name, action="store_const",
                            const=None)
    return parser


def parse_options(argv: list[str]) -> tuple[str, TrainOptions]:
    namespace = vars(_parser().parse_args(argv))
    plan_path = namespace.pop("plan")
    return plan_path, TrainOptions(**namespace)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    faulthandler.enable(all_threads=True)  # a crash in C++ shows each thread's Python stack
    plan_path, options = parse_options(sys.argv[1:] if argv is None else argv)
    from potluck.runtime.elastic.rendezvous import elastic_start, under_torchrun
    from potluck.runtime.training import train_rank  # torch: not for printing commands

    try:
        plan = load_plan(plan_path)
        if options.elastic and under_torchrun():
            start = elastic_start(plan, options)
            if start.plan is None:
                return 0
            plan, options = start.plan, start.options
        train_rank(plan, options)
    except PotluckError as err:
        log.error("%s", err)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
