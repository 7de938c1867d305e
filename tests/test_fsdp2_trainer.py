"""The FSDP2 launch config (examples/accelerate/fsdp2.yaml) on CPU: accelerate does not shard, the trainer says so.

`accelerate launch --config_file examples/accelerate/fsdp2.yaml` exports the FSDP settings
(`ACCELERATE_USE_FSDP=true`, `FSDP_VERSION=2`, ...), but accelerate 1.x enables FSDP only for accelerator process
types: `AcceleratorState.__init__` (accelerate/state.py) switches `distributed_type` to `FSDP` inside the branch for
`MULTI_GPU`/`MULTI_XPU`/`MULTI_NPU`/... only, while CPU processes get `MULTI_CPU` from
`PartialState._prepare_backend` (with `use_cpu`; `NO`, i.e. unconnected single processes, without it). Nothing is
raised or logged there, and the model is then wrapped in DDP, so the FSDP2 path (sharded parameters, gathered
weight sync, FSDP checkpoints) cannot run on CPU through accelerate. Handing the trainer a GPT-OSS already sharded
with `torch.distributed.fsdp.fully_shard` (decoder layers + root, as accelerate does for fsdp_version 2) does not
work either: the trainer then sees no FSDP, and `Accelerator.prepare_model` wraps the model in DDP, whose module-state
sync fails on the DTensor parameters (torch 2.13: "aten.cat.default got mixed torch.Tensor and DTensor").

The trainer refuses that silent fallback: this test launches 2 CPU processes with the CPU variant of the example
config and checks that accelerate set up `MULTI_CPU` from the FSDP2 environment, and that `AgenticGRPOTrainer`
raised an error naming it. If a later accelerate shards on CPU, the first assertion fails: the FSDP2 path then
becomes testable here (weight sync of the gathered state dict, checkpoints, resume).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_config_on_cpu_is_refused_not_run_as_ddp(tmp_path):
    config = yaml.safe_load((REPO / "examples" / "accelerate" / "fsdp2.yaml").read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    config.update(use_cpu=True, mixed_precision="no", num_processes=2)  # the CPU variant: fp32, 2 gloo ranks
    config_file = tmp_path / "fsdp2_cpu.yaml"
    config_file.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
        "--main_process_port", str(_free_port()), str(REPO / "tests" / "fsdp2_trainer_worker.py"), str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        # the launcher did ask for FSDP2 with the example's settings
        env_fsdp = record["launch_env"]
        assert env_fsdp["ACCELERATE_USE_FSDP"] == "true" and env_fsdp["FSDP_VERSION"] == "2"
        assert env_fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "GptOssDecoderLayer"
        # ... and accelerate set up 2 connected gloo processes without FSDP
        assert record["distributed_type"] == "DistributedType.MULTI_CPU", record
        assert (record["num_processes"], record["process_index"], record["backend"]) == (2, rank, "gloo")
        # the trainer refuses to train DDP in place of the requested FSDP
        assert record["built"] is False, record
        assert "FSDP" in record["error"] and "MULTI_CPU" in record["error"], record["error"]
