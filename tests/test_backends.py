"""The Triton-or-PyTorch settings (`hf_gptoss_rl._backend`): read from the environment once, chosen in-process by
argument, and never looked up in `os.environ` by a forward or backward pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GptOssForCausalLM
from transformers.models.gpt_oss import modeling_gpt_oss

from hf_gptoss_rl import _backend, set_backends, use_backends
from hf_gptoss_rl.fused_layers import apply_fused_gptoss_rope
from hf_gptoss_rl.logprobs import causal_lm_token_logprobs
from hf_gptoss_rl.model_builders import tiny_gptoss_config

REPO = Path(__file__).resolve().parents[1]


class RecordingEnviron(dict):
    """A copy of the environment that records every key looked up (`get`, `[]`, `in`, `os.getenv`)."""

    def __init__(self, base):
        super().__init__(base)
        self.keys_read: list[str] = []

    def __getitem__(self, key):
        self.keys_read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.keys_read.append(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.keys_read.append(key)
        return super().__contains__(key)


def test_forward_and_backward_read_no_backend_variable(monkeypatch):
    """A training step of a tiny GPT-OSS through every switched part (memory-efficient experts, the fused-RoPE
    dispatcher, chunked log-probs) looks up no ``HF_GPTOSS_RL_*`` variable; the settings were read at import."""
    monkeypatch.setattr(modeling_gpt_oss, "apply_rotary_pos_emb", modeling_gpt_oss.apply_rotary_pos_emb)
    torch.manual_seed(0)
    config = tiny_gptoss_config(vocab_size=128, num_hidden_layers=2)
    model = GptOssForCausalLM(config).float()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("memory_efficient")
    apply_fused_gptoss_rope(model)
    input_ids = torch.randint(0, 128, (2, 12))

    recorder = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", recorder)
    assert os.getenv("HF_GPTOSS_RL_PROBE") is None and "HF_GPTOSS_RL_PROBE" in recorder.keys_read  # the recorder sees
    recorder.keys_read.clear()
    logps, _ = causal_lm_token_logprobs(model, input_ids, logits_to_keep=6, chunk_size=4)
    logps.sum().backward()
    monkeypatch.undo()

    read = sorted({key for key in recorder.keys_read if key.startswith("HF_GPTOSS_RL_")})
    assert read == [], f"the hot path looked up {read} in os.environ"
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None  # the experts ran forward and backward


def test_environment_is_read_at_import():
    """``HF_GPTOSS_RL_<PART>_BACKEND`` / ``HF_GPTOSS_RL_EXPERTS_GROUPED_MM`` still start the settings."""
    env = dict(os.environ, HF_GPTOSS_RL_EXPERTS_BACKEND="torch", HF_GPTOSS_RL_EXPERTS_GROUPED_MM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = "from hf_gptoss_rl import _backend; c = _backend.current; print(c.experts, c.logprobs, c.experts_grouped_mm)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "auto", "True"]


def test_bad_environment_values_name_the_variable():
    assert _backend.backends_from_environment({}) == _backend.Backends()
    with pytest.raises(ValueError, match="HF_GPTOSS_RL_ROPE_BACKEND must be auto, torch or triton, got 'bogus'"):
        _backend.backends_from_environment({"HF_GPTOSS_RL_ROPE_BACKEND": "bogus"})
    with pytest.raises(ValueError, match="HF_GPTOSS_RL_EXPERTS_GROUPED_MM must be 0 or 1, got 'yes'"):
        _backend.backends_from_environment({"HF_GPTOSS_RL_EXPERTS_GROUPED_MM": "yes"})


def test_set_backends_checks_every_change_before_applying_any():
    before = dict(vars(_backend.current))
    with pytest.raises(ValueError, match="backend logprobs must be auto, torch or triton, got 'cuda'"):
        set_backends(experts="torch", logprobs="cuda")
    with pytest.raises(ValueError, match="unknown backend part 'attention'"):
        set_backends(attention="torch")
    with pytest.raises(ValueError, match="experts_grouped_mm must be a bool"):
        set_backends(experts_grouped_mm="1")
    assert vars(_backend.current) == before


def test_use_backends_restores_the_previous_choice():
    set_backends(logprobs="auto")
    with use_backends(logprobs="torch") as settings:
        assert settings.logprobs == "torch"
        assert not _backend.use_triton("logprobs", torch.zeros(1), kernels_importable=True)
    assert _backend.current.logprobs == "auto"
