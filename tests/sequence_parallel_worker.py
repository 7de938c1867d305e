"""Rank body of tests/test_sequence_parallel.py: runs every SP scenario on gloo ranks and saves what rank 0 sees.

Spawned by the test (torch.multiprocessing); the single-process references are computed in the test process
from the same weights. Each scenario saves the gathered logits / log-probs, the per-rank losses summed over the
SP group, and the parameter gradients summed over the SP group.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from hf_gptoss_rl.model_builders import tiny_gptoss_config
from hf_gptoss_rl.sequence_parallel import (
    disable_sequence_parallel,
    enable_sequence_parallel,
    gather_outputs,
    sequence_parallel_disabled,
    sequence_parallel_logprobs,
    sequence_parallel_mesh,
    shard_inputs,
)

VOCAB = 64


def build_model(state_dict=None, **config_overrides):
    """The test model: tiny GPT-OSS, fp32, eager attention, sliding window 8, GQA 4 query / 2 KV heads."""
    torch.manual_seed(0)
    from transformers import GptOssForCausalLM

    config = tiny_gptoss_config(vocab_size=VOCAB, sliding_window=8, **config_overrides)
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).float()
    if state_dict is None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    else:
        model.load_state_dict(state_dict)
    return model


def make_inputs(seed: int = 1):
    """The scenarios' full (unsharded) inputs, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    single = torch.randint(0, VOCAB, (1, 37), generator=g)  # 37: padding needed for P = 2 and 4
    lengths = [11, 15, 10]
    packed_ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    packed_pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed_labels = packed_ids.clone()
    packed_labels[0, torch.tensor([0, 11, 26])] = -100  # first token of each sequence is not a target
    padded_ids = torch.randint(0, VOCAB, (2, 30), generator=g)
    padded_mask = torch.ones(2, 30, dtype=torch.long)
    padded_mask[0, :5] = 0  # left padding (prompt side)
    padded_mask[1, -4:] = 0  # right padding (completion side)
    return {
        "single": {"input_ids": single},
        "packed": {"input_ids": packed_ids, "position_ids": packed_pos, "labels": packed_labels, "lengths": lengths},
        "padded": {"input_ids": padded_ids, "attention_mask": padded_mask},
    }


def _summed_grads(model, group):
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[name] = g
    model.zero_grad(set_to_none=True)
    return grads


def _lm_scenario(model, batch, group):
    """Forward + backward of the LM loss on this rank's shard; logits gathered, loss and grads summed."""
    model_batch = {k: v for k, v in batch.items() if k != "lengths"}
    model_batch.setdefault("labels", batch["input_ids"])
    shard = shard_inputs(model_batch, group)
    out = model(**shard)
    out.loss.backward()
    seq_len = batch["input_ids"].shape[1]
    logits = gather_outputs(out.logits.detach(), group, dim=1)[:, :seq_len]
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return {"logits": logits, "loss": loss, "grads": _summed_grads(model, group)}


def _logprob_scenario(model, batch, group):
    logps = sequence_parallel_logprobs(model, batch, group, temperature=0.7)
    target_mask = batch["attention_mask"][:, 1:].float()
    (logps * target_mask).sum().backward()
    grads = _summed_grads(model, group)
    with torch.no_grad():
        kept, entropy = sequence_parallel_logprobs(
            model,
            batch,
            group,
            temperature=0.7,
            logits_to_keep=9,
            return_entropy=True,
            chunk_size=7,
            through_model_forward=True,
        )
    return {"logps": logps.detach(), "logps_keep9": kept, "entropy_keep9": entropy, "grads": grads}


def _wrapped_scenarios(state_dict, batch, group):
    """DDP and FSDP2 around the SP model: log-probs through the wrapper's forward, loss x sp (they average).

    Returns the gradients the wrappers leave (already reduced over all ranks), as full tensors.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    sp_size = dist.get_world_size(group)
    target_mask = batch["attention_mask"][:, 1:].float()
    out = {}
    for wrapper in ("ddp", "fsdp2"):
        model = build_model(state_dict)
        enable_sequence_parallel(model, group)
        if wrapper == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            for layer in model.model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        logps = sequence_parallel_logprobs(wrapped, batch, group, temperature=0.7)  # detects the wrapper
        ((logps * target_mask).sum() * sp_size).backward()
        out[wrapper] = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()
        }
    return out


def _kernel_scenarios(state_dict, inputs, group):
    """The same scenarios with the project's sink kernel as the inner attention (its CPU path)."""
    from transformers import modeling_flash_attention_utils

    from hf_gptoss_rl.attention import ATTN_IMPLEMENTATION

    # the wrapper passes the varlen arguments it computed once per forward: transformers never derives them from
    # position_ids in a layer (a read-back from the device per layer)
    derive = modeling_flash_attention_utils._prepare_from_posids
    derivations = []
    modeling_flash_attention_utils._prepare_from_posids = lambda *a, **k: derivations.append(1) or derive(*a, **k)
    try:
        model = build_model(state_dict)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        enable_sequence_parallel(model, group)
        return {
            "inner": model._sequence_parallel.inner,
            "single": _lm_scenario(model, inputs["single"], group),
            "packed": _lm_scenario(model, inputs["packed"], group),
            "padded": _logprob_scenario(model, inputs["padded"], group),
            "derivations_from_position_ids": len(derivations),
        }
    except Exception:
        return {"error": traceback.format_exc()}
    finally:
        modeling_flash_attention_utils._prepare_from_posids = derive


