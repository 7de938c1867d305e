"""The run of tests/test_resume.py: a tiny GPT-OSS trained with the embedded engine's real sampling.

`build_trainer` is shared by the test process and by this file's `__main__`, which either trains with a checkpoint
after every step and kills itself with SIGKILL inside step 3 (after its rollouts, before its optimizer step), or
(with a marker path) runs long rollouts for a test to interrupt with Ctrl-C.
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


if __name__ == "__main__":
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
