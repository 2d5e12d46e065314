"""forge_core: core library of forge-recipes (losses, advantages, shared RL math)."""
