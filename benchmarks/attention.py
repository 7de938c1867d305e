"""Sink attention as users run it: this repo's kernel through its public API and through transformers, against
FlashAttention-4 (``learnable_sink``) in the same process, GPT-OSS shapes (B=1, 64 query / 8 KV heads, head_dim 64,
bf16, forward + backward with the gradients of q, k, v and the sinks).

Sections (the report says how each is measured): the kernel's ``flash_attn_func`` (and ``flash_attn_varlen_func``)
against the raw kernels called directly, the raw kernels in a bare ``torch.autograd.Function`` and FA4, per call and
per layer of a stack of layers with one backward; one ``GptOssAttention`` layer of transformers with this kernel's hub
id, ``flash_attention_4`` and ``flex_attention`` (causal, window 128, packed ragged sequences, ``deterministic=True``);
a mixed workload; accuracy against fp64.

    python benchmarks/attention.py [--out DIR]        # writes DIR/attention.md, attention.json, attention.png
    python benchmarks/attention.py --from-json docs/benchmarks/attention.json --out DIR   # re-render only

The exit status is non-zero when a row or an accuracy case failed, or (on a GPU) a target is not met. Timings are
medians of ``triton.testing.do_bench`` samples (ms), the implementations of a row timed in interleaved rounds
(``bench_interleaved``). ``--device cpu`` runs the same code on tiny shapes (a smoke test; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

if not __package__:  # run as `python benchmarks/<name>.py`: benchmarks/_bootstrap.py makes `benchmarks` importable
    import _bootstrap  # noqa: F401
from benchmarks._cli import (
    OUT_HELP,
    RATIO_RULE,
    command_line,
    environment,
    exit_if_failed,
    figure,
    grouped_bars,
    md_table,
    output_dir,
    ratio,
    rel_error,
    without_local_paths,
)
from hf_gptoss_rl.attention import import_kernel_sources as load_kernel
from hf_gptoss_rl.attention_variants import setup_project_attention

IMPL_OURS = "sink-flash-attn3"
IMPL_FA4 = "FA4 + learnable_sink"
FA4_LAYER = "FA4 (flash_attention_4)"

DEVICE = "cuda"
DTYPE = torch.bfloat16
HEADS = (64, 8)
HEAD_DIM = 64


def load_fa4():
    """(FA4's ``flash_attn_func``, None), or (None, why it is not in this run)."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: PLC0415
    except ImportError as exc:
        why = f"flash_attn.cute not importable ({exc}); install flash-attn-4"
        print(f"[fa4] {why}: FA4 rows are left out")
        return None, why
    return flash_attn_func, None


def window_size(window):
    """GPT-OSS sliding window W: the token and the W - 1 before it (FlashAttention's (left, right) convention)."""
    return (-1, -1) if window is None else (window - 1, 0)


def make_inputs(S, seed=0, sink_scale=1.0, dtype=None):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hq, hkv = HEADS

    def rand(heads):
        return torch.randn(1, S, heads, HEAD_DIM, device=DEVICE, generator=g).to(dtype or DTYPE)

    q, k, v, dout = rand(hq), rand(hkv), rand(hkv), rand(hq)
    return q, k, v, dout, torch.randn(hq, device=DEVICE, generator=g) * sink_scale


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def tokens_major(inputs):
    """(q, k, v, dout, sinks) with the batch-1 tensors as the raw kernels' ``[S, heads, head_dim]``."""
    return tuple(t[0] if t.dim() == 4 else t for t in inputs)


def error_text(exc, limit=300):
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


# ----------------------------------------------------------------------------------------------------------------
# the timed steps: each returns a closure running the forward + backward of a stack of layers (one set of inputs per
# layer; a stack of one is a single call)
# ----------------------------------------------------------------------------------------------------------------
def fa4_call(fa4, q, k, v, sinks, window):
    left = None if window is None else window - 1
    out = fa4(q, k, v, causal=True, window_size=(left, None if window is None else 0), learnable_sink=sinks)
    return out[0] if isinstance(out, tuple) else out


def public_step(kernel, window, stack, deterministic=False, fa4=None):
    """The forward of every layer of ``stack``, then one backward through all of them (``torch.autograd.grad`` over
    every output): autograd's device thread runs the layers' backwards in one go, as in a model's backward pass,
    instead of one hand-off per call. ``fa4``: FA4's function instead of this kernel's ``flash_attn_func``."""
    layers = [(*leaves(q, k, v, sinks), dout) for q, k, v, dout, sinks in stack]

    def call(q, k, v, sinks):
        if fa4 is not None:
            return fa4_call(fa4, q, k, v, sinks, window)
        return kernel.flash_attn_func(
            q, k, v, causal=True, window_size=window_size(window), s_aux=sinks, deterministic=deterministic
        )

    def step():
        outs = [call(q, k, v, sinks) for q, k, v, sinks, _ in layers]
        inputs = [t for q, k, v, sinks, _ in layers for t in (q, k, v, sinks)]
        return torch.autograd.grad(outs, inputs, [dout for *_, dout in layers])

    return step


def varlen_step(kernel, window, inputs, pieces=4):
    """The same tokens as ``pieces`` packed sequences of equal length (what a packed RL batch sends)."""
    q, k, v, dout, sinks = tokens_major(inputs)
    q, k, v, sinks = leaves(q, k, v, sinks)
    S = q.shape[0]
    cu = torch.arange(0, S + 1, S // pieces, device=DEVICE, dtype=torch.int32)

    def step():
        out = kernel.flash_attn_varlen_func(
            q, k, v, cu, cu, S // pieces, S // pieces, causal=True, window_size=window_size(window), s_aux=sinks
        )
        return torch.autograd.grad(out, (q, k, v, sinks), dout)

    return step


def raw_args(kernel, window, S):
    """The raw kernels' module and their arguments besides the tensors: (module, cu_seqlens, left, right, scale)."""
    tk = kernel.interface._backend_module("triton" if DEVICE == "cuda" else "torch")
    cu = torch.tensor([0, S], device=DEVICE, dtype=torch.int32)
    return (tk, cu, *window_size(window), HEAD_DIM**-0.5)


def raw_step(kernel, window, stack):
    """The raw kernels in the order a model runs them: every layer's forward, then the backwards in reverse."""
    layers = [tokens_major(inputs) for inputs in stack]
    S = layers[0][0].shape[0]
    tk, cu, wl, wr, scale = raw_args(kernel, window, S)

    def step():
        saved = [
            tk.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, scale, True, wl, wr) for q, k, v, _, sinks in layers
        ]
        return [
            tk.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, scale, True, wl, wr)
            for (q, k, v, dout, sinks), (out, lse) in reversed(list(zip(layers, saved)))
        ]

    return step


