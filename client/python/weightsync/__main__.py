"""python -m weightsync: package and daemon versions, the daemon's health
(weightsync/_cli.py)."""

import sys

from weightsync._cli import main

sys.exit(main())
