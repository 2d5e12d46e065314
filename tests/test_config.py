"""Recipe composition: deltas over the base schema, overrides, loss selection, strict keys, fail-fast recipes."""

import dataclasses
import glob
import os
import re
import shutil
import subprocess

import pytest

from forge_core.config import ConfigError, load_config
from helpers import PY, ROOT, cli, cli_here
RECIPES = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "recipes", "*", "config.yaml")))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(recipe):
    cfg = load_config(recipe)
    assert cfg.recipe == recipe and cfg.loss.name == ("sft" if recipe.endswith("_sft") else "grpo")
    if recipe in ("qwen3_1_7b", "qwen3_8b", "llama3_8b"):  # the published GPU settings
        assert cfg.generator.group_size == 8
        assert cfg.generator.max_prompt_tokens == 1024 and cfg.generator.max_response_tokens == 1024
        assert cfg.device == "cuda" and cfg.generator.backend == "vllm" and cfg.layout.gpus_per_node > 0


def test_overrides_and_loss_selection():
    cfg = load_config("smollm2_135m", ["trainer.lr=1e-6", "steps=5", "loss=dapo", "loss.clip_high=0.3"])
    assert cfg.trainer.lr == 1e-6 and cfg.steps == 5
    assert cfg.loss.name == "dapo" and cfg.loss.clip_high == 0.3 and cfg.loss.dual_clip == 3.0


@pytest.mark.parametrize("override,key", [("trainer.lrr=1", "trainer.lrr"), ("stepz=3", "stepz"),
                                           ("generator.group_size=abc", "generator.group_size"),
                                           ("loss=nope", "loss/nope"), ("generator.backend=tgi", "generator.backend"),
                                           ("layout.trainer.host=3", "layout.trainer.host"),
                                           ("=5", "+ overrides: Config group override must be a string"),
                                           ("loss=5", "+ overrides: Config group override must be a string")])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config("smollm2_135m", [override])
    assert key in str(e.value)


@pytest.mark.parametrize("override,says", [
    ("generator.temperature=0", "generator.temperature must be > 0"), ("checkpoint.keep=0", "checkpoint.keep must be > 0"),
    ("generator.max_prompt_tokens=0", "generator.max_prompt_tokens must be > 0"),
    ("checkpoint.every=-1", "checkpoint.every must be >= 0"), ("fault.max_restarts=-1", "fault.max_restarts must be >= 0"),
    ("threads_per_actor=-2", "threads_per_actor must be >= 0"), ("trainer.lr=-1e-5", "trainer.lr must be >= 0"),
    ("generator.top_p=2", "generator.top_p must be in (0, 1]"), ("generator.top_p=0", "generator.top_p must be in"),
    ("generator.gpu_memory_utilization=1.5", "generator.gpu_memory_utilization must be in (0, 1]"),
    ("loss.kl_estimator=k9", "loss=grpo: unknown kl_estimator='k9'"), ("loss.aggregation=x", "unknown aggregation='x'"),
    ("loss.clip_low=-1", "clip_low must be >= 0"), ("loss.dual_clip=0.5", "dual_clip must be > 1"),
    ("loss=sapo loss.tau_pos=0", "loss=sapo: tau_pos must be > 0"), ("loss.beta=-1", "beta must be >= 0"),
    ("advantage.estimator=foo", "advantage.estimator='foo' must be one of"), ("advantage.eps=-1", "advantage.eps must"),
    ("trainer.max_grad_norm=-1", "trainer.max_grad_norm must be > 0"), ("trainer.tp=0", "trainer.tp must be > 0"),
    ("trainer.betas=[2,3]", "trainer.betas=[2.0, 3.0] must be two numbers in [0, 1)"), ("trainer.betas=[0.9]", "betas"),
    ("layout.nodes=0", "layout.nodes must be > 0"), ("reward.fn=no_such.module:fn", "cannot import no_such.module"),
    ("reward.fn=forge_core.rewards:gsm8k_reward", "cannot be called as gsm8k_reward(response: str, example: dict)"),
    ("reward.fn=reward.py:score", "smollm2_135m/reward.py:score': no file"),
    ("eval.every=-1", "eval.every must be >= 0"), ("eval.samples=0", "eval.samples must be > 0"),
    ("eval.top_p=0", "eval.top_p must be in (0, 1]"), ("eval.max_response_tokens=0", "eval.max_response_tokens must"),
    ("eval.samples=4 eval.temperature=0", "eval.samples=4 with eval.temperature=0 (greedy) gives k identical"),
    ("eval.every=5 data.test=", "evaluation is asked for (eval.every=5, eval.at_start"),
    ("data.source=file data.train=", "data.source=file needs data.train"),
    ("layout.trainer.gpus=-2", "layout.trainer.gpus must be >= 0"),
    ("data.source=csv", "data.source='csv' must be one of ('gsm8k', 'file', 'hub')"),
    ("layout.generator.replicas=0", "layout.generator.replicas must be > 0"),
    ("generator.max_response_tokens=100000", "max_prompt_tokens + max_response_tokens (or eval.max_response_tokens) = "
                                             "100256 is more than smollm2_135m's 8192 positions"),
    ("eval.max_response_tokens=100000", "(or eval.max_response_tokens) = 100256 is more than"),
    ("trainer.lr=inf", "trainer.lr=inf must be a finite number"), ("loss.beta=inf", "loss.beta=inf must be a finite"),
    ("reward.format_weight=nan", "reward.format_weight=nan must be a finite number"),
    ("trainer.betas=[0.9,nan]", "trainer.betas=[0.9, nan] must be a finite number"),
    ("loss=dapo loss.clip_low=2", "loss=dapo: clip_low must be <= 1"),
    ("loss.aggregation=fixed_horizon loss.horizon=0", "loss=grpo: horizon must be > 0 (or None"),
    ("buffer_capacity=15", "buffer_capacity=15 is smaller than one training batch (prompts_per_step x "
                           "generator.group_size = 16 episodes)")])
