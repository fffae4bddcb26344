"""``python -m kiln`` runs the command line."""

import sys

from kiln.cli import main

sys.exit(main())
