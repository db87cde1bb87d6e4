"""`python -m tempokern ...` runs the command line (see tempokern.cli)."""
import sys

from .cli import main

sys.exit(main())
