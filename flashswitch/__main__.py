"""`python -m flashswitch <command>`: the same as the `flashswitch` console script."""
import sys

from flashswitch.cli import main

sys.exit(main())
