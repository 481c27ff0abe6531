#!/usr/bin/env python3
"""Start, inspect or stop this node's hidden-state server: `eaglepipe server ...` as a script.

python -u scripts/server.py start|status|stop [--config PATH]
"""

import sys

from eaglepipe.ops.cli import main

if __name__ == "__main__":
    sys.exit(main(["server", *sys.argv[1:]]))
