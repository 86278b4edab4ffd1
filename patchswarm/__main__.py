import sys

from patchswarm.cli import main

sys.exit(main())
