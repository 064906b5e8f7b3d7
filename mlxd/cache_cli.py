"""`mlxd cache ls DIR` and `mlxd cache clear DIR`: what a `--kv-disk` directory holds
(read from the entries' names and sizes), and emptying it (refused while a server
holds it)."""

import argparse
import sys

from mlxd.runtime.kv_disk import StoreLocked, clear_all, summary


def cache_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd cache",
                                     description="inspect or empty a --kv-disk directory")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="entries, tokens and bytes per model fingerprint") \
        .add_argument("dir")
    commands.add_parser("clear", help="remove every entry (not while a server uses it)") \
        .add_argument("dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "ls":
            rows = [("FINGERPRINT", "ENTRIES", "TOKENS", "SIZE")] + [
                (f, str(n), str(t), f"{b / 2**20:.1f} MiB") for f, n, t, b in summary(args.dir)]
            widths = [max(len(r[i]) for r in rows) for i in range(4)]
            for row in rows:
                print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        else:
            print(f"removed {clear_all(args.dir)} entries from {args.dir}")
    except StoreLocked as exc:
        print(f"mlxd cache: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"mlxd cache: {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
