"""``python -m nicoffload.cli``: the ``nicoffload`` command."""
import sys

from nicoffload.cli.app import main

sys.exit(main())
