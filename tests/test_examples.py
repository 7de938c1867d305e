"""The examples and the notebook run end to end on CPU, and every config field is a flag of the example scripts."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _load_script(name: str):
    """An example script as a module (its `__main__` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _parse(module, argv):
    """The example's own parser (`make_parser`: ScriptArguments, AgenticGRPOConfig, trl.ModelConfig)."""
    parser = module.make_parser()
    return parser, parser.parse_args_and_config(argv)


def _log_history(output_dir: Path) -> list[dict]:
    """Per-step logs the trainer saved (`trainer.save_state()`), without the final `train_runtime` summary."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "reward" in entry]


@pytest.mark.parametrize("name", ["grpo_retool", "grpo_gsm8k"])
def test_every_config_field_is_a_flag(name):
    """TrlParser over (ScriptArguments, AgenticGRPOConfig, ModelConfig), as TRL's scripts: the README's benchmark
    configuration is selectable, a YAML config works, the CPU demo's defaults apply, an unknown flag is an error
    (nothing is silently ignored)."""
    from trl import ModelConfig

    from trl_ext import AgenticGRPOConfig

    module = _load_script(name)
    parser, (script_args, args, model_args) = _parse(module, [])
    options = {option for action in parser._actions for option in action.option_strings}
    for f in [*dataclasses.fields(AgenticGRPOConfig), *dataclasses.fields(ModelConfig)]:
        if f.init:
            assert f"--{f.name}" in options, f.name
    for key, value in module.DEMO_DEFAULTS.items():
        assert getattr(args, key) == value, key
    assert model_args.model_name_or_path == "tiny" and model_args.dtype == "auto"
    assert Path(script_args.dataset_name).is_file()
    assert args.report_to == [] or args.report_to == "none" or args.report_to == ["none"]  # transformers' default

    _, (_, args, _) = _parse(module, [
        "--checkpoint_saves", "attention", "experts", "--liger_rms_norm", "true", "--fused_rope", "true",
        "--loss_type", "grpo",
        "--beta", "0.04", "--report_to", "tensorboard", "--logging_steps", "5", "--push_to_hub", "false",
        "--max_steps", "7",
    ])  # fmt: skip
    assert args.checkpoint_saves == ["attention", "experts"] and args.liger_rms_norm and args.fused_rope
    assert (args.loss_type, args.beta, args.logging_steps, args.max_steps) == ("grpo", 0.04, 5, 7)
    assert args.report_to == ["tensorboard"] and args.push_to_hub is False
    with pytest.raises(ValueError, match="no_such_flag"):
        _parse(module, ["--no_such_flag", "1"])
    bad_values = [("--cold_start_steps", "-1")]  # the script's own arguments are validated, naming the flag
    if name == "grpo_retool":
        bad_values += [("--cold_start_target_nll", "-1"), ("--rl_problems", "x")]
    for flag, value in bad_values:
        with pytest.raises(ValueError, match=f"{flag} must be"):
            _parse(module, [flag, value])


@pytest.mark.parametrize("name", ["grpo_retool", "grpo_gsm8k"])
def test_model_config_flags_reach_the_model(name, tmp_path):
    """TRL's ModelConfig flags: the tiny model is built with `--dtype` and `--attn_implementation`; a checkpoint path
    gets them in `model_init_kwargs`, as TRL's scripts pass them; the LoRA flags make the adapter's config."""
    import torch
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext.recipes import policy_from_model_config

    module = _load_script(name)
    _, (_, args, model_args) = _parse(module, [
        "--output_dir", str(tmp_path), "--dtype", "bfloat16", "--attn_implementation", "flex_attention",
        "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1",
        "--lora_target_modules", "q_proj", "v_proj", "--use_dora",
    ])  # fmt: skip
    model, peft_config, quantization_config = policy_from_model_config(model_args, args)
    assert isinstance(model, GptOssForCausalLM) and model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "flex_attention"
    assert (peft_config.r, peft_config.lora_alpha, peft_config.lora_dropout) == (4, 8, 0.1)
    assert set(peft_config.target_modules) == {"q_proj", "v_proj"} and peft_config.use_dora
    assert quantization_config is None

    _, (_, args, model_args) = _parse(module, ["--output_dir", str(tmp_path), "--use_peft"])
    model, peft_config, _ = policy_from_model_config(model_args, args)
    assert model.config._attn_implementation == "eager" and model.dtype == torch.float32  # the demo's defaults
    assert peft_config.target_modules == "all-linear" and not peft_config.use_dora

    checkpoint = tmp_path / "checkpoint"
    GptOssForCausalLM(tiny_gptoss_config(vocab_size=64)).save_pretrained(checkpoint)
    _, (_, args, model_args) = _parse(module, [
        "--output_dir", str(tmp_path), "--model_name_or_path", str(checkpoint), "--dtype", "float32",
        "--attn_implementation", "hf-gptoss-rl/sink-flash-attn3", "--model_init_kwargs", '{"low_cpu_mem_usage": true}',
    ])  # fmt: skip
    model, peft_config, _ = policy_from_model_config(model_args, args)
    assert model == str(checkpoint) and peft_config is None
    assert args.model_init_kwargs == {
        "revision": "main", "attn_implementation": "hf-gptoss-rl/sink-flash-attn3", "dtype": "float32",
        "low_cpu_mem_usage": True,
    }  # fmt: skip
    assert args.attn_implementation is None  # the flag is ModelConfig's; AgenticGRPOConfig keeps a Python keyword


@pytest.mark.parametrize("flag", ["--load_in_4bit", "--load_in_8bit"])
def test_quantization_flags_without_bitsandbytes_name_the_package(flag, tmp_path):
    import importlib.util

    from trl_ext.recipes import policy_from_model_config

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    module = _load_script("grpo_retool")
    _, (_, args, model_args) = _parse(module, [
        "--output_dir", str(tmp_path), flag, "--use_peft", "--dtype", "bfloat16", "--model_name_or_path", "org/model",
    ])  # fmt: skip
    assert getattr(model_args, flag[2:])
    with pytest.raises(ImportError, match=f"{flag} quantizes the base model with the bitsandbytes package"):
        policy_from_model_config(model_args, args)


def test_lora_flags_reach_the_trained_policy(tmp_path):
    """`examples/grpo_retool.py --use_peft --lora_r 4 ...`: one GRPO step trains an adapter of that shape."""
    module = _load_script("grpo_retool")
    _, (script_args, args, model_args) = _parse(module, [
        "--output_dir", str(tmp_path), "--report_to", "none", "--cold_start_steps", "0", "--eval_problems", "0",
        "--num_prompts", "2", "--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--max_completion_length", "8", "--max_turns", "1", "--disable_tqdm", "true",
        "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1",
        "--lora_target_modules", "q_proj", "v_proj",
    ])  # fmt: skip
    trainer = module.main(script_args, args, model_args)
    adapter = trainer.model.peft_config["default"]
    assert (adapter.r, adapter.lora_alpha, adapter.lora_dropout) == (4, 8, 0.1)
    assert set(adapter.target_modules) == {"q_proj", "v_proj"}
    assert trainer.state.global_step == 1
    assert (tmp_path / "adapter_config.json").is_file()


def test_yaml_config_sets_fields(tmp_path):
    module = _load_script("grpo_retool")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: 11\nbeta: 0.02\ncold_start_steps: 5\n")
    _, (script_args, args, _) = _parse(module, ["--config", str(recipe), "--beta", "0.03"])
    assert (args.max_steps, args.beta, script_args.cold_start_steps) == (11, 0.03, 5)  # the command line wins
    recipe.write_text("max_steps: 11\nnot_a_field: 1\n")
    with pytest.raises(ValueError, match="not_a_field"):
        _parse(module, ["--config", str(recipe)])


def test_examples_are_not_imported_as_libraries():
    """Reused code lives in the package: nothing imports an example, and no example edits sys.path."""
    offenders = []
    for path in [*REPO.glob("examples/**/*.py"), *REPO.glob("benchmarks/*.py"), *REPO.glob("tests/*.py"),
                 *REPO.glob("examples/**/*.ipynb")]:  # fmt: skip
        text = path.read_text()
        if re.search(r"^\s*(from|import)\s+grpo_(retool|gsm8k)\b", text, re.MULTILINE) or (
            path.is_relative_to(EXAMPLES) and "sys.path" in text
        ):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


def _practised_line(stdout: str, when: str) -> dict:
    match = re.search(
        rf"\[{when} GRPO\] practised problems: accuracy (\d+)/(\d+) \| tool-call rate ([\d.]+) \| tool calls that ran "
        r"([\d.]+|n/a)",
        stdout,
    )
    assert match, stdout[-3000:]
    correct, n, rate, ran = match.groups()
    return {"correct": int(correct), "n": int(n), "tool_call_rate": float(rate),
            "ran": None if ran == "n/a" else float(ran)}  # fmt: skip


@pytest.mark.slow
def test_grpo_retool_under_accelerate_launch(tmp_path):
    """The README's main job (`accelerate launch examples/grpo_retool.py`) with its defaults, 2 GRPO steps instead of
    the demo's: after the cold start the policy's tool calls parse and run, and the trainer's logs are saved."""
    out = tmp_path / "retool"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
        str(EXAMPLES / "grpo_retool.py"), "--max_steps", "2", "--output_dir", str(out), "--report_to", "none",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "done: 2 steps" in result.stdout
    before = _practised_line(result.stdout, "before")
    assert before["n"] == 4 and before["tool_call_rate"] > 0 and before["ran"] > 0  # a working tool loop
    _practised_line(result.stdout, "after")
    metrics = _log_history(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("reward", "rollout/tool_calls_mean", "mismatch/k3_kl", "mismatch/prob_diff_max", "loss"):
            assert key in m and m[key] == m[key]  # logged and not NaN
        assert m["clip_ratio/region_mean"] == 0.0  # on-policy: ratio exactly 1
        # the engine follows every optimizer step: step N's rollouts were served on the weights synced after N - 1
        assert m["rollout/weight_version"] == m["step"] - 1 and m["rollout/stale_trajectories"] == 0
    assert (out / "model.safetensors").is_file()
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_grpo_gsm8k_single_turn(tmp_path):
    out = tmp_path / "gsm8k"
    cmd = [
        sys.executable, str(EXAMPLES / "grpo_gsm8k.py"), "--max_steps", "1", "--cold_start_steps", "5",
        "--max_completion_length", "48", "--output_dir", str(out), "--report_to", "none",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics,) = _log_history(out)
    assert metrics["rollout/tool_calls_mean"] == 0.0 and metrics["rollout/turns_mean"] == 1.0
    assert "mismatch/k3_kl" in metrics


@pytest.mark.slow
def test_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(EXAMPLES / "notebooks" / "agentic_grpo.ipynb", as_version=4)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    old_pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    # a working directory outside the repository: the notebook finds its data wherever it runs; outputs land here
    work = tmp_path / "elsewhere"
    work.mkdir()
    try:
        client = nbclient.NotebookClient(
            nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(work)}}
        )
        client.execute()
    finally:
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
    outputs = "".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    assert "global_step=" in outputs
    match = re.search(r"before GRPO: .*tool calls that ran ([\d.]+)", outputs)
    assert match and float(match.group(1)) > 0, outputs[-3000:]  # the cold-started policy's tool calls run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grpo_retool_ddp_two_cpu_processes(tmp_path):
    """`torchrun --nproc_per_node 2` (DDP over gloo): rewards/metrics gathered, each rank's engine synced."""
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        str(EXAMPLES / "grpo_retool.py"), "--max_steps", "2", "--cold_start_steps", "5", "--eval_problems", "2",
        "--per_device_train_batch_size", "4", "--max_completion_length", "48", "--output_dir", str(out),
        "--report_to", "none",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("done: 2 steps") == 1  # printed by the main process of the 2
    assert "world size 2" in result.stdout
    metrics = _log_history(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/weight_version"] == m["step"] - 1 for m in metrics)  # served, one sync before the step
