#!/usr/bin/env python3
"""The image's ENTRYPOINT (behind tini): ``train``, ``doctor``, ``rendezvous``, ``export``,
or any other command, executed as is. See ``entrypoint.py --help`` and launcher/cli.py.
"""

from launcher.cli import entry

if __name__ == "__main__":
    entry()
