"""The ``kvtier`` command line.

Each subcommand lives in its own module (``add_arguments(parser)`` and ``run(args) -> int``)
and is imported only when it runs, so ``kvtier layouts`` does not pay for torch or gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from services.cli.version import VersionAction

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "layouts": ("services.cli.layouts", "print the layout specs and their bytes per token"),
    "serve": ("services.cli.serve", "run the gRPC server"),
    "replay-worker": ("services.replay.server", "run a bounded-replay worker as a gRPC service"),
    "stat": ("services.cli.stat", "print the server's tier statistics and metrics"),
    "top": ("services.cli.top", "show hit rate per tier live in the terminal"),
    "reload": ("services.cli.reload", "make a running server re-read its tokens, quotas, "
               "log level and keyring (SIGHUP)"),
    "health": ("services.cli.health", "check a server's gRPC health service (exit 0: serving)"),
    "list": ("services.cli.list_sessions", "list stored sessions"),
    "lookup": ("services.cli.lookup", "how many tokens of a sequence the server holds"),
    "fork": ("services.cli.fork", "start a session from another session's prefix"),
    "generate": ("services.cli.generate", "run the bundled model as an inference worker"),
    "demo": ("services.cli.demo", "run the agent-like end-to-end demo"),
    "compact": ("services.cli.compact", "compact a data directory offline"),
    "repair": ("services.cli.repair", "rebuild a data directory's disk index from its segments"),
    "fleet-gc": ("services.cli.fleet_gc", "sweep a fleet's bucket of chunks no manifest names"),
    "drain": ("services.cli.drain", "drain a server before it stops: every session durable, "
              "its windows released"),
    "init": ("services.cli.init", "write a working config (and with --secure certificates, "
             "tokens, a keyring) and the deploy files into a new directory"),
    "backup": ("services.cli.backup", "write a consistent backup of a data directory, live or not"),
    "restore-backup": ("services.cli.restore_backup",
                       "restore a backup into a data directory, verifying every chunk"),
    "migrate": ("services.cli.migrate", "copy a single-node data directory to a fleet's bucket"),
    "certs": ("services.server.devcerts", "write a development CA, certificates and tokens"),
    "keygen": ("services.cli.keygen", "write a new encryption keyring, or add a current key"),
    "rekey": ("services.cli.rekey", "reseal what old keys sealed under the current key"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tiered KV-cache persistence with bounded-replay recovery."
    )
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # First pass picks the command; its own module then defines and parses its options.
    chosen, rest = build_parser().parse_known_args(argv)
    module_name, help_text = COMMANDS[chosen.command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvtier {chosen.command}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return module.run(args)
    except BrokenPipeError:  # output piped into `head`: not an error worth a traceback
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling
        return 130


if __name__ == "__main__":
    sys.exit(main())