def test_out_of_range_value_names_the_key(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("smollm2_135m", override.split())
    load_config("smollm2_135m", ["checkpoint.every=0", "fault.max_restarts=0", "generator.top_p=1.0", "trainer.lr=0",
                                 "reward.fn=math", "trainer.betas=[0,0.95]",
                                 "buffer_capacity=16"])


def test_a_secrets_value_in_the_config_is_refused_naming_the_key(monkeypatch):
    """The run saves its config: a value holding a secret's (typed in, or through ${oc.env:...}) is
    refused, naming the key and the variable, never the value."""
    monkeypatch.setenv("WANDB_API_KEY", "wandb_test_SECRET456")
    for value in ("wandb_test_SECRET456", "${oc.env:WANDB_API_KEY}", "team-wandb_test_SECRET456"):
        with pytest.raises(ConfigError, match=r"wandb.project holds the value of \$WANDB_API_KEY") as e:
            load_config("smollm2_135m", [f"wandb.project={value}"])
        assert "SECRET456" not in str(e.value)
    load_config("smollm2_135m", ["wandb.project=${oc.env:HOME}"])


@pytest.mark.parametrize("override,says", [
    ("trainer.lrr=1", "override 'trainer.lrr=1': unknown key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
    ("generatr.group_size=3", "unknown key 'generatr.group_size' (did you mean 'generator.group_size'?)"),
    ("loss.clip_hi=0.3", "(did you mean 'loss.clip_high'?)"), ("+stepz=3", "override '+stepz=3': the schema's keys"),
    ("~trainer.lr", "no '+' to add a key, '~' to delete one"),
    ("recipe=foo", "override 'recipe=foo': not a setting of the run"),
    ("hydra.run.dir=/x", "override 'hydra.run.dir=/x': not a setting of the run (Hydra's own settings are unused"),
    ("loss.tau_pos=1", "unknown key 'loss.tau_pos' (a parameter of loss=sapo: select it too, e.g. loss=sapo"),
    ("defaults=[]", "unknown key 'defaults' (it is set in a recipe's config.yaml, not by an override)")])
def test_unknown_or_added_key_is_named_with_the_closest_one(override, says):
    """A misspelled override names itself and the schema's closest key; '+' would add a key the
    schema does not have (silently ignored by every actor), '~' delete one the actors read."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("smollm2_135m", [override])


def test_misspelled_key_in_recipe_file(tmp_path):
    d = tmp_path / "my_exp"
    shutil.copytree(os.path.join(ROOT, "recipes", "smollm2_135m"), d)
    text = (d / "config.yaml").read_text()
    (d / "config.yaml").write_text(text.replace("  lr:", "  learning_rate:"))
    with pytest.raises(ConfigError) as e:
        load_config(str(d))
    assert "learning_rate" in str(e.value) and "config.yaml" in str(e.value)
    assert "did you mean 'trainer.lr'?" in str(e.value)
    for bad, says in (("trainer:\n  lr: [1e-5\n", "line 2"), ("steps: 3\nsteps: 4\n", "duplicate key steps"),
                      ("steps: 3\n", "must start with 'defaults: \\[base, _self_\\]'"),
                      ("defaults: [base, _self_]\nloss: dapo\n", "override loss: dapo"),
                      ("defaults: base\n", "defaults must be a list"),
                      ("defaults: [base, _self_]\nsteps: 3 # \udcff\n", "'utf-8' codec can't decode byte 0xff")):
        # not YAML, not UTF-8: a ConfigError naming the file and where, no traceback
        (d / "config.yaml").write_text(bad, errors="surrogateescape")
        with pytest.raises(ConfigError, match=f"{re.escape(str(d / 'config.yaml'))}: .*{says}"):
            load_config(str(d))


def test_misspelt_section_suggests_the_section(tmp_path):
    """A misspelt section is corrected before the key inside it: ``traner`` is the section ``trainer``
    (not the key ``trainer.tp``, the closest whole key), in an override and in a recipe file."""
    for override, says in (("traner.lr=1", "unknown key 'traner.lr' (did you mean 'trainer.lr'?)"),
                           ("traner=1", "unknown key 'traner' (did you mean the section 'trainer'?)"),
                           ("layout.generatr.tp=2", "(did you mean 'layout.generator.tp'?)")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config("smollm2_135m", [override])
    d = tmp_path / "my_exp"
    shutil.copytree(os.path.join(ROOT, "recipes", "smollm2_135m"), d)
    (d / "config.yaml").write_text((d / "config.yaml").read_text().replace("\ntrainer:", "\ntraner:"))
    with pytest.raises(ConfigError, match=re.escape(f"{d / 'config.yaml'}: unknown key 'traner' (did you mean the "
                                                    f"section 'trainer'?)")):
        load_config(str(d))


def test_a_value_of_the_wrong_type_is_one_line_naming_key_value_and_type(tmp_path):
    """OmegaConf's multi-line complaint becomes one line: the key, the value, what the key takes; from
    an override or from the recipe file (named)."""
    for override, says in (("trainer.lr=fast", "override trainer.lr='fast': expected a float"),
                           ("steps=abc", "override steps='abc': expected an integer"),
                           ("trainer.compile=maybe", "override trainer.compile='maybe': expected true or false"),
                           ("trainer.betas=[0.9,x]", "override trainer.betas[1]='x': expected a float")):
        with pytest.raises(ConfigError) as e:
            load_config("smollm2_135m", [override])
        assert str(e.value) == says
    d = tmp_path / "my_exp"
    shutil.copytree(os.path.join(ROOT, "recipes", "smollm2_135m"), d)
    (d / "config.yaml").write_text((d / "config.yaml").read_text().replace("\nsteps:", "\nsteps: abc\n_old:")
                                   .replace("_old:", "#"))
    with pytest.raises(ConfigError) as e:
        load_config(str(d), ["trainer.lr=1e-6"])
    assert str(e.value) == f"{d / 'config.yaml'}: steps='abc': expected an integer"


def test_copied_recipe_folder_is_its_own_recipe(tmp_path):
    d = tmp_path / "my_exp"
    shutil.copytree(os.path.join(ROOT, "recipes", "smollm2_135m"), d)
    text = (d / "config.yaml").read_text()
    (d / "config.yaml").write_text(text.replace("\nsteps:", "\nsteps: 7\n_old_steps:").replace("_old_steps:", "#"))
    cfg = load_config(str(d))
    assert cfg.recipe == "my_exp" and cfg.steps == 7


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="recipes:"):
        load_config("no_such_recipe")


def _cli(*args, env=None):
    """``python -m launch.local ARGS`` without the HF hub, in this process (each command here ends
    before any actor starts; the launchers' own processes are tested above and in test_e2e)."""
    return cli_here(*args, env={"HF_HUB_OFFLINE": "1", **(env or {})})


def test_a_missing_recipe_is_the_only_required_argument():
    """Overrides are optional: a command without a recipe asks for the recipe alone (every launcher)."""
    for mod, cmd in (("launch.local", "run"), ("launch.slurm", "submit"), ("launch.sky", "launch")):
        r = cli(cmd, module=mod, timeout=120)
        assert r.returncode == 2 and r.stderr.rstrip().endswith("the following arguments are required: recipe"), \
            (mod, r.stderr)


def test_gpu_recipe_fails_fast_on_cpu():
    r = _cli("run", "qwen3_1_7b")
    assert r.returncode == 2
    assert "needs device=cuda" in r.stderr and "HF hub" in r.stderr
    assert "Traceback" not in r.stderr


def test_check_prints_a_gpu_recipe_on_cpu_and_says_why_it_cannot_run_here():
    r = _cli("check", "qwen3_1_7b")
    assert r.returncode == 0 and "name: qwen3_1_7b" in r.stdout and "Traceback" not in r.stderr
    assert r.stderr.startswith("note: the config is valid, but it cannot run here") and "needs device=cuda" in r.stderr


def test_check_names_a_data_error_without_the_config(tmp_path):
    """A field the rows lack: the error alone (file:line, the fields the rows have), not after a dump of
    the resolved config."""
    r = _cli("check", "smollm2_135m_arith", "data.prompt_field=qq")
    assert r.returncode == 2 and r.stdout == "", r.stdout[:500]
    assert r.stderr.strip().splitlines() == [
        f"error: {ROOT}/recipes/smollm2_135m_arith/data/train.jsonl:1: no field 'qq' (data.prompt_field); the row "
        f"has ['answer', 'op', 'question']"], r.stderr


def test_eval_takes_ckpt_before_or_after_the_overrides(tmp_path):
    for args in (["--ckpt", str(tmp_path / "nope"), "eval.num_questions=2"],
                 ["eval.num_questions=2", "--ckpt", str(tmp_path / "nope")]):
        r = _cli("eval", "smollm2_135m", *args, env={"GSM8K_DIR": str(tmp_path)})
        assert r.returncode == 2 and "unrecognized arguments" not in r.stderr, r.stderr
        assert "has no test.jsonl" in r.stderr  # the preflight's complaint about GSM8K_DIR (eval: the test split)
    r = _cli("run", "smollm2_135m", "--ckpt", str(tmp_path))  # a run does not start from --ckpt: refused
    assert r.returncode == 2 and "--ckpt is eval's (to train from a checkpoint: model.path=DIR)" in r.stderr


def test_eval_of_a_checkpoint_scores_it_and_writes_eval_json(tmp_path):
    """``make eval CKPT=<HF checkpoint dir>``: greedy answers to a seeded subset of the test split,
    printed and saved beside the checkpoint (with its own tokenizer, as final/ holds one)."""
    import json

    from forge_core.models import converted_smollm2

    data, ck = tmp_path / "gsm8k", tmp_path / "final"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                                             + "\n" for i in range(5)))
    shutil.copytree(converted_smollm2(), ck)
    r = _cli("eval", "smollm2_135m", "--ckpt", str(ck), "eval.num_questions=2", "eval.max_response_tokens=8",
             env={"GSM8K_DIR": str(data)})
    assert r.returncode == 0, r.stderr
    res = json.loads((ck / "eval.json").read_text())
    assert res["questions"] == 2 and res["model"] == str(ck) and res["engine"] == "hf", res
    for k in ("pass@1", "accuracy_strict", "accuracy_flexible", "lm_eval_strict_match", "lm_eval_flexible_extract"):
        assert 0 <= res[k] <= 1, (k, res)
    assert json.loads(r.stdout[r.stdout.index("{"):]) == res


def test_eval_of_a_checkpoint_that_does_not_load_names_it(tmp_path):
    """A checkpoint that is not one, a truncated one and one of a smaller vocabulary are named; eval
    runs on CPU, so a GPU recipe's checkpoint gets past the preflight on a CPU machine."""
    from forge_core.models import converted_smollm2

    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{}")  # no model_type
    r = _cli("eval", "smollm2_135m", "--ckpt", str(tmp_path / "ck"), env={"GSM8K_DIR": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"CKPT={tmp_path / 'ck'}: cannot load it as an HF checkpoint" in r.stderr and "model_type" in r.stderr
    ck = tmp_path / "ck2"
    shutil.copytree(converted_smollm2(), ck)
    weights = ck / "model.safetensors"
    os.truncate(weights, 100)  # a copy cut short
    r = _cli("eval", "qwen3_1_7b", "--ckpt", str(ck), env={"GSM8K_DIR": str(tmp_path)})  # (not from the hub)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "needs device=cuda" not in r.stderr, r.stderr
    assert f"CKPT={ck}: cannot load it as an HF checkpoint" in r.stderr, r.stderr
    shutil.rmtree(ck)  # a model of 1,000 ids, without a tokenizer of its own: the recipe's is used
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(ck)
    r = _cli("eval", "smollm2_135m", "--ckpt", str(ck), env={"GSM8K_DIR": str(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"CKPT={ck}: a vocabulary of 1000 ids, fewer than its tokenizer's 49152" in r.stderr, r.stderr


def test_gated_model_without_token():
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    r = subprocess.run([PY, "-m", "launch.local", "run", "llama3_8b"], cwd=ROOT,
                       env=dict(env, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "HF_TOKEN" in r.stderr


def test_gated_check_takes_either_token_name():
    """huggingface_hub reads HF_TOKEN, then the legacy HUGGING_FACE_HUB_TOKEN: so does the check."""
    from forge_core.models import ModelConfig, gated_without_token

    cfg = ModelConfig(name="llama3_8b")
    assert "HF_TOKEN is not set" in gated_without_token(cfg, env={})
    assert gated_without_token(cfg, env={"HF_TOKEN": "x"}) is None
    assert gated_without_token(cfg, env={"HUGGING_FACE_HUB_TOKEN": "x"}) is None
    assert gated_without_token(ModelConfig(name="smollm2_135m"), env={}) is None


def test_unknown_key_fails_before_actors():
    r = _cli("run", "smollm2_135m", "trainer.lrr=1")
    assert r.returncode == 2 and "trainer.lrr" in r.stderr and "Monarch" not in r.stdout + r.stderr


def test_to_dataclass_takes_defaults_from_the_dataclass_and_names_a_bad_key():
    """``to_dataclass``: a key the section leaves out takes the dataclass's default; a loss section
    becomes its own loss's subclass; an unknown key, a value of the wrong type or an unknown loss is a
    ConfigError naming it."""
    from forge_core.config import TrainerConfig, to_dataclass
    from forge_core.losses import DAPOLossConfig, LossConfig

    assert to_dataclass({}, TrainerConfig) == TrainerConfig()
    assert to_dataclass({"lr": 2, "lora": {"rank": 8}}, TrainerConfig) == \
        dataclasses.replace(TrainerConfig(lr=2.0), lora=dataclasses.replace(TrainerConfig().lora, rank=8))
    cfg = load_config("smollm2_135m", ["loss=dapo", "loss.clip_high=0.3"])
    assert to_dataclass(cfg.loss, LossConfig) == DAPOLossConfig(clip_high=0.3)
    for bad, says in (({"lrr": 1}, "TrainerConfig.lrr"), ({"lr": "fast"}, "TrainerConfig.lr"),
                      ({"lora": {"rank": "x"}}, "TrainerConfig.lora.rank")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            to_dataclass(bad, TrainerConfig)
    with pytest.raises(ConfigError, match="loss.name='ppo'"):
        to_dataclass({"name": "ppo"}, LossConfig)
