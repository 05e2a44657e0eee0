"""Command-line options that also read the environment: flag beats env beats default.

Every option ``--metrics-port`` reads ``GPUALLOC_METRICS_PORT`` when the flag
is not given. ``--node-name`` and ``--pod-namespace`` also fall back to
``NODE_NAME`` and ``POD_NAMESPACE``, which the downward API sets in a pod.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from gpualloc.runtime import logging as runtime_logging

PREFIX = "GPUALLOC_"

# Plain environment variables a pod gets from the downward API, by option dest.
DOWNWARD_API: Mapping[str, str] = {"node_name": "NODE_NAME", "pod_namespace": "POD_NAMESPACE"}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def env_name(dest: str, prefix: str = PREFIX) -> str:
    """``metrics_port`` -> ``GPUALLOC_METRICS_PORT``."""
    return prefix + dest.upper().replace("-", "_")


def _parse_bool(parser: argparse.ArgumentParser, name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    parser.error(f"{name}={raw!r}: expected true or false")


def env_defaults(
    parser: argparse.ArgumentParser,
    prefix: str = PREFIX,
    *,
    environ: Mapping[str, str] | None = None,
    fallbacks: Mapping[str, str] = DOWNWARD_API,
) -> None:
    """Make each option's default come from its environment variable, where that is set.

    Call after adding the arguments. A value from the environment goes through
    the option's ``type`` and ``choices`` like a flag would; a flag given on the
    command line still wins. Each option's help names its variable.
    """
    env = os.environ if environ is None else environ
    for action in parser._actions:
        if not action.option_strings or action.dest in (argparse.SUPPRESS, "help", "version"):
            continue
        name = env_name(action.dest, prefix)
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} (env {name})".strip()
        source = name if name in env else fallbacks.get(action.dest)
        if source is None or source not in env:
            continue
        raw = env[source]
        if isinstance(
            action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction
        ):
            action.default = _parse_bool(parser, source, raw)
            continue
        if isinstance(action, argparse._AppendAction | argparse._ExtendAction) or action.nargs in ("*", "+"):
            items = [part.strip() for part in raw.split(",") if part.strip()]
            action.default = [_convert(parser, action, source, item) for item in items]
            continue
        if action.nargs == 0:  # store_const, count: only the flag itself means something
            continue
        action.default = _convert(parser, action, source, raw)


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, source: str, raw: str) -> object:
    value: object = raw
    if action.type is not None and callable(action.type):
        try:
            value = action.type(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{source}={raw!r}: {exc or 'invalid value'}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        parser.error(f"{source}={raw!r}: expected one of {choices}")
    return value


def default_bind_address() -> str:
    """Where probes listen: all interfaces in a pod (the kubelet must reach them), else loopback."""
    return "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"


def add_kubeconfig_and_logging(
    parser: argparse.ArgumentParser, *, log_format: str = "json", log_level: str = "INFO"
) -> None:
    """``--kubeconfig``, ``--log-format`` and ``--log-level``: what every command has, the certs tool too."""
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file; default $KUBECONFIG, else in-cluster"
    )
    parser.add_argument(
        "--log-format", choices=runtime_logging.FORMATS, default=log_format, help="log line format"
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=runtime_logging.LEVELS,
        default=log_level,
        help="least level logged",
    )


def add_common(parser: argparse.ArgumentParser, *, metrics_port: int = 8080, health_port: int = 8081) -> None:
    """The options every component has: kubeconfig, logging, probe and metrics ports."""
    add_kubeconfig_and_logging(parser)
    parser.add_argument("--metrics-port", type=int, default=metrics_port, help="port of /metrics (0: off)")
    parser.add_argument("--health-port", type=int, default=health_port, help="port of /healthz and /readyz")
    parser.add_argument(
        "--bind-address",
        default=default_bind_address(),
        help="address the probe and metrics servers listen on (default: 0.0.0.0 in a pod, else 127.0.0.1)",
    )
