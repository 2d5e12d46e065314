"""forge_core: core library of forge-recipes (losses, advantages, shared RL math)."""

# Environment variables whose values are never written down (configs, scripts, pickles, logs): the
# config check refuses a value holding one; SLURM hands them to the job through a private file,
# SkyPilot through ``--secret``.
SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")


def import_source(where: str, prefix: str):
    """The module ``where`` names: a ``.py`` file (absolute path; executed once, registered in
    ``sys.modules`` under ``prefix`` + a hash of the path) or an importable module name. Used to load
    a recipe's own ``reward.fn`` and ``env.fn``.

    Raises:
        FileNotFoundError: ``where`` ends in ``.py`` and is no file.
        Exception: whatever importing or executing the module raises (the module is not registered).
    """
    import hashlib
    import importlib
    import importlib.util
    import os
    import sys

    if not where.endswith(".py"):
        return importlib.import_module(where)
    if not os.path.isfile(where):
        raise FileNotFoundError(where)
    name = prefix + hashlib.sha256(where.encode()).hexdigest()[:12]
    if (mod := sys.modules.get(name)) is None:
        loader = importlib.util.spec_from_file_location(name, where)
        mod = sys.modules[name] = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return mod
