"""`python -m prefixd.engine FD`: the engine process (started by the front, never by hand)."""

import sys

from prefixd.engine.process import child_main

sys.exit(child_main(sys.argv[1:]))