class _RawInAutograd(torch.autograd.Function):
    """The raw kernels in the smallest ``torch.autograd.Function``: one output, the tensors the backward reads saved,
    nothing checked or re-laid out (``bare_step``)."""

    @staticmethod
    def forward(ctx, tk, q, k, v, sinks, cu, S, scale, wl, wr):
        out, lse = tk.sink_attention_forward(q, k, v, sinks, cu, cu, S, S, scale, True, wl, wr)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (tk, cu, S, scale, wl, wr)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        tk, cu, S, scale, wl, wr = ctx.args
        grads = tk.sink_attention_backward(dout, q, k, v, out, lse, sinks, cu, cu, S, S, scale, True, wl, wr)
        return None, *grads, None, None, None, None, None


def bare_step(kernel, window, stack):
    """``public_step`` through ``_RawInAutograd``: the floor of any autograd API around the raw kernels."""
    tk, cu, wl, wr, scale = raw_args(kernel, window, stack[0][0].shape[-3])
    layers = [(leaves(q, k, v, sinks), dout) for q, k, v, dout, sinks in map(tokens_major, stack)]

    def step():
        outs = [_RawInAutograd.apply(tk, *leaf, cu, leaf[0].shape[0], scale, wl, wr) for leaf, _ in layers]
        return torch.autograd.grad(outs, [t for leaf, _ in layers for t in leaf], [dout for _, dout in layers])

    return step


def bench(fn, rep=150):
    if DEVICE != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton  # noqa: PLC0415

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


ROUNDS = 3  # interleaved rounds per comparison
MIN_CALLS = 10  # timed calls per implementation and round, however long a call takes


def bench_interleaved(steps, rounds=ROUNDS, min_calls=MIN_CALLS, rep=150):
    """Times the implementations in ``steps`` ({key: fn}) side by side: ``rounds`` rounds, each timing every
    implementation once (a drift of clocks or temperature during the comparison reaches every column alike), each
    time for ``rep`` ms or ``min_calls`` calls, whichever is longer (``do_bench`` alone takes 2 samples of a 66 ms
    call).  Returns ({key: median ms over every sample}, {key: error}); an implementation that raises is an error
    entry and leaves the later rounds."""
    samples = {key: [] for key in steps}
    errors = {}
    for _ in range(rounds if DEVICE == "cuda" else 1):
        for key, fn in steps.items():
            if key in errors:
                continue
            try:
                if DEVICE != "cuda":
                    samples[key].append(bench(fn))
                    continue
                import triton  # noqa: PLC0415

                taken = samples[key]
                call_ms = statistics.median_high(taken) if taken else 0.0
                taken += triton.testing.do_bench(fn, warmup=25, rep=max(rep, min_calls * call_ms), return_mode="all")
            except Exception as exc:  # noqa: BLE001 - a failing implementation is a table entry, not a crash
                errors[key] = error_text(exc)
    medians = {key: (statistics.median_high(v) if v and key not in errors else None) for key, v in samples.items()}
    return medians, errors


