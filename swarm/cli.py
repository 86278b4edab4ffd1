"""Moved to ``patchswarm.cli`` (the command line sits above the library).

``python -m swarm.cli`` keeps working for scripts and branches that still use it.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("patchswarm", run_name="__main__")
