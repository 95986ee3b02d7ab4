"""A catalogue model's `engine_args` (llmesh.wire.config.ServedModel) read as vLLM reads its own
command line: each name must be one of `AsyncEngineArgs`' options and each value must parse as that
option's (its type, its choices), or the error names it, before any engine starts. The values that come
back are vLLM's own, in the types its parser gives (a JSON dict for a config becomes that config's
mapping, a size such as "8k" an int), ready for `AsyncEngineArgs(**values)`."""

from __future__ import annotations

import argparse
import difflib
import functools
import json
from collections.abc import Iterable
from typing import Any

from llmesh.wire.config import ServedModel


class _Refusing(argparse.ArgumentParser):
    """vLLM's parser, raising its errors instead of exiting."""

    def error(self, message: str) -> Any:
        raise ValueError(message)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = type("EngineArgsParser", (_Refusing, FlexibleArgumentParser), {})(add_help=False)
    return AsyncEngineArgs.add_cli_args(parser)


def _options() -> dict[str, argparse.Action]:
    return {action.dest: action for action in _parser()._actions if action.option_strings}


def _command_line(name: str, value: Any, action: argparse.Action) -> list[str]:
    """`name=value` as vLLM's command line gives it."""
    option = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:  # a switch: --x, or --no-x where vLLM has it
        if not isinstance(value, bool):
            raise ValueError(f"{name} is a switch: true or false, not {value!r}")
        negated = f"--no-{option[2:]}"
        if value:
            return [option]
        if negated in action.option_strings:
            return [negated]
        raise ValueError(f"{name} can only be switched on")
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [option, *(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)]
    if isinstance(value, dict | list):
        return [option, json.dumps(value)]
    if isinstance(value, bool):
        return [option, str(value).lower()]
    return [option, str(value)]


def vllm_values(model: ServedModel) -> dict[str, Any]:
    """`model.engine_args` as vLLM's parser reads them; ValueError naming the model and the argument."""
    options = _options()
    values = {}
    for name, value in model.engine_args.items():
        try:
            if name not in options:
                close = ", ".join(difflib.get_close_matches(name, options, n=3))
                raise ValueError("not an engine argument of vLLM" + (f" (did you mean {close}?)" if close else ""))
            if value is None:  # vLLM's default
                continue
            parsed = _parser().parse_args(_command_line(name, value, options[name]))
        except ValueError as exc:
            raise ValueError(f"model {model.name!r}: engine_args {name!r}: {exc}") from None
        values[name] = getattr(parsed, name)
    return values


def check(models: Iterable[ServedModel]) -> None:
    """Every model's `engine_args` read by vLLM's parser (`vllm_values`); the first error raised. Free for
    models without any: vLLM is imported only for those that have them."""
    for model in models:
        if model.engine_args:
            vllm_values(model)
