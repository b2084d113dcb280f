"""`python -m moerun ...`: the same command line as `moerun ...`."""

import sys

from moerun.cli.main import main

sys.exit(main())