def run(rank: int, world: int, init_file: str, state_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        model = build_model(torch.load(state_path))
        inputs = make_inputs()
        enable_sequence_parallel(model, None)
        enable_sequence_parallel(model, None)  # idempotent
        results["attn_implementation"] = model.config._attn_implementation
        group = dist.group.WORLD
        results["single"] = _lm_scenario(model, inputs["single"], group)
        # Both layers (sliding, full) reused one gather: one mask per layer kind survives the forward.
        results["mask_cache_entries"] = len(model._sequence_parallel._masks)
        results["packed"] = _lm_scenario(model, inputs["packed"], group)
        results["padded"] = _logprob_scenario(model, inputs["padded"], group)
        # Temporarily off (generation in an embedded rollout): a plain model, then SP again on the same group.
        with sequence_parallel_disabled(model), torch.no_grad():
            results["disabled_block"] = {
                "logits": model(input_ids=inputs["single"]["input_ids"]).logits,
                "attn_implementation": model.config._attn_implementation,
            }
        results["after_block"] = model.config._attn_implementation
        # Gradient checkpointing: the backward recomputes attention, all-to-alls included.
        model.gradient_checkpointing_enable()
        results["single_ckpt"] = _lm_scenario(model, inputs["single"], group)
        model.gradient_checkpointing_disable()
        results["wrapped"] = _wrapped_scenarios(torch.load(state_path), inputs["padded"], group)
        results["kernel"] = _kernel_scenarios(torch.load(state_path), inputs, group)
        try:
            model(input_ids=inputs["single"]["input_ids"][:, :4])
            results["missing_position_ids_error"] = ""
        except ValueError as err:
            results["missing_position_ids_error"] = str(err)
        sp_group = group
        if world == 4:
            # Two SP groups of 2 (dp=2 x sp=2): the group comes from the mesh, not the world.
            mesh = sequence_parallel_mesh(2, device_type="cpu")
            sp_group = mesh.get_group("sp")
            results["mesh"] = {
                "sp_ranks": dist.get_process_group_ranks(sp_group),
                "dp_ranks": dist.get_process_group_ranks(mesh.get_group("dp")),
                "fsdp_ranks": dist.get_process_group_ranks(mesh.get_group("dp_shard_cp")),
            }
            # From an accelerate ParallelismConfig: the same layout, built once and stored as its device_mesh.
            from accelerate.parallelism_config import ParallelismConfig

            from hf_gptoss_rl.sequence_parallel import get_sequence_parallel_group

            pc = ParallelismConfig(dp_shard_size=2, sp_size=2)
            pc_group = get_sequence_parallel_group(pc, device_type="cpu")
            results["mesh"]["from_parallelism_config"] = {
                "sp_ranks": dist.get_process_group_ranks(pc_group),
                "mesh_dims": list(pc.device_mesh.mesh_dim_names),
                "reused": get_sequence_parallel_group(pc) is pc_group,
            }
            enable_sequence_parallel(model, mesh)  # switches the group
            results["mesh_single"] = _lm_scenario(model, inputs["single"], sp_group)
        # A deep copy (TRL's reference model) keeps SP on, sharing the group; disabling the copy leaves the original.
        import copy

        twin = copy.deepcopy(model)
        results["twin_single"] = _lm_scenario(twin, inputs["single"], sp_group)
        disable_sequence_parallel(twin)
        results["twin_after_disable"] = (twin.config._attn_implementation, model.config._attn_implementation)
        disable_sequence_parallel(model)
        results["after_disable"] = model.config._attn_implementation
        # With SP off, the same weights are plain single-process eager again.
        with torch.no_grad():
            results["after_disable_logits"] = model(input_ids=inputs["single"]["input_ids"]).logits
    except Exception:  # surfaced by the test, which otherwise only sees a dead process
        results["error"] = traceback.format_exc()
    if rank in (0, world - 1):
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
