"""What every command shares: the root group's one-line parser errors, the console and the
one-line user errors (:func:`user_errors`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from kvbudget.errors import KVBudgetError

console = Console()


def _raw_values(args: list[str], opts: list[str]) -> list[str]:
    """What the command line gave for an option (``--budget abc`` or ``--budget=abc``)."""
    values = []
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                values.append(args[i + 1])
            elif arg.startswith(opt + "="):
                values.append(arg[len(opt) + 1 :])
    return values


class OneLineErrors(TyperGroup):
    """Parser errors (unknown option or command, a value of the wrong type, a missing option) as
    one ``error:`` line naming the option and the value given, exit code 2 (not a framed panel)."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:  # fmt: skip
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as err:
            if type(err).__name__ == "NoArgsIsHelpError":  # the help is already printed
                sys.exit(err.exit_code)
            message = err.format_message().replace("\n", " ")
            param = getattr(err, "param", None)
            if isinstance(err, typer.BadParameter) and param is not None and getattr(param, "opts", None):
                given = _raw_values(argv, list(param.opts) + list(param.secondary_opts))
                if given:
                    shown = ", ".join(repr(v) for v in given)
                    message = message.replace(":", f" (got {shown}):", 1)
            ctx = getattr(err, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print(f"error: {message}{hint}", file=sys.stderr)
            sys.exit(err.exit_code)
        except typer.Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`KVBudgetError` into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVBudgetError as err:
            print(f"error: {err}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper
