"""Train GPT-OSS with sink-aware Ulysses sequence parallelism (SP): every rank holds 1/P of each sequence.

Runs on CPU with gloo (a tiny GPT-OSS with the real 201k vocabulary, GSM8K rows packed into long sequences) and,
unchanged, on GPUs with NCCL. Launch with either launcher:

    torchrun --nproc_per_node 2 examples/sp_train.py                       # one SP group of 2
    accelerate launch --multi_gpu --num_processes 2 examples/sp_train.py   # the same through accelerate
    torchrun --nproc_per_node 4 examples/sp_train.py --sp-size 2           # dp=2 x sp=2
    python examples/sp_train.py                                            # one process (SP group of 1)

(`accelerate launch --multi_gpu` is accelerate's torchrun launcher and works on CPU too; with `--cpu` and several
processes accelerate expects MPI and would start a single process.)

The loop is the one a trainer runs; the SP-specific lines are marked "SP:".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_gptoss_rl import (
    enable_sequence_parallel,
    get_sequence_parallel_group,
    sequence_parallel_logprobs,
    sequence_parallel_mesh,
)
from hf_gptoss_rl.harmony import encode_text
from hf_gptoss_rl.model_builders import tiny_gptoss_config

DATA = Path(__file__).resolve().parent.parent / "data" / "gsm8k_train_mini.jsonl"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence (the full sequence)")
    parser.add_argument("--sp-size", type=int, default=None, help="ranks per SP group (default: all ranks)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--attn", default="eager", help="inner attention (eager, or hf-gptoss-rl/sink-flash-attn3)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def init_distributed() -> torch.device:
    """torchrun and accelerate launch both export the env:// variables; a bare `python` run becomes a group of 1."""
    use_cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "false").lower() != "true"
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return torch.device("cpu")


def packed_rows(seq_len: int) -> list[dict[str, torch.Tensor]]:
    """GSM8K question+answer documents packed back to back into rows of `seq_len` tokens.

    position_ids restart at 0 at every document, so attention never crosses a document boundary and every
    document sees the positions it would see alone; the first token of a document is not a target.
    """
    ids, pos, is_start = [], [], []
    for line in DATA.read_text().splitlines():
        row = json.loads(line)
        doc = encode_text(f"Question: {row['question']}\nAnswer: {row['answer']}\n")[:seq_len]
        ids += doc
        pos += list(range(len(doc)))
        is_start += [True] + [False] * (len(doc) - 1)
    rows = []
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        window = slice(start, start + seq_len)
        p = torch.tensor(pos[window])
        p = p - p[0]  # a document cut by the row boundary restarts at 0 in this row
        rows.append(
            {
                "input_ids": torch.tensor(ids[window]).unsqueeze(0),
                "position_ids": p.unsqueeze(0),
                "target_mask": ~torch.tensor(is_start[window][1:]).unsqueeze(0),  # [1, S-1]
            }
        )
    return rows


def main():
    args = parse_args()
    device = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed)

    # SP: the group. All ranks form one SP group, or a dp x sp mesh (the layout FSDP2 + SP uses).
    sp_size = args.sp_size or world
    if sp_size == world:
        group, dp_rank, dp_size = get_sequence_parallel_group(None), 0, 1
    else:
        mesh = sequence_parallel_mesh(sp_size, device_type=device.type)
        group, dp_rank, dp_size = mesh.get_group("sp"), mesh["dp"].get_local_rank(), mesh["dp"].size()

    from transformers import GptOssForCausalLM

    config = tiny_gptoss_config(num_hidden_layers=args.layers)
    config._attn_implementation = args.attn
    model = GptOssForCausalLM(config).to(device)  # same seed on every rank -> identical replicas
    model.train()

    # SP: one call; attention becomes all-to-all -> inner attention on full sequence / own heads+sinks -> all-to-all.
    enable_sequence_parallel(model, group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    rows = packed_rows(args.seq_len)
    if rank == 0:
        print(
            f"world={world} sp={sp_size} dp={dp_size}  seq_len={args.seq_len} "
            f"({math.ceil(args.seq_len / sp_size)} tokens per rank)  attn=ulysses_sp({args.attn})  "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params  {len(rows)} packed rows",
            flush=True,
        )

    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        row = rows[(step * dp_size + dp_rank) % len(rows)]  # one row per dp rank, the same on its whole SP group
        batch = {k: v.to(device) for k, v in row.items()}
        # SP: shards the batch, runs the backbone on this rank's shard, gathers the per-token log-probs.
        logps = sequence_parallel_logprobs(model, batch, group)
        mask = batch["target_mask"].float()
        loss = -(logps * mask).sum() / mask.sum()  # identical on every rank of the group
        loss.backward()
        # SP: each rank holds its share of the gradient: sum over the SP group, mean over dp (FSDP2/DDP would do
        # the reduction themselves as a mean over all ranks: there, scale the loss by sp_size instead).
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dp_size
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(
                f"step {step}  loss {loss.item():.4f}  grad_norm {grad_norm.item():.3f}  "
                f"{time.perf_counter() - t0:.2f}s",
                flush=True,
            )
    if rank == 0:
        print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
