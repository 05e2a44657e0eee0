"""The one ``gpualloc`` command. Each subcommand lives with its component.

The CLI is the composition root: it is the only place in ``gpualloc`` that
reaches into the components, and it imports a component only when its
subcommand runs, so ``gpualloc get nodes`` never loads NVML or aiohttp.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "agent": ("agent.main", "main", "run the node agent (NVML or simulated) and publish GpuNodeStatus"),
    "controller": ("controller.main", "main", "run the controller that allocates GpuClaims"),
    "webhook": ("webhook.main", "main", "run the TLS mutating admission webhook"),
    "certs": ("certs.main", "main", "create or renew the webhook's serving certificate"),
    "dev": ("gpualloc.devcluster.cli", "main", "build, start and stop the local control plane"),
    "get": ("gpualloc.views", "get_main", "list GPU nodes, claims, quotas or usage"),
    "explain": ("controller.explaining", "main", "say why a claim is pending, node by node"),
    "simulate": ("controller.simulating", "main", "say where a claim would land (and whom it would preempt)"),
    "topo": ("gpualloc.views", "topo_main", "print a node's GPU topology matrix"),
}


def _usage() -> str:
    lines = ["usage: gpualloc <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'gpualloc <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"gpualloc: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        func = getattr(module, func_name)
    except (ModuleNotFoundError, AttributeError) as exc:
        missing = getattr(exc, "name", None) or ""
        if missing and not (missing == module_name or module_name.startswith(missing + ".")):
            raise
        print(f"gpualloc {name}: this component is not built yet ({module_name})", file=sys.stderr)
        return 3
    result = func(rest)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
