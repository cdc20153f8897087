"""Every service flag can also come from the environment (containers, Kubernetes ConfigMaps).

`python -m services.engine --kv-cache-mb 512` and `INFERMESH_ENGINE_KV_CACHE_MB=512` mean the
same; a flag on the command line wins over the variable.  Repeatable flags take a
comma-separated list.  Parsed only in each service's `__main__`, like the flags themselves.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping


def env_name(prefix: str, action: argparse.Action) -> str:
    flag = max(action.option_strings, key=len)
    return f"{prefix}_{flag.lstrip('-').upper().replace('-', '_')}"


def apply_env(parser: argparse.ArgumentParser, prefix: str, env: Mapping[str, str] | None = None) -> None:
    """Set the parser's defaults from PREFIX_FLAG_NAME variables (validated like the flags)."""
    env = os.environ if env is None else env
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        raw = env.get(env_name(prefix, action))
        if raw is None:
            continue
        name = env_name(prefix, action)
        if isinstance(action, argparse._AppendAction):
            values = [part.strip() for part in raw.split(",") if part.strip()]
            action.default = [_convert(parser, action, v, name) for v in values]
        elif isinstance(action, argparse._StoreTrueAction):
            action.default = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            action.default = _convert(parser, action, raw.strip(), name)


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, raw: str, name: str) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (TypeError, ValueError):
        parser.error(f"{name}={raw!r} is not a valid {max(action.option_strings, key=len)}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r} is not one of {', '.join(map(str, action.choices))}")
    return value
