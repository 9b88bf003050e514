"""``kvroute keys``: generate a CURVE key pair for authenticated event streams."""

from __future__ import annotations

import argparse
import logging
import sys

from events.curve import CurveKeyError, load_public_key, write_keypair

__all__ = ["main"]

_log = logging.getLogger("kvroute.keys")

_EPILOG = """\
Give each worker a server key pair (NAME.key_secret stays on the worker) and each
subscriber (router, recorder) a client key pair. Workers list the clients' NAME.key files
in their allow-list; subscribers are given each worker's NAME.key.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute keys",
        description="Generate a ZeroMQ CURVE key pair (z85 text files).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        required=True,
        help="directory to write NAME.key (public) and NAME.key_secret (secret, mode 0600) "
        "into; created if missing",
    )
    parser.add_argument(
        "--name",
        default="kvroute",
        help="base name of the two files (default: kvroute); existing files are never overwritten",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run ``kvroute keys``; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        public_path, secret_path = write_keypair(args.out, args.name)
    except (CurveKeyError, OSError) as exc:
        _log.error("%s", exc)
        return 1
    print(f"public key: {public_path} ({load_public_key(public_path).decode()})")
    print(f"secret key: {secret_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
