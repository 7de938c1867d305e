"""`AgenticGRPOConfig`: TRL's `GRPOConfig` plus the knobs of multi-turn, tool-calling GRPO on GPT-OSS."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

from trl import GRPOConfig

from hf_gptoss_rl.harmony import DEFAULT_REASONING_EFFORT, REASONING_EFFORTS

from .rollout import settings as rollout_defaults
from .weight_sync.settings import DEFAULT_SGLANG_VERIFY, PAUSE_MODES, SYNC_MODES, VERIFY_MODES, WeightSyncConfig

ROLLOUT_BACKENDS = ("embedded", "sglang")
WEIGHT_SYNC_PAUSE_MODES = tuple("none" if mode is None else mode for mode in PAUSE_MODES)  # "none" on the CLI
LOGPROBS_IMPLEMENTATIONS = ("auto", "chunked", "trl")


def _comma_list(value: str | list[str]) -> list[str]:
    """A list field given as ``"a,b"``, as ``["a", "b"]`` or as CLI arguments that contain commas (``--x a,b c``)."""
    entries = [value] if isinstance(value, str) else value
    return [item.strip() for entry in entries for item in entry.split(",") if item.strip()]


@dataclass
class AgenticGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`AgenticGRPOTrainer`]: every [`~trl.GRPOConfig`] field, plus the following.

    > Rollouts

        rollout_backend (`str`, defaults to `"embedded"`):
            `"embedded"`: an inference copy of the policy inside the training process (CPU, notebooks, small runs).
            `"sglang"`: one or more SGLang servers reached over their native HTTP API (`sglang_urls`).
        sglang_urls (`list[str]`, *optional*):
            Base URLs of the SGLang servers (e.g. `["http://localhost:30000"]`). Required with `rollout_backend="sglang"`.
        weight_sync_mode (`str`, defaults to `"disk"`):
            How trained weights reach SGLang after each optimizer step: `"disk"` (`/update_weights_from_disk`),
            `"distributed"` (NCCL broadcast, `/update_weights_from_distributed`) or `"tensor"` (CUDA IPC, same node).
            The embedded engine always copies tensors in memory.
        weight_sync_dir (`str`, *optional*):
            Folder the `"disk"` sync writes to (defaults to `<output_dir>/rollout_weights`). Must be visible to the
            SGLang server.
        weight_sync_lora (`bool`, defaults to `False`):
            With a PEFT policy, push only the LoRA adapter after each step (`/load_lora_adapter` with `"disk"`,
            `/load_lora_adapter_from_tensors` with `"tensor"`; requests then name it in `lora_path`) instead of the
            merged weights. The servers must run with `--enable-lora` and a `--max-lora-rank` /
            `--lora-target-modules` covering the adapter. `False`: merged weights (full fine-tuning, or any server).
        weight_sync_verify (`list[str]`, *optional*):
            Checks after every sync; a failure stops training with an error naming the server. Defaults to
            `["version", "checksum"]` with SGLang. `"version"` (every server reports the new `weight_version`; always
            on), `"checksum"` (SGLang's `/weights_checker`: every served parameter fed by a tensor that changed since
            the previous sync changed, and servers with the same parallelism agree), `"logprobs"` (the servers'
            log-probs of a short probe sequence match the trainer's; see `weight_sync_probe_margin`). Whatever this
            holds, every tensor name is checked against the names the servers load before anything is sent. See
            docs/rollouts.md for what each check proves and costs.
        weight_sync_checkpoint (`str`, *optional*):
            Where to read the tensor names the SGLang servers load (a local copy of the served checkpoint). Default:
            the `--model-path` of each server when readable from the trainer, else the servers' own parameter names.
        weight_sync_probe_atol (`float`, defaults to `0.05`), weight_sync_probe_rtol (`float`, defaults to `0.01`):
            The `"logprobs"` check never accepts a mean absolute log-prob difference above
            `atol + rtol * mean(|trainer log-prob|)` over the probe.
        weight_sync_probe_margin (`float`, defaults to `3.0`):
            The `"logprobs"` check's tolerance: this many times the difference measured at the first sync (two
            engines holding the same weights), within the bound above. A stale server is caught when one step moves
            the trainer's log-probs by more than that; with bf16 serving it usually does not (logged per sync).
        weight_sync_pause_mode (`str`, defaults to `"retract"`):
            `/pause_generation` mode around a sync: `"retract"` (running requests are recomputed with the new
            weights), `"abort"`, `"in_place"` (running requests finish on their old KV cache; the radix cache is
            flushed once they are done, and new requests wait for it) or `"none"`.
        weight_sync_master_address (`str`, defaults to `"127.0.0.1"`):
            `"distributed"` sync: the address of the trainer's main process that the SGLang servers connect to for
            the NCCL rendezvous. The default only works when the servers run on the same machine.
        weight_sync_master_port (`int`, *optional*):
            Port of that rendezvous (a free port by default).
        weight_sync_bucket_mb (`int`, defaults to `1024`):
            Most megabytes per NCCL broadcast (`"distributed"`) or per `/update_weights_from_tensor` call (`"tensor"`).
        sglang_api_key (`str`, *optional*):
            Bearer token for servers launched with `--api-key` (one key: with `--admin-api-key` as well, SGLang wants
            the admin key on the weight-update routes and the other one elsewhere).
            When unset, the trainer reads the `SGLANG_API_KEY` environment variable; prefer it: a key set here is
            saved and logged with the other training arguments.
        sglang_timeout_s (`float`, defaults to `600.0`):
            Overall deadline of one request to a server: connecting, waiting and reading the whole answer (a long
            generation must fit in it).
        sglang_retry_deadline_s (`float`, defaults to `120.0`):
            How long a failed request (connection refused, timeout, 5xx, malformed answer) keeps being retried, with
            exponential backoff, before its trajectory is aborted. Long enough to span a server restart.
        sglang_ready_timeout_s (`float`, defaults to `600.0`):
            How long the trainer waits at start-up for every server to answer `GET /health` (loading gpt-oss-120b
            takes minutes); past it, the trainer fails with each unreachable URL and the last error.
        sglang_log_every_s (`float`, defaults to `30.0`):
            Period of the log lines while waiting for servers and while rollout requests are in flight.
        max_turns (`int`, *optional*):
            Most assistant turns per trajectory (each tool call starts a new turn). Defaults to
            `max_tool_calling_iterations + 1` when TRL's `max_tool_calling_iterations` is set (N tool rounds, then one
            more turn to answer), else to `8`. Setting both to disagreeing values is an error.
        tool_timeout_s (`float`, defaults to `30.0`):
            Wall-clock limit of one tool call; a timed-out call returns an error message to the model.
        max_tool_output_chars (`int`, defaults to `4096`):
            Tool output longer than this is truncated before it is rendered back to the model.
        rollout_concurrency (`int`, defaults to `64`):
            Most trajectories generating at once per process.
        allow_stale_rollouts (`bool`, defaults to `False`):
            Every answer of the rollout engine says which weight version served it (SGLang's
            `meta_info.weight_version`, the embedded engine's own version); the trainer's version is the global step
            of its last weight sync (before the first one: the initial policy, which engines report as version 0 or
            without a version). A trajectory with a turn served on another version is stale: it was not sampled by
            the policy being trained (a server restarted or fell behind, a sync did not reach it). `False`: a batch
            with stale trajectories stops training with an error naming how many, the versions served and the one
            expected. `True`: they are trained on, counted in `rollout/stale_trajectories` and logged as a warning.
        reasoning_effort (`str`, defaults to `"medium"`):
            GPT-OSS reasoning effort written into the harmony system message (`"low"`, `"medium"`, `"high"`).
        developer_instructions (`str`, *optional*):
            Harmony developer message (instructions) put before the user turn.

    > Rollout/training mismatch

        The importance-sampling correction uses TRL's fields, which here apply to every rollout engine (the engine
        plays vLLM's part): `vllm_importance_sampling_correction` (default `True`), `vllm_importance_sampling_mode`
        (`"token_truncate"`, `"token_mask"`, `"sequence_truncate"`, `"sequence_mask"` (default), with TRL's
        semantics, plus `"sequence_geometric_mask"`: the geometric mean of the token ratios, 1 inside the bounds and 0
        outside), `vllm_importance_sampling_clip_min` / `vllm_importance_sampling_clip_max` (default `None` / `3.0`).
        The ratio is computed from the loss's own forward on-policy (see `trl_ext.mismatch`).

        mismatch_token_threshold (`float`, defaults to `0.1`):
            A token counts in `mismatch/frac_tokens_over_threshold` when `|p_rollout - p_train| > threshold`.
        routing_replay (`bool`, *optional*, defaults to `None`):
            Rollout routing replay (R3, arXiv 2510.11370) for GPT-OSS: the trainer's MoE layers use the experts the
            rollout engine chose for each token (gates recomputed from the trainer's router logits, so the router
            still learns; `hf_gptoss_rl.routing`), in the log-prob passes and the training forward. The embedded
            engine records routing always; SGLang servers do when launched with `--enable-return-routed-experts`
            and a MoE runner that records it (`--moe-runner-backend triton` or `marlin`). `None` (the default):
            replay whenever the engine returns routing; `True`: required, a server without it is an error at
            start-up; `False`: never replay. Whenever the engine returns routing, `routing/agreement` (the fraction
            of (token, layer) top-k sets where the trainer's own choice equals the rollout's) and
            `routing/agreement_min_layer` are logged. Against SGLang, replay cut k3 to 0.27-0.30 of its value in each of
            five rounds at 1.01x the generation time (`docs/results.md`, section 5), hence on by default where the
            routing is there.
        routing_mismatch_every (`int`, defaults to `0`):
            A diagnostic, off by default (`0`). With `N > 0`, whenever the engine returns routing, the loss batches
            of every N-th optimizer step (global steps 0, N, 2N, ...) are also scored with the other routing (the
            trainer's own when replaying, the engine's when not): one extra forward without gradient per
            micro-batch, before the loss forward. Those steps, and only those, log `routing/k3_kl_replayed`,
            `routing/k3_kl_own` and `routing/prob_diff_max_{replayed,own}` on the same tokens, so a run shows what
            replay changes, whichever mode it trains in. Cost on the steps that pay, measured on a 2-core CPU with a
            random 4-layer GPT-OSS (`python benchmarks/routing_mismatch_cost.py`, saved in
            `docs/benchmarks/routing_mismatch_cost.json`): the extra pass took 37% of the loss forward and backward
            it rides on and 14% of the whole step with generation. Rerun it on your device.

    > Model implementation

        attn_implementation (`str`, *optional*):
            Attention backend set on the policy before training, e.g. `"hf-gptoss-rl/sink-flash-attn3"` (the project's
            kernel) or `"eager"`: a model object is switched to it, a model id is loaded with it. `None` keeps the
            model's own choice. A keyword of the constructor, not a dataclass field: on the command line
            `--attn_implementation` belongs to TRL's `ModelConfig`, as in TRL's scripts (a parser over
            `(AgenticGRPOConfig, ModelConfig)` cannot hold the option twice), and reaches the model through
            `model_init_kwargs` or the example's model builder.
        experts_implementation (`str`, *optional*):
            Experts backend, e.g. `"memory_efficient"`. `None` keeps the model's own choice.
        sequence_parallel_size (`int`, defaults to `1`):
            Ulysses sequence-parallel degree: the loss forward splits every sequence over groups of this many
            consecutive ranks (`hf_gptoss_rl.sequence_parallel`). DDP only, on-policy, `beta=0`.
        logprobs_implementation (`str`, defaults to `"auto"`):
            How the loss gets per-token log-probs without full-vocabulary float logits: `"chunked"`
            (`hf_gptoss_rl.logprobs`: only completion positions are scored, `logprobs_chunk_size` tokens at a time),
            `"trl"` (TRL's fused LM head, Triton on GPUs) or `"auto"` (`"chunked"`). With a frozen head (LoRA) and no
            entropy bonus, `"chunked"` computes the hidden states' gradient in the forward: two passes over the
            vocabulary per step instead of the three of a head that recomputes its logits in the backward, as TRL's
            does (`trl/kernels/chunked_logprob.py`); with `entropy_coef` or adaptive entropy it recomputes as TRL does.
        logprobs_chunk_size (`int`, defaults to `512`):
            Tokens per `[chunk, vocab]` float32 tile of the `"chunked"` implementation (201,088 × 512 × 4 B = 412 MB).
        checkpoint_saves (`list[str]`, defaults to `["attention", "experts", "projections"]`):
            Selective activation checkpointing (`hf_gptoss_rl.checkpointing`; only with `gradient_checkpointing=True`,
            TRL's default): ops whose outputs are kept instead of recomputed in the backward. `"attention"` (the sink
            kernel; ~0.26 GiB per layer at 32k tokens for gpt-oss-20b), `"experts"` (the `memory_efficient`
            experts; ~1.6 GiB per layer at 32k, bounded by `checkpoint_experts_max_tokens`) and `"projections"` (the
            q/k/v/o projections and the router of a GPT-OSS policy; ~0.49 GiB per layer at 32k, bounded by
            `checkpoint_projections_max_tokens`). Gradients are bitwise those of plain checkpointing (with
            deterministic kernels: on Hopper the attention backward of full layers from 2k keys adds dQ with atomics
            unless `FLASH_ATTENTION_DETERMINISTIC=1` or `full_determinism=True`); attention and
            experts ops of other implementations (eager, sdpa, `grouped_mm`, ...) are not matched, so for them it is
            plain checkpointing. The speed and memory of the default and of `[]` on the trainer's 32k gpt-oss-20b
            LoRA step are in `docs/benchmarks/trainer_step.md`. `[]`: plain checkpointing.
        checkpoint_experts_max_tokens (`int`, *optional*):
            `"experts"` keeps the experts outputs of micro-batches of at most this many tokens; longer ones recompute
            them (the kept outputs grow with the tokens: ~1.24 MB per token for gpt-oss-20b, 76 GiB at 64k). `None`
            (default): where memory allows, i.e. the kept experts outputs (and projections, when kept) take at most
            half of the GPU memory that the weights on it leave (the policy's, a reference model's, the embedded
            engine's copy; `hf_gptoss_rl.checkpointing.experts_max_tokens_for_model`: ~33k tokens for gpt-oss-20b in
            bf16 alone on a 140 GiB GPU with the projections kept, ~43k without), no bound off CUDA. `-1`: no bound.
        checkpoint_projections_max_tokens (`int`, *optional*):
            The same bound for `"projections"` (~0.39 MB per token for gpt-oss-20b). `None` (default): where the kept
            projections take at most half of the GPU memory that the weights leave (~140k tokens for gpt-oss-20b on a
            140 GiB GPU, ~57k on an 80 GiB one), no bound off CUDA. `-1`: no bound.
        liger_rms_norm (`bool`, *optional*):
            Replace GPT-OSS's RMSNorms by Liger-Kernel's Triton RMSNorm with GPT-OSS's own rounding
            (`hf_gptoss_rl.fused_layers`; CUDA, needs `liger-kernel`). Prefer it to `use_liger_kernel=True`, whose
            RMSNorm rounds to bf16 before the weight multiply (GPT-OSS and the rollout engines do not). `None`
            (default): on for a GPT-OSS policy on CUDA when `liger-kernel` is installed, else off (CPU, no Liger,
            other models: transformers' RMSNorm). `True` without CUDA or Liger is an error.
        fused_rope (`bool`, *optional*):
            Apply GPT-OSS's rotary embedding with one Triton kernel each way (`hf_gptoss_rl.fused_layers`; fp32 math
            rounded once, no copy before the attention call) instead of seven bf16 elementwise passes. Swaps the
            GPT-OSS modeling module's `apply_rotary_pos_emb` for a dispatcher that keeps the original for CPU tensors.
            `None` (default): on for a GPT-OSS policy on CUDA when Triton imports, else off (transformers' RoPE).
        padding_free (`bool`, *optional*):
            Pack the trajectories of each log-prob forward (the loss, the old and reference passes) into one row
            without padding: `position_ids` restart at 0 for every trajectory, and transformers derives the sequence
            boundaries from them (varlen `cu_seqlens` for flash-style kernels, the sink kernel included; a
            block-diagonal mask for eager, sdpa and flex_attention). Attention, experts and the LM head then cost
            nothing for padding; the log-probs are scattered back to TRL's `[B, T]` layout, so the loss is TRL's.
            `None` (default): on for GPT-OSS with one of those attention implementations and
            `sequence_parallel_size=1`; `True` elsewhere is an error naming the reason. A micro-batch whose
            attention mask has a hole inside a trajectory runs padded (with a warning).
        fuse_lora_update (`bool`, *optional*, defaults to `True`):
            For a PEFT LoRA policy: run each LoRA layer as one autograd function of two products,
            `y = addmm(addmm(bias, x A^T, B^T, alpha=scaling), x, W^T)`, with the input gradient
            `g W + scaling (g B) A` as one product, instead of PEFT's `base(x) + lora_B(lora_A(x)) * scaling`
            (three passes over the layer's output fewer in the forward and the recompute, two in the backward;
            rounded fewer times, so results are not bitwise PEFT's). Layers with one active vanilla adapter over a
            plain `nn.Linear` (`hf_gptoss_rl.lora.fuse_lora_update`); others, and `False`, run PEFT's forward.
    """

    rollout_backend: str = field(
        default="embedded", metadata={"help": "Rollout engine: 'embedded' (in-process) or 'sglang' (HTTP)."}
    )
    sglang_urls: list[str] | None = field(
        default=None, metadata={"help": "Base URLs of the SGLang servers (rollout_backend='sglang')."}
    )
    # The defaults of the fields that configure a component are that component's own (`WeightSyncConfig`,
    # `trl_ext.rollout.settings`); `trl_ext.trainer_args` builds the components from these fields.
    weight_sync_mode: str = field(
        default=WeightSyncConfig.mode, metadata={"help": "SGLang weight sync: 'disk', 'distributed' or 'tensor'."}
    )
    weight_sync_dir: str | None = field(
        default=None, metadata={"help": "Folder for 'disk' weight sync (default <output_dir>/rollout_weights)."}
    )
    weight_sync_lora: bool = field(
        default=False, metadata={"help": "Push only the PEFT adapter to SGLang (servers need --enable-lora)."}
    )
    weight_sync_verify: list[str] | None = field(
        default=None,
        metadata={"help": "Checks after each sync: version, checksum, logprobs (SGLang default: version,checksum)."},
    )
    weight_sync_checkpoint: str | None = field(
        default=WeightSyncConfig.checkpoint_path,
        metadata={"help": "Local copy of the served checkpoint: the tensor names the servers load."},
    )
    weight_sync_probe_atol: float = field(
        default=WeightSyncConfig.probe_atol,
        metadata={"help": "'logprobs' check: absolute part of the mean |log-prob difference| allowed."},
    )
    weight_sync_probe_rtol: float = field(
        default=WeightSyncConfig.probe_rtol,
        metadata={"help": "'logprobs' check: relative part (times the mean |trainer log-prob| of the probe)."},
    )
    weight_sync_probe_margin: float = field(
        default=WeightSyncConfig.probe_margin,
        metadata={"help": "'logprobs' check: tolerance = margin x the difference at the first sync."},
    )
    weight_sync_pause_mode: str = field(
        default=WeightSyncConfig.pause_mode or "none",
        metadata={"help": "Pause mode around syncs: retract, abort, in_place or none."},
    )
    weight_sync_master_address: str = field(
        default=WeightSyncConfig.dist_master_address,
        metadata={"help": "'distributed' sync: trainer address the servers connect to."},
    )
    weight_sync_master_port: int | None = field(
        default=WeightSyncConfig.dist_master_port,
        metadata={"help": "'distributed' sync: rendezvous port (a free one by default)."},
    )
    weight_sync_bucket_mb: int = field(
        default=WeightSyncConfig.bucket_bytes >> 20, metadata={"help": "Most MB per broadcast / tensor call."}
    )
    sglang_api_key: str | None = field(
        default=None, metadata={"help": "Bearer token of the SGLang servers (default: $SGLANG_API_KEY)."}
    )
    sglang_timeout_s: float = field(
        default=rollout_defaults.SGLANG_TIMEOUT_S, metadata={"help": "Overall deadline of one SGLang request."}
    )
    sglang_retry_deadline_s: float = field(
        default=rollout_defaults.SGLANG_RETRY_DEADLINE_S,
        metadata={"help": "How long failed SGLang requests are retried (spans a restart)."},
    )
    sglang_ready_timeout_s: float = field(
        default=rollout_defaults.SGLANG_READY_TIMEOUT_S,
        metadata={"help": "Start-up wait for every SGLang server to answer /health."},
    )
    sglang_log_every_s: float = field(
        default=rollout_defaults.SGLANG_LOG_EVERY_S,
        metadata={"help": "Period of log lines while waiting for SGLang servers / requests."},
    )
    max_turns: int | None = field(
        default=None,
        metadata={"help": "Most assistant turns per trajectory (default: max_tool_calling_iterations + 1, else 8)."},
    )
    tool_timeout_s: float = field(
        default=rollout_defaults.TOOL_TIMEOUT_S, metadata={"help": "Wall-clock limit of one tool call (seconds)."}
    )
    max_tool_output_chars: int = field(
        default=rollout_defaults.MAX_TOOL_OUTPUT_CHARS, metadata={"help": "Tool output truncation length."}
    )
    rollout_concurrency: int = field(
        default=rollout_defaults.MAX_CONCURRENCY, metadata={"help": "Concurrent trajectories per process."}
    )
    allow_stale_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Train on trajectories served on a weight version other than the last sync's (counted in "
            "rollout/stale_trajectories) instead of stopping with an error."
        },
    )
    reasoning_effort: str = field(
        default=DEFAULT_REASONING_EFFORT, metadata={"help": "Harmony reasoning effort: low|medium|high."}
    )
    developer_instructions: str | None = field(default=None, metadata={"help": "Harmony developer instructions."})
    mismatch_token_threshold: float = field(
        default=0.1, metadata={"help": "|p_rollout - p_train| threshold of mismatch/frac_tokens_over_threshold."}
    )
    routing_replay: bool | None = field(
        default=None,
        metadata={
            "help": "Replay the rollout engine's MoE routing in the trainer's forwards (GPT-OSS; R3). None (auto): "
            "whenever the engine returns routing; True: required (checked at start-up); False: never."
        },
    )
    routing_mismatch_every: int = field(
        default=0,
        metadata={
            "help": "Every N-th optimizer step (0: never), score the loss batches also with the other routing (one "
            "extra forward without gradient per micro-batch) and log routing/k3_kl_{replayed,own}."
        },
    )
    # not a field (no flag): `--attn_implementation` is `trl.ModelConfig`'s; see the constructor keyword below
    attn_implementation = None
    experts_implementation: str | None = field(default=None, metadata={"help": "Experts backend of the policy."})
    sequence_parallel_size: int = field(default=1, metadata={"help": "Ulysses sequence-parallel degree."})
    logprobs_implementation: str = field(default="auto", metadata={"help": "auto | chunked | trl."})
    logprobs_chunk_size: int = field(default=512, metadata={"help": "Tokens per tile of the chunked log-probs."})
    checkpoint_saves: list[str] = field(
        default_factory=lambda: ["attention", "experts", "projections"],
        metadata={
            "help": "Ops kept under gradient checkpointing: attention, experts, projections ([] for plain "
            "checkpointing)."
        },
    )
    checkpoint_experts_max_tokens: int | None = field(
        default=None,
        metadata={"help": "Most tokens per micro-batch whose experts outputs are kept. Default: where memory allows."},
    )
    checkpoint_projections_max_tokens: int | None = field(
        default=None,
        metadata={"help": "Most tokens per micro-batch whose projections are kept. Default: where memory allows."},
    )
    liger_rms_norm: bool | None = field(
        default=None,
        metadata={"help": "Liger's RMSNorm with GPT-OSS rounding (CUDA). Default: on with CUDA + liger-kernel."},
    )
    fused_rope: bool | None = field(
        default=None, metadata={"help": "GPT-OSS RoPE in one Triton kernel (CUDA). Default: on with CUDA + Triton."}
    )
    padding_free: bool | None = field(
        default=None,
        metadata={"help": "Pack each micro-batch into one row without padding. Default: on where supported."},
    )
    fuse_lora_update: bool = field(
        default=True,
        metadata={"help": "Run LoRA layers as one autograd function of two products instead of PEFT's forward."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}, got {self.rollout_backend!r}.")
        if self.sglang_urls is not None:
            self.sglang_urls = _comma_list(self.sglang_urls)
        if self.rollout_backend == "sglang" and not self.sglang_urls:
            raise ValueError("rollout_backend='sglang' needs sglang_urls (e.g. ['http://localhost:30000']).")
        if self.rollout_backend == "embedded" and self.sglang_urls:
            raise ValueError("sglang_urls is set but rollout_backend='embedded'; set rollout_backend='sglang'.")
        if self.routing_mismatch_every < 0:
            raise ValueError(
                f"routing_mismatch_every must be >= 0 (0: never; N: every N-th optimizer step), got "
                f"{self.routing_mismatch_every}."
            )
        if self.weight_sync_mode not in SYNC_MODES:
            raise ValueError(f"weight_sync_mode must be one of {SYNC_MODES}, got {self.weight_sync_mode!r}.")
        if self.weight_sync_verify is None:
            self.weight_sync_verify = list(DEFAULT_SGLANG_VERIFY if self.rollout_backend == "sglang" else ("version",))
        self.weight_sync_verify = _comma_list(self.weight_sync_verify)
        unknown = set(self.weight_sync_verify) - set(VERIFY_MODES)
        if unknown:
            raise ValueError(f"weight_sync_verify: unknown checks {sorted(unknown)}; choose from {VERIFY_MODES}.")
        if "version" not in self.weight_sync_verify:
            self.weight_sync_verify = ["version", *self.weight_sync_verify]  # documented as always on
        if self.weight_sync_pause_mode not in WEIGHT_SYNC_PAUSE_MODES:
            raise ValueError(
                f"weight_sync_pause_mode must be one of {WEIGHT_SYNC_PAUSE_MODES}, got {self.weight_sync_pause_mode!r}."
            )
        if self.rollout_backend == "embedded" and (self.weight_sync_lora or self.weight_sync_verify != ["version"]):
            raise ValueError(
                "weight_sync_lora and weight_sync_verify apply to rollout_backend='sglang'; the embedded engine loads "
                "the merged weights by name (an unknown name or shape is an error there)."
            )
        if self.weight_sync_lora and self.weight_sync_mode == "distributed":
            raise ValueError(
                "weight_sync_lora needs weight_sync_mode 'disk' or 'tensor': SGLang loads adapters from a path or from "
                "tensors, not over NCCL."
            )
        if not self.weight_sync_probe_rtol >= 0:
            raise ValueError(f"weight_sync_probe_rtol must be >= 0, got {self.weight_sync_probe_rtol}.")
        for name in (
            "weight_sync_probe_atol",
            "weight_sync_probe_margin",
            "weight_sync_bucket_mb",
            "sglang_timeout_s",
            "sglang_ready_timeout_s",
            "sglang_log_every_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        if self.sglang_retry_deadline_s < 0:
            raise ValueError(f"sglang_retry_deadline_s must be >= 0, got {self.sglang_retry_deadline_s}.")
        self._resolve_max_turns()
        if self.tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s}.")
        if self.max_tool_output_chars < 1:
            raise ValueError(f"max_tool_output_chars must be >= 1, got {self.max_tool_output_chars}.")
        if self.rollout_concurrency < 1:
            raise ValueError(f"rollout_concurrency must be >= 1, got {self.rollout_concurrency}.")
        if not isinstance(self.allow_stale_rollouts, bool):
            raise ValueError(f"allow_stale_rollouts must be True or False, got {self.allow_stale_rollouts!r}.")
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {self.reasoning_effort!r}.")
        self._check_importance_sampling()
        if self.mismatch_token_threshold <= 0:
            raise ValueError(f"mismatch_token_threshold must be > 0, got {self.mismatch_token_threshold}.")
        if self.sequence_parallel_size < 1:
            raise ValueError(f"sequence_parallel_size must be >= 1, got {self.sequence_parallel_size}.")
        if self.logprobs_implementation not in LOGPROBS_IMPLEMENTATIONS:
            raise ValueError(
                f"logprobs_implementation must be one of {LOGPROBS_IMPLEMENTATIONS}, got {self.logprobs_implementation!r}."
            )
        if self.logprobs_chunk_size < 1:
            raise ValueError(f"logprobs_chunk_size must be >= 1, got {self.logprobs_chunk_size}.")
        from hf_gptoss_rl.checkpointing import parse_checkpoint_saves

        try:  # the CLI may pass "attention,experts"
            self.checkpoint_saves = parse_checkpoint_saves(self.checkpoint_saves)
        except ValueError as e:
            raise ValueError(f"checkpoint_saves: {e}") from None
        for name in ("checkpoint_experts_max_tokens", "checkpoint_projections_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be None (where memory allows), -1 (no bound) or >= 0, got {value}.")
        if (
            self.checkpoint_saves
            and self.gradient_checkpointing
            and (self.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        ):
            raise ValueError(
                "checkpoint_saves needs non-reentrant checkpointing: unset use_reentrant, or set checkpoint_saves=[] "
                "for plain reentrant checkpointing."
            )
        if self.padding_free and self.sequence_parallel_size > 1:
            raise ValueError(
                "padding_free=True and sequence_parallel_size > 1: the sequence-parallel loss forward shards padded "
                "rows; unset padding_free (it then stays off)."
            )
        if self.use_vllm:
            raise ValueError(
                "AgenticGRPOTrainer generates with its own rollout engine (rollout_backend); set use_vllm=False."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "use_transformers_continuous_batching selects TRL's own transformers generation, which "
                "AgenticGRPOTrainer does not use: rollouts run on its rollout engine. The embedded engine already "
                "batches concurrent trajectories (rollout_concurrency); for large runs use rollout_backend='sglang'. "
                "Set use_transformers_continuous_batching=False."
            )
        if self.cache_implementation is not None:
            raise ValueError(
                "cache_implementation configures TRL's transformers generation, which AgenticGRPOTrainer does not use: "
                "the embedded engine decodes with a DynamicCache and SGLang manages its own cache. Unset it."
            )
        if self.max_completion_length is None:
            raise ValueError("max_completion_length must be set: it is the token budget of a whole trajectory.")
        from .rollout.types import sampling_params_from_config

        sampling_params_from_config(self)  # checks min_p, repetition_penalty and generation_kwargs (clear errors)

    def _resolve_max_turns(self) -> None:
        """`max_turns` from TRL's `max_tool_calling_iterations` (N tool rounds = N + 1 assistant turns)."""
        iterations = self.max_tool_calling_iterations
        if iterations is not None and iterations < 0:
            raise ValueError(f"max_tool_calling_iterations must be >= 0, got {iterations}.")
        if self.max_turns is None:
            self.max_turns = rollout_defaults.MAX_TURNS if iterations is None else iterations + 1
        elif iterations is not None and self.max_turns != iterations + 1:
            raise ValueError(
                f"max_turns={self.max_turns} and max_tool_calling_iterations={iterations} disagree: N tool-calling "
                f"iterations allow N + 1 assistant turns ({iterations + 1}). Set only one of them."
            )
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}.")

    def _check_importance_sampling(self) -> None:
        from .mismatch import IMPORTANCE_SAMPLING_MODES

        mode = self.vllm_importance_sampling_mode
        if mode not in IMPORTANCE_SAMPLING_MODES:
            hint = " (TRL calls truncated IS 'token_truncate')" if mode in ("token_tis", "tis") else ""
            raise ValueError(
                f"vllm_importance_sampling_mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}{hint}."
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low < 0:
            raise ValueError(f"vllm_importance_sampling_clip_min must be >= 0, got {low}.")
        if high is not None and high <= 0:
            raise ValueError(f"vllm_importance_sampling_clip_max must be > 0, got {high}.")
        if (
            self.vllm_importance_sampling_correction
            and self.loss_type == "vespo"
            and mode not in ("token_truncate", "token_mask")
        ):  # TRL's rule (GRPOTrainer.__init__): VESPO takes token-level ratios
            raise ValueError(
                f"VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
                f"Got: {mode}."
            )

    @property
    def is_on_policy(self) -> bool:
        """True when each generation batch is consumed by exactly one optimizer step (no stale policy)."""
        generate_every = self.steps_per_generation * self.num_iterations
        return self.num_iterations == 1 and self.gradient_accumulation_steps % generate_every == 0


def _accept_attn_implementation(init):
    """`AgenticGRPOConfig(..., attn_implementation=...)` as before it moved to `ModelConfig` on the command line: the
    keyword is taken by the constructor and kept as an attribute (set before `__post_init__` runs), without being a
    dataclass field that `HfArgumentParser` would turn into a second `--attn_implementation`."""

    @functools.wraps(init)
    def __init__(self, *args, attn_implementation: str | None = None, **kwargs):
        if attn_implementation is not None and not isinstance(attn_implementation, str):
            raise TypeError(f"attn_implementation must be a string or None, got {type(attn_implementation).__name__}")
        self.attn_implementation = attn_implementation
        init(self, *args, **kwargs)

    signature = inspect.signature(init)
    keyword = inspect.Parameter("attn_implementation", inspect.Parameter.KEYWORD_ONLY, default=None)
    __init__.__signature__ = signature.replace(parameters=[*signature.parameters.values(), keyword])
    return __init__


AgenticGRPOConfig.__init__ = _accept_attn_implementation(AgenticGRPOConfig.__init__)
