"""`python -m gptj.cli` (as under torchrun): the `gptj` command."""

import sys

from gptj.cli import main

sys.exit(main())
