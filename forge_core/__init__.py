"""forge_core: core library of forge-recipes (losses, advantages, shared RL math)."""

# Environment variables whose values are never written down (configs, scripts, pickles, logs): the
# config check refuses a value holding one; SLURM hands them to the job through a private file,
# SkyPilot through ``--secret``.
SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
