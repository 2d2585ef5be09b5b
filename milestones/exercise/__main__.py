"""``python -m milestones.exercise``: the command line of ``cli``."""

import sys

from milestones.exercise.cli import main

sys.exit(main())
