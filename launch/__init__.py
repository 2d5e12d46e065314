"""Launch adapters (local, SLURM through submitit, SkyPilot) and the shared Monarch bootstrap."""
