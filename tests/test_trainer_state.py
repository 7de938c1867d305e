"""What `AgenticGRPOTrainer` keeps between TRL's hooks.

Data travels between hooks in arguments and in TRL's batch dict; the trainer assigns its own attributes in
`__init__` only, with the exceptions listed here, each with the reason TRL 1.16's hook signatures leave. A new
attribute assigned in a hook (or by a helper module on the trainer) fails this test by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "trl_ext"

# attribute -> why it is assigned outside `__init__`
ASSIGNED_OUTSIDE_INIT = {
    # TRL's `_generate_and_score_completions` runs the rollout (through `_generate` and the `rollout_func`) and then
    # its own log-prob passes, which replay the rollout's routing; extra `rollout_func` keys only reach the reward
    # functions, so one generation's batch lives from `_rollout` until `_generate_and_score_completions` returns.
    "_rollout_batch": "trainer.py",
    # TRL's `_compute_loss` calls `_get_per_token_logps_and_entropies` without the batch; the correction and the
    # replay need its rows' sampling log-probs and routing: set and cleared by `_compute_loss` (try/finally).
    "_loss_inputs": "trainer.py",
    # the weight version the engine serves: the run's own state, moved on by each sync (a callback's `on_step_end`)
    "synced_weight_version": "rollout_sync.py",
    # the latest correction weights, an output kept for inspection (never read by the trainer)
    "last_importance_weights": "rollout_correction.py",
    # memory-derived bounds of selective checkpointing, computed when checkpointing is enabled (set-up time)
    "checkpoint_experts_max_tokens": "policy.py",
    "checkpoint_projections_max_tokens": "policy.py",
}


def _is_trainer(node: ast.expr, owner: str) -> bool:
    """`self` in a trainer method, `trainer` in a helper function, `self.trainer` in a callback."""
    if isinstance(node, ast.Name):
        return node.id == owner
    return isinstance(node, ast.Attribute) and node.attr == "trainer" and isinstance(node.value, ast.Name)


def _assigned_attributes(path: Path) -> list[tuple[str, str, int]]:
    """`(function, attribute, line)` of every `self.X = ...` (trainer classes), `trainer.X = ...` or
    `self.trainer.X = ...` outside an `__init__`."""
    tree = ast.parse(path.read_text())
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Trainer")}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.ClassDef) and node.name not in classes:
            continue
        functions = node.body if isinstance(node, ast.ClassDef) else [node]
        for fn in functions:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name == "__init__":
                continue
            # methods of a trainer class assign `self.X`; helper functions taking the trainer assign `trainer.X`
            owner = "self" if isinstance(node, ast.ClassDef) else "trainer"
            for sub in ast.walk(fn):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign | ast.AugAssign
                ) else []  # fmt: skip
                for target in targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute) and _is_trainer(t.value, owner):
                            found.append((fn.name, t.attr, sub.lineno))
    return found


def _outside_init() -> dict[str, set[str]]:
    assigned: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for fn, attr, line in _assigned_attributes(path):
            assigned.setdefault(attr, set()).add(f"{path.name}:{line} ({fn})")
    return assigned


def test_hooks_assign_only_the_listed_attributes():
    assigned = _outside_init()
    unlisted = {attr: sorted(where) for attr, where in assigned.items() if attr not in ASSIGNED_OUTSIDE_INIT}
    assert not unlisted, (
        f"trainer attributes assigned outside __init__ that are not in ASSIGNED_OUTSIDE_INIT: {unlisted}; pass the "
        "value as an argument or in TRL's batch instead, or list it with the reason TRL's hooks leave"
    )
    for attr, module in ASSIGNED_OUTSIDE_INIT.items():
        assert attr in assigned, f"{attr} is no longer assigned outside __init__: remove it from the list"
        assert all(w.startswith(module + ":") for w in assigned[attr]), (attr, sorted(assigned[attr]))


def test_an_attribute_set_in_a_hook_is_found(tmp_path):
    """Positive control: a flag set around a call in a hook, the shape this test exists to keep out."""
    planted = tmp_path / "trainer.py"
    planted.write_text(
        "class PlantedTrainer:\n"
        "    def __init__(self):\n"
        "        self._flag = False\n"
        "    def _hook(self):\n"
        "        self._flag = True\n"
        "def helper(trainer):\n"
        "    trainer._other, x = 1, 2\n"
        "class Callback:\n"
        "    def on_step_end(self):\n"
        "        self.trainer._third = 3\n"
        "        self.count = 1\n"
    )
    assert sorted(attr for _, attr, _ in _assigned_attributes(planted)) == ["_flag", "_other", "_third"]


def test_a_failed_generation_leaves_no_rollout_batch(tmp_path):
    """A generation that fails after its rollouts (here in a reward function) drops its batch with it: the next
    generation's log-prob passes never see this one's routing."""
    import pytest
    import torch
    from datasets import Dataset
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.harmony import load_gptoss_tokenizer
    from hf_gptoss_rl.model_builders import tiny_gptoss_config
    from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer

    def failing_reward(completions, **kwargs):
        raise RuntimeError("reward failed")

    torch.manual_seed(0)
    model_config = tiny_gptoss_config(num_hidden_layers=1, hidden_size=32, intermediate_size=32, head_dim=8)
    model_config._attn_implementation = "eager"
    trainer = AgenticGRPOTrainer(
        model=GptOssForCausalLM(model_config), reward_funcs=failing_reward,
        args=AgenticGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, max_steps=1, use_cpu=True, bf16=False, report_to="none",
                               save_strategy="no", disable_tqdm=True, seed=0),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2 + 2?"}]}] * 2),
        processing_class=load_gptoss_tokenizer(),
    )  # fmt: skip
    rollouts = []
    rollout = trainer._rollout
    trainer._rollout = lambda prompts: rollouts.append(len(prompts)) or rollout(prompts)
    with pytest.raises(RuntimeError, match="reward failed"):
        trainer.train()
    assert rollouts == [2]  # the rollout ran, then the reward failed
    assert trainer._rollout_batch is None
