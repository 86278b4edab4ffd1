"""The ``patchswarm`` command: the application layer above swarm/, node/, trainer/, lab/, simulations/."""