def host_time(fn, calls=20, repeats=3):
    """The host's time to issue one call of ``fn`` (ms): ``calls`` calls without waiting for the GPU, best of
    ``repeats``.  Where it reaches the GPU time, a ``do_bench`` row times the host rather than the kernels."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return best * 1e3


def seq_name(S):
    return f"S={S // 1024}k" if S % 1024 == 0 else f"S={S}"


def case_name(S, window):
    return f"{seq_name(S)} " + ("causal" if window is None else f"window {window}")


def parse_shapes(spec):
    """``S`` (causal) or ``S/window``, comma-separated."""
    return [(int(S), int(w) if w else None) for S, _, w in (item.partition("/") for item in spec.split(",") if item)]


def time_rows(kernel, fa4, shapes, layers=None):
    """Per call (``layers`` None) or per layer of a stack of ``layers`` calls with one backward: what a layer costs
    inside a model, where the per-call rows also time autograd's hand-off of every single backward. Each row holds
    the interleaved medians and the host time per call of the public path and FA4's, divided by the layers."""
    rows = []
    for S, window in shapes:
        row = dict(case=case_name(S, window), S=S, window=window)
        if layers is None:
            stack = [make_inputs(S, seed=S + (window or 0))]
        else:
            stack = [make_inputs(S, seed=1000 * S + i) for i in range(layers)]
            row["layers"] = layers
        steps = {
            "public_ms": public_step(kernel, window, stack),
            "raw_ms": raw_step(kernel, window, stack),
            "autograd_ms": bare_step(kernel, window, stack),
        }
        if layers is None and S >= 4096 and S % 4096 == 0:
            steps["varlen_ms"] = varlen_step(kernel, window, stack[0])
        if layers is None and window is None:  # full layers: deterministic=False runs the one-kernel backward there
            steps["deterministic_ms"] = public_step(kernel, window, stack, deterministic=True)
        if fa4 is not None:
            steps["fa4_ms"] = public_step(kernel, window, stack, fa4=fa4)
        per = layers or 1
        medians, errors = bench_interleaved(steps)
        row.update({key: None if ms is None else ms / per for key, ms in medians.items()})
        if errors:
            row["errors"] = errors
        for key in ("public_ms", "fa4_ms"):
            if row.get(key) is not None:
                row[key.replace("_ms", "_host_ms")] = host_time(steps[key], calls=max(3, 20 // per)) / per
        rows.append(row)
        print("[time]" if layers is None else "[stack]", json.dumps(row), flush=True)
        del stack, steps
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# mixed workload: is the public path as fast after other shapes and dtypes as when it ran first?
# ----------------------------------------------------------------------------------------------------------------
def mixed_workload(kernel, S):
    """Runs fp16 and fp32 fwd+bwd, packed varlen fwd+bwd and KV-cache decode steps through the public API."""
    q, k, v, dout, sinks = make_inputs(S, seed=7, dtype=torch.float16)
    public_step(kernel, None, [(q, k, v, dout, sinks)])()
    public_step(kernel, 128, [(q, k, v, dout, sinks)])()
    lens = [S // 2 - 3, S // 4 + 1, S // 4 + 2]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    qv, kv, vv, sv = leaves(*(t[0, : sum(lens)].bfloat16() for t in (q, k, v)), sinks)
    out = kernel.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=True, s_aux=sv)
    torch.autograd.grad(out.float().square().sum(), (qv, kv, vv, sv))
    with torch.no_grad():  # decode: one query per sequence against its KV cache
        kcache, vcache = k.bfloat16(), v.bfloat16()
        for step in range(8):
            query = q[:, -1 - step :][:, :1].bfloat16()
            window = window_size(128 if step % 2 else None)
            kernel.flash_attn_func(query, kcache, vcache, causal=True, s_aux=sinks, window_size=window)
    public_step(kernel, None, [make_inputs(256, seed=8, dtype=torch.float32)])()
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# accuracy against fp64
# ----------------------------------------------------------------------------------------------------------------
def reference_fp64(kernel, q, k, v, sinks, dout, window):
    """Exact sink attention and its gradients in fp64 for ``q [S, Hq, D]``, ``k, v [S, Hkv, D]`` (causal, optional
    sliding window): the kernel's PyTorch path (``reference.py``, tested against an eager fp64 reference) on fp64
    inputs, which it computes in fp64 throughout, a chunk of queries at a time, so that 16k x 16k fits."""
    torch_path = kernel.interface._backend_module("torch")
    q, k, v, sinks, dout = (t.detach().double() for t in (q, k, v, sinks, dout))
    cu = torch.tensor([0, q.shape[0]], device=q.device, dtype=torch.int32)
    args = (cu, cu, q.shape[0], q.shape[0], HEAD_DIM**-0.5, True, *window_size(window))
    out, lse = torch_path.sink_attention_forward(q, k, v, sinks, *args)
    dq, dk, dv, dsink = torch_path.sink_attention_backward(dout, q, k, v, out, lse, sinks, *args)
    return dict(out=out, dq=dq, dk=dk, dv=dv, dsink=dsink)


def parse_accuracy_cases(spec):
    """``S``, ``S/window`` or ``S/xSCALE`` (sink logits scaled), comma-separated: (S, window, scale)."""
    cases = []
    for S, _, extra in (item.partition("/") for item in spec.split(",") if item):
        scaled = extra.startswith("x")
        cases.append((int(S), int(extra) if extra and not scaled else None, float(extra[1:]) if scaled else 1.0))
    return cases


def accuracy(kernel, fa4, cases):
    results = []
    for S, window, sink_scale in cases:
        try:
            results.append(accuracy_case(kernel, fa4, S, window, sink_scale))
        except Exception as exc:  # noqa: BLE001
            print(f"[accuracy] {case_name(S, window)} failed: {error_text(exc)}", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return results


def accuracy_case(kernel, fa4, S, window, sink_scale):
    q, k, v, dout, sinks = make_inputs(S, seed=100 + S // 1024 + int(sink_scale), sink_scale=sink_scale)
    ref = reference_fp64(kernel, q[0], k[0], v[0], sinks, dout[0], window)
    row = dict(case=case_name(S, window) + (f", sinks x{sink_scale:g}" if sink_scale != 1 else ""))

    def errors(out, grads):
        values = (out[0], grads[0][0], grads[1][0], grads[2][0], grads[3])
        return {name: rel_error(t, ref[name]) for name, t in zip(("out", "dq", "dk", "dv", "dsink"), values)}

    ql, kl, vl, sl = leaves(q, k, v, sinks)
    out, lse = kernel.flash_attn_func(
        ql, kl, vl, causal=True, window_size=window_size(window), s_aux=sl, return_softmax_lse=True
    )
    row["ours"] = errors(out, torch.autograd.grad(out, (ql, kl, vl, sl), dout))
    # dsink from this kernel's own out and LSE, summed in fp64: the error the out rounding alone leaves
    delta = (dout[0].double() * out[0].double()).sum(-1).transpose(0, 1)  # [H, S]
    dsink_own = -(torch.exp(sinks.double()[:, None] - lse[0].double()) * delta).sum(-1)
    row["ours_dsink_from_own_out_fp64"] = rel_error(dsink_own, ref["dsink"])
    if fa4 is not None:
        try:
            ql, kl, vl, sl = leaves(q, k, v, sinks)
            out4 = fa4_call(fa4, ql, kl, vl, sl, window)
            row["fa4"] = errors(out4, torch.autograd.grad(out4, (ql, kl, vl, sl), dout))
        except Exception as exc:  # noqa: BLE001
            row["fa4_error"] = error_text(exc)
    print("[accuracy]", json.dumps(row), flush=True)
    return row


# ----------------------------------------------------------------------------------------------------------------
# one GPT-OSS attention layer of transformers
# ----------------------------------------------------------------------------------------------------------------
#: layer modes of ``--layer-shapes`` (``S`` alone is ``causal``)
LAYER_MODES = ("causal", "sliding", "packed", "deterministic")
LAYER_SHAPES = "4096,4096/sliding,16384,16384/sliding,32768,32768/sliding,16384/packed,16384/deterministic"
#: the packed row's sequence lengths, in sixteenths of S: ragged, as the trainer packs RL trajectories of unequal length
PACKED_SIXTEENTHS = (7, 3, 1, 4, 1)


def parse_layer_shapes(spec: str) -> list[tuple[int, str]]:
    """``--layer-shapes``: comma-separated ``S`` (causal) or ``S/MODE`` with MODE in `LAYER_MODES`."""
    shapes = []
    for item in filter(None, spec.split(",")):
        S, _, mode = item.partition("/")
        mode = mode or "causal"
        if mode not in LAYER_MODES or not S.isdigit():
            raise SystemExit(f"--layer-shapes: {item!r} is not S or S/MODE with MODE one of {', '.join(LAYER_MODES)}")
        shapes.append((int(S), mode))
    return shapes


def packed_lengths(S: int) -> list[int]:
    """The sequence lengths of the packed row of S tokens (`PACKED_SIXTEENTHS`, the last taking the remainder)."""
    lengths = [S * n // 16 for n in PACKED_SIXTEENTHS[:-1]]
    lengths.append(S - sum(lengths))
    if min(lengths) < 1:
        raise SystemExit(f"--layer-shapes: S={S} is too short to pack {len(PACKED_SIXTEENTHS)} sequences")
    return lengths


def layer_case(S: int, mode: str) -> str:
    if mode == "packed":
        return f"{seq_name(S)} packed ({len(PACKED_SIXTEENTHS)} sequences, causal)"
    if mode == "deterministic":
        return f"{seq_name(S)} full (causal), deterministic=True"
    return f"{seq_name(S)} " + ("sliding (window 128)" if mode == "sliding" else "full (causal)")


def layer_skip_reason(impl: str, S: int, mode: str, flex_seqlens) -> str | None:
    """Why the implementation ``impl`` has no cell in the layer row (S, mode), or None when it runs."""
    if impl == "flex_attention" and mode == "deterministic":
        return "flex_attention has no deterministic switch"
    if impl == "flex_attention" and S not in flex_seqlens:
        return "not in --flex-seqlens (each shape compiles for a minute or more)"
    if impl == "flash_attention_4" and mode == "deterministic":
        from flash_attn.cute import flash_attn_func  # noqa: PLC0415

        # transformers passes `deterministic` only to a function whose signature takes it, and drops it silently
        # otherwise (modeling_flash_attention_utils._lazy_define_process_function): the row would time FA4's default
        if "deterministic" not in inspect.signature(flash_attn_func).parameters:
            return "flash_attn.cute.flash_attn_func takes no `deterministic`"
    return None


def layer_step(impl: str, S: int, mode: str, seed=0):
    """One ``GptOssAttention`` layer's fwd+bwd closure (and its forward) for ``impl``, ``mode`` in `LAYER_MODES`.

    ``packed``: one row of ragged sequences with ``position_ids`` restarting at 0 for each, given to the layer as
    the trainer gives it to the model (`hf_gptoss_rl.packing`): the varlen ``FlashAttentionKwargs`` for the flash
    path, the block-diagonal mask of `packed_attention_masks` for the mask-based ones (flex_attention).
    ``deterministic``: ``deterministic=True`` passed with the call, which transformers' flash path hands to the
    attention function."""
    from transformers import GptOssConfig  # noqa: PLC0415
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask  # noqa: PLC0415
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding  # noqa: PLC0415

    from hf_gptoss_rl.packing import (  # noqa: PLC0415
        PACKED_MASK_ATTENTION,
        cache_keyword,
        flash_varlen_kwargs,
        packed_attention_masks,
    )

    sliding = mode == "sliding"
    config = GptOssConfig(
        hidden_size=2880 if DEVICE == "cuda" else 64, num_attention_heads=HEADS[0], num_key_value_heads=HEADS[1],
        head_dim=HEAD_DIM, sliding_window=128 if DEVICE == "cuda" else 16, num_hidden_layers=1,
        layer_types=["sliding_attention" if sliding else "full_attention"], max_position_embeddings=131072,
    )  # fmt: skip
    config._attn_implementation = impl
    torch.manual_seed(seed)
    layer = GptOssAttention(config, layer_idx=0).to(device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        layer.sinks.normal_()
    rotary = GptOssRotaryEmbedding(config).to(DEVICE)
    hidden = torch.randn(1, S, config.hidden_size, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad_out = torch.randn_like(hidden)
    lengths = packed_lengths(S) if mode == "packed" else [S]
    position_ids = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    position_embeddings = rotary(hidden, position_ids)
    extra = {"deterministic": True} if mode == "deterministic" else {}
    if mode == "packed" and impl in PACKED_MASK_ATTENTION:
        mask = packed_attention_masks(config, position_ids, DTYPE)["full_attention"]
    else:
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        params = inspect.signature(make_mask).parameters
        mask_kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=None, **{cache_keyword(make_mask): None})
        if "cache_position" in params:
            mask_kwargs["cache_position"] = torch.arange(S, device=DEVICE)
        if "position_ids" in params:
            mask_kwargs["position_ids"] = position_ids
        mask = make_mask(**mask_kwargs)
        if mode == "packed":
            extra = dict(position_ids=position_ids, **flash_varlen_kwargs(position_ids))
    inputs = [hidden, *layer.parameters()]

    def forward():
        return layer(hidden, position_embeddings=position_embeddings, attention_mask=mask, **extra)[0]

    def step():
        return torch.autograd.grad(forward(), inputs, grad_out)

    return step, forward


def time_layers(layer_impls, shapes, flex_seqlens, budget_s=float("inf")):
    rows = []
    start = time.time()
    for S, mode in shapes:
        if time.time() - start > budget_s:
            print(f"[layer] time budget spent: S={S} {mode} and later rows left out", flush=True)
            break
        row = dict(case=layer_case(S, mode), S=S, sliding=mode == "sliding", mode=mode)
        steps, forwards, errors, skipped = {}, {}, {}, {}
        for label, impl in layer_impls.items():
            try:
                reason = layer_skip_reason(impl, S, mode, flex_seqlens)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot be inspected is a table entry
                reason = error_text(exc, 200)
            if reason:
                skipped[label] = reason
                continue
            try:
                steps[label], forwards[label] = layer_step(impl, S, mode)
            except Exception as exc:  # noqa: BLE001 - a layer that cannot be built is a table entry
                row[label] = None
                errors[label] = error_text(exc)
        medians, bench_errors = bench_interleaved(steps)
        row.update(medians)
        errors.update(bench_errors)
        with torch.no_grad():
            outputs = {label: forward().float() for label, forward in forwards.items() if label not in errors}
        if errors:
            row["errors"] = errors
        if skipped:
            row["skipped"] = skipped
        del steps, forwards
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        # the implementations compute the same layer: their outputs agree to bf16 precision
        base = outputs.get(IMPL_OURS)
        row["max_rel_diff_to_ours"] = {
            k: rel_error(o, base.double()) for k, o in outputs.items() if base is not None and k != IMPL_OURS
        }
        rows.append(row)
        print("[layer]", json.dumps(row), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------
def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def targets(result):
    """The targets this benchmark tracks, each with the measured value and whether it is met."""
    by_case = {r["case"]: r for r in result["kernel_rows"]}

    def host_note(r, per="call"):
        # the raw kernels' time bounds the GPU time from above: a public call whose host time reaches it is timed by
        # the host (Python per call), not by the kernels
        host, raw = r.get("public_host_ms"), r.get("raw_ms")
        if host and raw and host >= raw:
            return f"; host {host:.3f} ms per {per}: the host sets this row"
        return ""

    def fa4_target(case, goal=""):
        r = by_case.get(case, {})
        x = r["public_ms"] / r["fa4_ms"] if r.get("public_ms") and r.get("fa4_ms") else None
        value = fmt(x, ".3f") + "x" + host_note(r)
        return dict(target=f"{case}: public path <= 1.10x FA4{goal}", value=value, met=None if x is None else x <= 1.10)

    def window_target(target, r, per="call"):
        pub, raw, fa, bare = r.get("public_ms"), r.get("raw_ms"), r.get("fa4_ms"), r.get("autograd_ms")
        # how much of public - raw a bare autograd.Function around the raw kernels pays already (PyTorch's autograd)
        floor = "" if None in (pub, raw, bare) else f"; raw in a bare autograd.Function {bare:.3f}"
        return dict(
            target=f"{target}: faster than FA4 and within 0.1 ms of the raw kernels",
            value=f"{fmt(pub, '.3f')} ms (FA4 {fmt(fa, '.3f')}, raw {fmt(raw, '.3f')}{floor}{host_note(r, per)})",
            met=None if None in (pub, raw, fa) else (pub < fa and pub - raw <= 0.1),
        )

    out = [fa4_target("S=16k causal", " (goal 1.0x)"), fa4_target("S=32k causal", " (goal 1.0x)")]
    out.append(fa4_target("S=4k causal"))
    out += [window_target(case, by_case.get(case, {})) for case in ("S=4k window 128", "S=16k window 128")]
    for r in result.get("stack_rows", []):
        name = f"{r['case']}, per layer of a {r['layers']}-layer stack with one backward (as in a model)"
        out.append(window_target(name, r, per="layer"))
    mixed = result.get("mixed")
    if mixed:
        x = mixed["after_ms"] / mixed["first_ms"]
        target = "S=4k causal after a mixed workload: within 5% of the first run"
        out.append(dict(target=target, value=f"{x:.3f}x", met=x <= 1.05))
    worst = max(
        (row["ours"]["dsink"] / row["fa4"]["dsink"] for row in result["accuracy"] if "fa4" in row), default=None
    )
    out.append(
        dict(
            target="dsink relative error <= 1.25x FA4's (8k-16k, large sinks included), worst case",
            value=fmt(worst, ".2g") + "x",
            met=None if worst is None else worst <= 1.25,
        )
    )
    return out


def layer_peers(result) -> list[str]:
    """The layer table's peer columns: every implementation but ours, run or skipped, in a fixed order."""
    return [label for label in (*result["layer_impls"], *result["layer_skipped"]) if label != IMPL_OURS]


def layer_table_head(result) -> list[str]:
    peers = layer_peers(result)
    return md_table(["case", IMPL_OURS, *peers, *(f"ours ÷ {p}" for p in peers), "max rel. output diff to ours"])


def layer_table_row(result, r, diffs) -> str:
    """One layer row: ms per implementation (``skipped`` / ``error`` where there is none), then ours ÷ each peer."""
    skipped = {**result["layer_skipped"], **r.get("skipped", {})}

    def cell(label):
        if r.get(label) is not None:
            return fmt(r[label], ".3f")
        return "skipped" if label in skipped else "error" if label in r.get("errors", {}) else "-"

    ours, peers = r.get(IMPL_OURS), layer_peers(result)
    ratios = [ratio(ours, r[p]) if ours and r.get(p) else "-" for p in peers]
    return f"| {r['case']} | " + " | ".join([cell(IMPL_OURS), *map(cell, peers), *ratios, diffs]) + " |"


def layer_skip_lines(result) -> list[str]:
    """The layer table's notes: units, the packed and deterministic rows, and why a peer has no number."""
    sizes = ", ".join(f"{n}/16" for n in PACKED_SIXTEENTHS)
    lines = [
        "",
        f"Times in ms; {RATIO_RULE}. Packed: {len(PACKED_SIXTEENTHS)} sequences of {sizes} of S in one row, "
        "`position_ids` restarting at 0 for each, as the trainer packs them. deterministic=True: passed with the "
        "layer call; transformers' flash path hands it to the attention function.",
        "",
    ]
    lines += [f"- {label}: skipped in every row: {why}" for label, why in result["layer_skipped"].items()]
    for r in result["layer_rows"]:
        lines += [f"- {label}, {r['case']}: skipped: {why}" for label, why in r.get("skipped", {}).items()]
    return lines


def failed_rows(result) -> list[tuple[str, str, str]]:
    """(case, implementation, error) of every timed row's implementation that raised."""
    rows = result["kernel_rows"] + result.get("stack_rows", []) + result.get("layer_rows", [])
    return [(r["case"], k, v) for r in rows for k, v in r.get("errors", {}).items()]


def timing_table(rows, host: str, last=()) -> list[str]:
    """The kernel and stack tables: ms per column, host time per ``host``, public / FA4 and the differences to the
    raw kernels (``last``: extra (key, header) columns at the end)."""
    columns = {"public_ms": "flash_attn_func", "public_host_ms": f"host per {host}", "varlen_ms": "varlen",
               "raw_ms": "raw kernels", "autograd_ms": "raw in autograd", "fa4_ms": "FA4",
               "fa4_host_ms": f"FA4 host per {host}"}  # fmt: skip
    if host != "call":
        del columns["varlen_ms"]
    derived = ["public / FA4", "public - raw", "public - raw in autograd"]

    def cells(r):
        pub, raw, fa, bare = r.get("public_ms"), r.get("raw_ms"), r.get("fa4_ms"), r.get("autograd_ms")
        return [
            r["case"],
            *(fmt(r.get(key), ".3f") for key in columns),
            f"{fmt(pub / fa if pub and fa else None)}x",
            fmt(pub - raw if pub and raw else None, "+.3f"),
            fmt(pub - bare if pub and bare else None, "+.3f"),
            *(fmt(r.get(key), ".3f") for key, _ in last),
        ]

    return md_table(["case", *columns.values(), *derived, *(head for _, head in last)], map(cells, rows))


def write_markdown(result, path):
    env = result["env"]
    lines = [
        "# Attention benchmark: sink attention where users call it",
        "",
        f"`{result['command']}` on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, flash-attn-4 {env.get('flash_attn_4') or 'not installed'}); all numbers "
        "below come from that one run. GPT-OSS shapes: B=1, 64 query / 8 KV heads, head_dim 64, bf16; "
        "forward + backward with the gradients of q, k, v and the sinks; medians of `triton.testing.do_bench` "
        f"samples over {result['rounds']} interleaved rounds of a row's implementations (at least "
        f"{result['min_calls']} calls each per round), ms.",
        "",
        "## Targets",
        "",
        *md_table(
            ["target", "measured", "met"],
            [
                [t["target"], t["value"], "-" if t["met"] is None else "yes" if t["met"] else "no"]
                for t in result["targets"]
            ],
        ),
        "",
        "## Kernel: public API against FA4",
        "",
        "`flash_attn_func` / `flash_attn_varlen_func` are the kernel's public functions (autograd included; "
        "varlen: the same tokens as 4 packed sequences of S/4, so a causal row does a quarter of the work); raw = "
        "`triton_kernels.sink_attention_forward` + `sink_attention_backward` called directly, no autograd; raw in "
        "autograd = the same calls inside a bare `torch.autograd.Function` (one output, nothing checked or re-laid "
        "out): the floor of any autograd API, so public - raw in autograd is the public interface's own cost. Every "
        "column but the last runs with `deterministic=False` (FlashAttention's default, FA4's too): on full-attention "
        "layers from 2k keys that is the one-kernel backward (five products per tile, dQ and dsink added by atomics); "
        "`deterministic=True` is the same public call with the bitwise-reproducible two-kernel backward (seven "
        "products; other rows run those kernels in every column). Host per call: the host's time to issue one "
        "`flash_attn_func` fwd+bwd (`time.perf_counter` over 20 calls that do not wait for the GPU, best of 3); where "
        "it reaches the raw kernels' time (an upper bound on the GPU time), the host (Python per call) rather than "
        "the kernels sets that row, and the targets table says so.",
        "",
        *timing_table(result["kernel_rows"], "call", last=[("deterministic_ms", "deterministic=True")]),
    ]
    if result.get("stack_rows"):
        layers = result["stack_rows"][0]["layers"]
        lines += [
            "",
            "## Layers in a stack: what a layer costs inside a model",
            "",
            f"The rows above time one call at a time, so every call's backward is handed to autograd's device thread "
            f"and back on its own. Here each implementation runs the forward of {layers} layers (each with its own q, "
            f"k, v and sinks), then one `torch.autograd.grad` over all of them, as a model's forward and backward "
            f"pass run its layers (GPT-OSS-20B has 12 window-128 layers); raw: the {layers} forwards, then the "
            f"backwards in reverse order; raw in autograd: the {layers} layers through the bare "
            f"`torch.autograd.Function` and one `torch.autograd.grad`. Times per layer: the stack's `do_bench` "
            f"median / {layers}; host per layer: the host's time to issue the stack (no wait for the GPU, best of 3) "
            f"/ {layers}.",
            "",
            *timing_table(result["stack_rows"], "layer"),
        ]
    if result.get("layer_rows"):
        lines += [
            "",
            "## One GPT-OSS attention layer of transformers",
            "",
            "`GptOssAttention` (q/k/v/o projections, RoPE, attention; hidden 2880) forward + backward, "
            f"`attn_implementation` per column; ours: {result['layer_how']}.",
            "",
            *layer_table_head(result),
        ]
        for r in result["layer_rows"]:
            diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["max_rel_diff_to_ours"].items()) or "-"
            lines.append(layer_table_row(result, r, diffs))
        lines += layer_skip_lines(result)
    mixed = result.get("mixed")
    if mixed:
        lines += [
            "",
            "## Mixed workload",
            "",
            f"S=4k causal through `flash_attn_func`: {mixed['first_ms']:.3f} ms as the first shape timed in the "
            f"process, {mixed['after_ms']:.3f} ms after fp16, fp32, packed-varlen and KV-cache decode calls "
            f"(and every other row above) in the same process ({mixed['after_ms'] / mixed['first_ms']:.3f}x).",
        ]
    lines += ["", "## Accuracy against fp64 (relative L2 error, same inputs)", ""]
    lines += md_table(["case", "impl", "out", "dq", "dk", "dv", "dsink"])
    for r in result["accuracy"]:
        for label, key in ((IMPL_OURS, "ours"), (IMPL_FA4, "fa4")):
            if key in r:
                errors = " | ".join(f"{r[key][k]:.2e}" for k in ("out", "dq", "dk", "dv", "dsink"))
                lines.append(f"| {r['case']} | {label} | {errors} |")
        own = f"dsink from {IMPL_OURS}'s own bf16 out and LSE, summed in fp64"
        lines.append(f"| {r['case']} | {own} | | | | | {r['ours_dsink_from_own_out_fp64']:.2e} |")
    if failed_rows(result):
        lines += ["", "## Failures in this run", ""] + [f"- {c}, {k}: `{v}`" for c, k, v in failed_rows(result)]
    lines += ["", f"Launch configurations: `{json.dumps(result['configs'])}`", ""]
    path.write_text("\n".join(lines))


def write_plot(result, path):
    rows = result["kernel_rows"]
    series = {"flash_attn_func": "public_ms", "raw kernels in a bare autograd.Function": "autograd_ms",
              "raw kernels": "raw_ms", "FA4 + learnable_sink": "fa4_ms"}  # fmt: skip
    nan = float("nan")
    ratios = {label: [(r.get(key) or nan) / (r.get("fa4_ms") or nan) for r in rows] for label, key in series.items()}
    with figure(path) as (_, ax):
        grouped_bars(ax, [r["case"] for r in rows], ratios)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("fwd+bwd time / FA4's")
        ax.set_title(f"Sink attention, GPT-OSS shapes, {result['env']['gpu']}")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(series))


def run_failures(result, accuracy_cases: int, gpu: bool) -> list[str]:
    """What fails a run: a row's implementation that raised, an accuracy case that did not finish, and on a GPU a
    target not met (the CPU run is a smoke test of the script: its timings mean nothing)."""
    failures = [f"{case}, {k}: {v}" for case, k, v in failed_rows(result)]
    failures += [f"{r['case']}, FA4: {r['fa4_error']}" for r in result.get("accuracy", []) if r.get("fa4_error")]
    if result.get("mixed_error"):
        failures.append(f"mixed workload: {result['mixed_error']}")
    if len(result.get("accuracy", [])) < accuracy_cases:
        failures.append(
            f"accuracy: {accuracy_cases - len(result['accuracy'])} of {accuracy_cases} cases failed (see the log)"
        )
    if gpu:
        failures += [f"target not met: {t['target']} ({t['value']})" for t in result["targets"] if t["met"] is False]
    return failures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", default="4096,4096/128,16384,16384/128,32768", help="kernel rows: S (causal), S/window")
    p.add_argument("--stack-shapes", default="4096/128,16384/128", help="rows timed as a stack of layers: S, S/window")
    p.add_argument("--stack-layers", type=int, default=12, help="layers per stack (GPT-OSS-20B: 12 window-128)")
    p.add_argument(
        "--layer-shapes", default=LAYER_SHAPES, help=f"GptOssAttention rows: S or S/MODE ({', '.join(LAYER_MODES)})"
    )
    p.add_argument("--flex-seqlens", default="4096", help="layer rows that also time flex_attention (slow compiles)")
    p.add_argument("--layer-budget-s", type=float, default=300.0, help="no new layer row after this many seconds")
    p.add_argument("--accuracy", default="8192,16384,16384/128,8192/x25", help="accuracy cases: S, S/window, S/xSCALE")
    p.add_argument("--mixed-seqlen", type=int, default=4096)
    p.add_argument("--from-json", help="only re-render attention.md / .png from a saved attention.json")
    return p.parse_args(argv)


def main(argv=None):
    global DEVICE, DTYPE, HEADS
    args = parse_args(argv)
    out_dir = output_dir(args.out, "attention.json", "attention.md", "attention.png")
    layer_shapes = parse_layer_shapes(args.layer_shapes)  # a bad spec stops the run before anything is measured
    if args.from_json:
        result = without_local_paths(json.loads(Path(args.from_json).read_text()))
        result["targets"] = targets(result)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, out_dir / "attention.md")
        write_plot(result, out_dir / "attention.png")
        return
    DEVICE = args.device
    if DEVICE == "cpu":  # a smoke test of the script: fp32 (the CPU path), few heads
        DTYPE, HEADS = torch.float32, (4, 2)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel = load_kernel()
    fa4, fa4_missing = load_fa4() if DEVICE == "cuda" else (None, "not run on CPU (FA4 needs a CUDA GPU)")
    env = environment("flash-attn-4")  # versions and the source commit (the README's sources name it)
    env["gpu"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke test, not a result)"
    print(env, flush=True)
    t0 = time.time()
    tk = kernel.interface._backend_module("triton")
    configs = {f"{name}/{d}": dict(cfg) for (name, d), cfg in tk.CONFIGS.items()}  # (read-only mappings in the kernel)
    result = dict(env=env, command=command_line("attention", argv, omit_out=True), kernel_rows=[], stack_rows=[],
                  layer_impls={}, layer_how=None, layer_rows=[], mixed=None, accuracy=[], configs=configs,
                  rounds=ROUNDS, min_calls=MIN_CALLS)  # fmt: skip

    def save():  # after every section: a run stopped at a time limit still leaves what it measured
        result["wall_s"] = time.time() - t0
        result["targets"] = targets(result)
        report = without_local_paths(result)  # a report names no local folder
        (out_dir / "attention.json").write_text(json.dumps(report, indent=1))
        write_markdown(report, out_dir / "attention.md")

    # the mixed-workload baseline first: nothing else has run in this process yet
    first = bench(public_step(kernel, None, [make_inputs(args.mixed_seqlen, seed=3)]))
    result["kernel_rows"] = time_rows(kernel, fa4, parse_shapes(args.shapes))
    save()
    result["stack_rows"] = time_rows(kernel, fa4, parse_shapes(args.stack_shapes), args.stack_layers)
    save()
    try:
        mixed_workload(kernel, args.mixed_seqlen)
        after = bench(public_step(kernel, None, [make_inputs(args.mixed_seqlen, seed=3)]))
        result["mixed"] = dict(first_ms=first, after_ms=after)
    except Exception as exc:  # noqa: BLE001
        result["mixed_error"] = error_text(exc, 500)
        print("[mixed] failed:", result["mixed_error"], flush=True)
    print("[mixed]", json.dumps(result["mixed"]), flush=True)
    save()
    cases = parse_accuracy_cases(args.accuracy)
    result["accuracy"] = accuracy(kernel, fa4, cases)
    save()

    layer_impls, layer_how, layer_skipped = {}, None, {}  # skipped peers, with the reason: a table entry
    try:
        layer_impls[IMPL_OURS], layer_how = setup_project_attention("hub")  # the id, as users select it
    except Exception as exc:  # noqa: BLE001
        print(f"[layer] the hub id could not be registered ({type(exc).__name__}: {exc}); layer rows left out")
    if layer_impls and fa4 is not None:
        layer_impls[FA4_LAYER] = "flash_attention_4"
    elif layer_impls:
        layer_skipped[FA4_LAYER] = fa4_missing
    if layer_impls:
        layer_impls["flex_attention"] = "flex_attention"
    flex_seqlens = {int(s) for s in args.flex_seqlens.split(",") if s}
    result.update(layer_impls=layer_impls, layer_how=layer_how, layer_skipped=layer_skipped)
    if layer_impls:
        result["layer_rows"] = time_layers(layer_impls, layer_shapes, flex_seqlens, args.layer_budget_s)
    save()

    try:
        write_plot(result, out_dir / "attention.png")
    except ImportError as exc:  # matplotlib missing: the table and json are still written
        print(f"[plot] not written: {exc!r}")
    for t in result["targets"]:
        print(f"[target] {t['target']}: {t['value']} ({'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'})")
    print(f"[done] {time.time() - t0:.0f} s", flush=True)
    exit_if_failed("benchmarks/attention.py", run_failures(result, len(cases), gpu=DEVICE == "cuda"), out_dir)


if __name__ == "__main__":
    main()
