#!/usr/bin/env python3
"""The image's ENTRYPOINT (behind tini): ``train``, ``doctor``, ``rendezvous``, ``export``,
or any other command, executed as is. See ``entrypoint.py --help`` and launcher/cli.py.
"""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
