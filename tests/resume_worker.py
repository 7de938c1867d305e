"""The run of tests/test_resume.py and tests/test_long_runs.py: a tiny GPT-OSS trained with real sampling.

`build_trainer` is shared by the test process and by this file's `__main__`, which either trains with a checkpoint
after every step and kills itself with SIGKILL inside step 3 (after its rollouts, before its optimizer step), or
(with a marker path) runs long rollouts for a test to interrupt with Ctrl-C, or (``--kill-at KIND:N``, `kill_at`)
trains as a user resuming with ``--resume_from_checkpoint latest`` would, and SIGKILLs itself at the N-th moment of
a kind: a trajectory starting, a weight sync, a checkpoint file half-written.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from datasets import Dataset
from transformers import GptOssForCausalLM

from hf_gptoss_rl.harmony import load_gptoss_tokenizer
from hf_gptoss_rl.model_builders import tiny_gptoss_config
from trl_ext import AgenticGRPOConfig, AgenticGRPOTrainer

STEPS = 4


def tiny_model() -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = tiny_gptoss_config(num_hidden_layers=2, hidden_size=32, intermediate_size=32, head_dim=8)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config)


def build_trainer(output_dir: str, *, max_steps: int = STEPS, record: list | None = None, kill_at_step=None, **kw):
    """`record` receives (global step, prompt, completion ids) of every trajectory; `kill_at_step`: SIGKILL
    in the reward computation of the step after that global step."""
    model = tiny_model()
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(4)]

    def reward(prompts, completion_ids, trainer_state, **kwargs):
        step = trainer_state.global_step
        if kill_at_step is not None and step == kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if record is not None:
            record.extend((step, str(p), list(c)) for p, c in zip(prompts, completion_ids))
        # a function of the sampled ids: the groups have reward variance, so every step moves the weights
        return [float(sum(c) % 7) for c in completion_ids]

    args = dict(
        output_dir=output_dir, max_steps=max_steps, learning_rate=1e-2, lr_scheduler_type="constant",
        per_device_train_batch_size=4, num_generations=2, max_completion_length=12, max_turns=1, temperature=1.0,
        beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, seed=0, rollout_concurrency=8, dataloader_num_workers=0, disable_tqdm=True,
        # the IS ratio's exp(sum of log-ratios) would amplify the runs' float32 rounding differences
        vllm_importance_sampling_correction=False,
    )  # fmt: skip
    args.update(kw)
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=AgenticGRPOConfig(**args),
        train_dataset=Dataset.from_list(rows),
        processing_class=load_gptoss_tokenizer(),
    )
    return trainer


def kill_at(kind: str, n: int) -> None:
    """SIGKILL this process at the ``n``-th moment of ``kind``: ``"rollout"`` (a trajectory starts), ``"sync"`` (a weight
    sync starts), ``"write"`` (a checkpoint file: half of its bytes are written, then the kill) or ``"any"`` (any of
    them). Moments are counted in the order the run reaches them, which is the same in every run: a kill is replayed
    exactly from ``kind:n``."""
    import dataclasses
    import io
    import json

    import transformers.modeling_utils
    from safetensors.torch import save as safetensors_bytes
    from transformers import TrainerState

    import trl_ext.weight_sync
    from trl_ext.rollout import AgentLoop

    counts = {"rollout": 0, "sync": 0, "write": 0, "any": 0}

    def moment(what: str, path=None, data: bytes | None = None) -> None:
        counts[what] += 1
        counts["any"] += 1
        if kind not in (what, "any") or counts[kind] != n:
            return
        if path is not None:  # the kill lands while the file is being written
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(owner, name, what, file_bytes=None):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            moment(what, *(file_bytes(*args, **kwargs) if file_bytes else ()))
            return original(*args, **kwargs)

        setattr(owner, name, hooked)

    torch_save = torch.save

    def torch_bytes(obj, f, *args, **kwargs):
        if not isinstance(f, str | os.PathLike):
            return None, None
        buffer = io.BytesIO()
        torch_save(obj, buffer)
        return f, buffer.getvalue()

    def state_bytes(state, path):
        return path, (json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n").encode()

    hook(AgentLoop, "run", "rollout")
    hook(trl_ext.weight_sync, "push_policy_weights", "sync")
    hook(torch, "save", "write", torch_bytes)
    hook(
        transformers.modeling_utils,
        "safe_save_file",
        "write",
        lambda t, f, metadata=None: (f, safetensors_bytes(t, metadata)),
    )
    hook(TrainerState, "save_to_json", "write", state_bytes)


class _RecordFile(list):
    """`build_trainer`'s record, appended to a JSON-lines file as it grows (it outlives a SIGKILL)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def extend(self, items) -> None:
        import json

        items = list(items)
        super().extend(items)
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(item) + "\n" for item in items))


if __name__ == "__main__":
    if sys.argv[1] == "--kill-at":  # --kill-at KIND:N OUTPUT_DIR MAX_STEPS RECORD_FILE [SGLANG_URL]; N=0: no kill
        from trl_ext.checkpoints import latest_checkpoint

        kind, _, n = sys.argv[2].partition(":")
        out, max_steps, record = sys.argv[3], int(sys.argv[4]), _RecordFile(sys.argv[5])
        if int(n) > 0:
            kill_at(kind, int(n))
        backend = dict(rollout_backend="sglang", sglang_urls=[sys.argv[6]]) if len(sys.argv) > 6 else {}
        trainer = build_trainer(
            out, max_steps=max_steps, record=record, save_strategy="steps", save_steps=1, save_total_limit=2, **backend
        )
        # what a user passes on every restart; the very first run has nothing to resume
        trainer.train(resume_from_checkpoint="latest" if latest_checkpoint(out) else None)
        sys.exit(0)
    if len(sys.argv) == 3:  # OUTPUT_DIR MARKER: long rollouts; MARKER is written once they run (to send Ctrl-C)
        from pathlib import Path

        from trl_ext.rollout import EmbeddedEngine

        generate = EmbeddedEngine.generate

        async def announced(self, input_ids, sampling):
            Path(sys.argv[2]).touch()
            return await generate(self, input_ids, sampling)

        EmbeddedEngine.generate = announced
        build_trainer(sys.argv[1], max_steps=50, max_completion_length=2000).train()
        sys.exit("the run was expected to be interrupted")
    # OUTPUT_DIR: dies inside step 3, checkpoints 1 and 2 kept
    build_trainer(sys.argv[1], kill_at_step=2, save_strategy="steps", save_steps=1).train()
    sys.exit("the run was expected to be killed inside step 3")
