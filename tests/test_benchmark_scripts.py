"""CPU checks of the end-to-end GPU benchmarks (`benchmarks/mismatch_study.py`, `benchmarks/attention.py`, ...).

The scripts are meant for a GPU; here they run end to end on tiny shapes (their numbers are not results), and the
pieces whose correctness the GPU numbers rest on are checked against references:
the benchmark's loss against TRL's own `_compute_loss`, the kernel fallback registration and the sink-dropping
attention against eager, and the pre-rendered prompts against a fresh harmony rendering.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_gptoss_rl import attention_variants
from hf_gptoss_rl.model_builders import build_random_gptoss

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _tiny_model(**overrides):
    from hf_gptoss_rl.model_builders import tiny_gptoss_config

    config = tiny_gptoss_config(vocab_size=256, num_hidden_layers=2, sliding_window=4, **overrides)
    return build_random_gptoss(config, device="cpu", dtype=torch.float32, seed=3, sink_mean=1.0, sink_std=1.5)


def _right_padded_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, as the mismatch study scores its batch
    return ids, mask


def test_direct_kernel_registration_matches_eager():
    """The no-`kernels` fallback (kernel sources via AttentionInterface) computes eager's sink attention."""
    model = _tiny_model().eval()
    ids, mask = _right_padded_batch(model.config.vocab_size)
    name, _ = attention_variants.setup_project_attention("direct")
    assert name == attention_variants.DIRECT_KERNEL_ATTENTION
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(name)
        out = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)


def test_direct_kernel_refuses_left_padding():
    model = _tiny_model().eval()
    ids, mask = _right_padded_batch(model.config.vocab_size)
    name, _ = attention_variants.setup_project_attention("direct")
    model.set_attn_implementation(name)
    with pytest.raises(ValueError, match="right padding"):
        model(input_ids=ids, attention_mask=mask.flip(-1))


def test_sink_dropping_attention_is_eager_without_the_sink():
    """`eager_without_sinks` equals eager when the sinks vanish (-1e4) and differs from it with real sinks."""
    model = _tiny_model().eval()
    ids, mask = _right_padded_batch(model.config.vocab_size)
    name = attention_variants.register_sink_dropping_attention()
    valid = mask.bool()
    with torch.no_grad():
        model.set_attn_implementation(name)
        dropped = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        with_sinks = model(input_ids=ids, attention_mask=mask).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        no_sinks = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(dropped[valid], no_sinks[valid], rtol=1e-5, atol=1e-5)
    assert (dropped[valid] - with_sinks[valid]).abs().max() > 1e-2


def test_build_random_gptoss_draws_sinks_and_finite_weights():
    model = _tiny_model()
    sinks = torch.stack([layer.self_attn.sinks for layer in model.model.layers])
    assert sinks.std() > 0.5 and abs(sinks.mean() - 1.0) < 1.5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_mismatch_study_runs_on_cpu(tmp_path):
    proc = _run(
        [
            "benchmarks/mismatch_study.py",
            "--model", "tiny", "--device", "cpu", "--num-prompts", "2", "--max-new-tokens", "8",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert "project attention" in proc.stdout
    for name in ("mismatch_study.md", "mismatch_study.png", "mismatch_study.json"):
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / "mismatch_study.json").read_text())
    (res,) = data["results"]
    rows = {row["attn_implementation"]: row for row in res["rows"]}
    assert res["num_sequences"] == 2 and res["completion_tokens"] > 0
    assert "skipped" in rows["flex_attention"]["note"]  # CPU: flex refuses sinks
    exact, dropped = rows["eager"], rows[attention_variants.SINK_DROPPING_ATTENTION]
    project = next(r for r in res["rows"] if r["attention"].startswith("project kernel"))
    for row in (exact, dropped, project):
        assert "note" not in row, row
        assert row["num_tokens"] == res["completion_tokens"]
        assert row["k3_kl"] >= 0 and row["prob_diff_max"] >= row["prob_diff_mean"] >= 0
    # with realistic sinks, dropping them moves the distribution far more than the kernel's bf16 noise
    assert dropped["k3_kl"] > 10 * max(project["k3_kl"], exact["k3_kl"])
    # the fp32 exact reference: every scored row and the rollout itself are compared with it
    assert data["meta"]["exact_reference"] is True
    assert "float32" in res["exact"]["reference"] and "note" not in res["exact"]
    for vals in (res["exact"]["rollout"], exact, dropped, project):
        for key in ("prob_diff_mean", "prob_diff_max", "k3_kl", "log_ppl_diff"):
            name = key if vals is res["exact"]["rollout"] else f"exact_{key}"
            assert name in vals and vals[name] == vals[name], (name, vals)  # present, not NaN
    assert dropped["exact_k3_kl"] > 10 * max(project["exact_k3_kl"], exact["exact_k3_kl"])
    report = (tmp_path / "mismatch_study.md").read_text()
    assert "k3 KL(exact‖row)" in report and "rollout itself" in report


def test_mismatch_study_exact_reference_fp32_and_no_exact(tmp_path):
    """In fp32 the exact reference is the eager row's own computation: their gap must vanish. `--no-exact` drops it."""
    args = ["benchmarks/mismatch_study.py", "--model", "tiny", "--device", "cpu", "--num-prompts", "2"]
    _run([*args, "--max-new-tokens", "8", "--dtype", "float32", "--out", str(tmp_path / "fp32")])
    (res,) = json.loads((tmp_path / "fp32" / "mismatch_study.json").read_text())["results"]
    rows = {row["attn_implementation"]: row for row in res["rows"]}
    eager, dropped = rows["eager"], rows[attention_variants.SINK_DROPPING_ATTENTION]
    assert eager["exact_prob_diff_max"] < 1e-6 and abs(eager["exact_k3_kl"]) < 1e-9, eager
    assert res["exact"]["rollout"]["k3_kl"] < 1e-6  # fp32 KV-cached decode vs one fp32 forward
    assert dropped["exact_k3_kl"] > 1e-3  # the comparison is not trivially zero
    _run([*args, "--max-new-tokens", "4", "--no-exact", "--out", str(tmp_path / "no_exact")])
    data = json.loads((tmp_path / "no_exact" / "mismatch_study.json").read_text())
    (res,) = data["results"]
    assert data["meta"]["exact_reference"] is False and res["exact"] is None
    assert not any(k.startswith("exact_") for row in res["rows"] for k in row)
    assert "k3 KL(exact‖row)" not in (tmp_path / "no_exact" / "mismatch_study.md").read_text()


def test_logprobs_benchmark_variants_agree_and_report_renders(tmp_path, monkeypatch):
    """`benchmarks/logprobs.py` (GPU-only for timing): its three variants compute the same log-probs / entropies on a
    small head on CPU (the fused one in Triton's interpreter), and its report renders from the committed json."""
    import os

    from benchmarks import logprobs as bench
    from hf_gptoss_rl import _backend as backend_settings

    logprobs_before = backend_settings.current.logprobs
    torch.manual_seed(0)
    hidden = torch.randn(6, 16)
    weight = torch.randn(300, 16)
    targets = torch.randint(0, 300, (6,))
    logp_all = torch.log_softmax((hidden.double() @ weight.double().t()) / 0.8, dim=-1)
    ref = (logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1))
    names = ["full_logits", "chunked_torch"] + (["chunked_fused"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    for name in names:
        lp, ent = bench.run_variant(name, hidden, weight, targets, 0.8)
        torch.testing.assert_close(lp.double(), ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-5)
    assert backend_settings.current.logprobs == logprobs_before  # the variant switch does not leak
    saved = json.loads((REPO / "docs" / "benchmarks" / "logprobs.json").read_text())
    bench.write_report(tmp_path, {int(s): v for s, v in saved["results"].items()}, saved["correctness"], saved["meta"])
    text = (tmp_path / "logprobs.md").read_text()
    assert "| 32768 | chunked_fused |" in text and "d hidden" in text


def test_attention_benchmark_cpu_smoke(tmp_path):
    """`benchmarks/attention.py` end to end on tiny CPU shapes: every section runs, and the fp64 reference (the
    kernel's PyTorch path on fp64 inputs, checked against an eager fp64 reference by the kernel's tests) sits at fp32
    rounding from the kernel's fp32 path here: above 0 (it is not that fp32 computation again), below 1e-5."""
    _run(
        [
            str(REPO / "benchmarks" / "attention.py"),
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--shapes",
            "64,64/16",
            "--stack-shapes",
            "64/16",
            "--stack-layers",
            "3",
            "--layer-shapes",
            "64,64/packed,64/deterministic",
            "--flex-seqlens",
            "",
            "--accuracy",
            "64,64/16,64/x25",
            "--mixed-seqlen",
            "64",
        ],
        timeout=600,
    )
    res = json.loads((tmp_path / "attention.json").read_text())
    from benchmarks._cli import git_commit

    assert res["env"]["commit"] == git_commit()  # the source commit the README's sources name
    assert [r["case"] for r in res["kernel_rows"]] == ["S=64 causal", "S=64 window 16"]
    assert all(
        r["public_ms"] > 0 and r["raw_ms"] > 0 and r["autograd_ms"] > 0 and r["public_host_ms"] > 0
        for r in res["kernel_rows"]
    )
    (stack,) = res["stack_rows"]
    assert (stack["case"], stack["layers"]) == ("S=64 window 16", 3)
    assert stack["public_ms"] > 0 and stack["raw_ms"] > 0 and stack["autograd_ms"] > 0 and stack["public_host_ms"] > 0
    assert res["mixed"]["first_ms"] > 0 and res["mixed"]["after_ms"] > 0
    assert [r["case"] for r in res["accuracy"]] == ["S=64 causal", "S=64 window 16", "S=64 causal, sinks x25"]
    for row in res["accuracy"]:
        assert 0 < max(row["ours"].values()) < 1e-5, row
    for row in res["layer_rows"]:  # present where `kernels` can load the hub id
        assert row["sink-flash-attn3"] > 0, row
    if res["layer_rows"]:
        assert [r["mode"] for r in res["layer_rows"]] == ["causal", "packed", "deterministic"]
        assert "FA4 (flash_attention_4)" in res["layer_skipped"]  # CPU: named as skipped, not dropped
    assert (tmp_path / "attention.md").read_text().startswith("# Attention benchmark")


def test_attention_targets_name_host_bound_rows():
    """A target row whose public-path host time per call reaches the raw kernels' time (an upper bound on the GPU
    time) is marked as set by the host; a GPU-bound row is not."""
    from benchmarks import attention as bench

    def row(case, public, raw, host, fa4):
        return dict(case=case, public_ms=public, raw_ms=raw, public_host_ms=host, fa4_ms=fa4)

    result = dict(
        kernel_rows=[
            row("S=16k causal", 17.3, 17.4, 1.3, 15.0),
            row("S=4k causal", 1.44, 1.27, 1.2, 1.11),
            row("S=4k window 128", 1.31, 0.62, 1.3, 0.66),
            row("S=16k window 128", 0.86, 0.85, 0.5, 1.19),
        ],
        accuracy=[],
    )
    values = {t["target"].split(":")[0]: (t["value"], t["met"]) for t in bench.targets(result)}
    assert "host" not in values["S=16k causal"][0] and "host" not in values["S=4k causal"][0]
    assert values["S=4k window 128"] == (
        "1.310 ms (FA4 0.660, raw 0.620; host 1.300 ms per call: the host sets this row)",
        False,
    )
    assert values["S=16k window 128"] == ("0.860 ms (FA4 1.190, raw 0.850)", True)
    # rows of a stack of layers with one backward: the same rule per layer
    result["stack_rows"] = [
        dict(case="S=4k window 128", layers=12, public_ms=0.33, raw_ms=0.25, fa4_ms=0.35, public_host_ms=0.30),
        dict(case="S=16k window 128", layers=12, public_ms=0.99, raw_ms=0.85, fa4_ms=1.1, public_host_ms=0.3),
    ]
    stacked = [t for t in bench.targets(result) if "stack" in t["target"]]
    assert [(t["target"].split(",")[0], t["value"], t["met"]) for t in stacked] == [
        ("S=4k window 128", "0.330 ms (FA4 0.350, raw 0.250; host 0.300 ms per layer: the host sets this row)", True),
        ("S=16k window 128", "0.990 ms (FA4 1.100, raw 0.850)", False),
    ]


def test_attention_bare_autograd_row_computes_the_public_gradients(monkeypatch):
    """The "raw in autograd" reference row (raw kernels in a bare autograd.Function) returns the gradients that
    `flash_attn_func` returns on the same inputs, per call and in a stack, and its value shows in a window target."""
    from benchmarks import attention as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "HEADS", (4, 2))
    kernel = bench.load_kernel()
    inputs = bench.make_inputs(48, seed=3)
    for window in (None, 16):
        public = bench.public_step(kernel, window, [inputs])()
        bare = bench.bare_step(kernel, window, [inputs])()
        for name, p, b in zip(("dq", "dk", "dv", "dsink"), public, bare):
            torch.testing.assert_close(b, p.reshape(b.shape), msg=f"{name}, window {window}")
    stack = [bench.make_inputs(32, seed=i) for i in range(3)]
    bare = bench.bare_step(kernel, 16, stack)()
    public = bench.public_step(kernel, 16, stack)()
    for p, b in zip(public, bare):
        torch.testing.assert_close(b, p.reshape(b.shape))
    row = dict(case="S=4k window 128", public_ms=0.7, raw_ms=0.23, autograd_ms=0.62, fa4_ms=0.8, public_host_ms=0.2)
    (target,) = [t for t in bench.targets(dict(kernel_rows=[row], accuracy=[])) if t["target"].startswith("S=4k w")]
    assert target["value"] == "0.700 ms (FA4 0.800, raw 0.230; raw in a bare autograd.Function 0.620)"
    assert target["met"] is False


def test_attention_layer_rows_packed_deterministic_and_skipped_peers(monkeypatch):
    """The GptOssAttention rows: the packed row keeps its sequences apart through this kernel's hub id (its output
    is eager's with the block-diagonal mask the trainer builds), the deterministic row runs, and the table prints
    ours ÷ each peer and names a skipped peer with its reason."""
    from benchmarks import attention as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "HEADS", (4, 2))
    assert bench.parse_layer_shapes("64,64/packed,32/deterministic") == [
        (64, "causal"), (64, "packed"), (32, "deterministic")
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="64/packd"):
        bench.parse_layer_shapes("64/packd")
    assert bench.packed_lengths(64) == [28, 12, 4, 16, 4]
    ours, _ = attention_variants.setup_project_attention("hub")  # the id, as the benchmark registers it
    _, packed = bench.layer_step(ours, 64, "packed")
    _, eager = bench.layer_step("eager", 64, "packed")
    with torch.no_grad():
        torch.testing.assert_close(packed(), eager(), rtol=1e-4, atol=1e-5)
    step, _ = bench.layer_step(ours, 32, "deterministic")
    assert all(g is not None for g in step())

    impls = {bench.IMPL_OURS: ours, "flex_attention": "flex_attention"}
    result = dict(layer_impls=impls, layer_skipped={"FA4 (flash_attention_4)": "flash_attn.cute not importable"})
    row = {"case": "S=4k full (causal)", bench.IMPL_OURS: 1.5, "flex_attention": 3.0, "max_rel_diff_to_ours": {}}
    det = {"case": "S=4k full (causal), deterministic=True", bench.IMPL_OURS: 2.0, "max_rel_diff_to_ours": {}}
    det["skipped"] = {"flex_attention": bench.layer_skip_reason("flex_attention", 4096, "deterministic", {4096})}
    result["layer_rows"] = [row, det]
    assert bench.layer_table_head(result)[0].endswith(
        "| ours ÷ flex_attention | ours ÷ FA4 (flash_attention_4) | max rel. output diff to ours |"
    )
    assert bench.layer_table_row(result, row, "-") == "| S=4k full (causal) | 1.500 | 3.000 | skipped | 0.50x | - | - |"
    assert bench.layer_table_row(result, det, "-").startswith(
        "| S=4k full (causal), deterministic=True | 2.000 | skipped"
    )
    notes = "\n".join(bench.layer_skip_lines(result))
    assert "FA4 (flash_attention_4): skipped in every row: flash_attn.cute not importable" in notes
    assert (
        "flex_attention, S=4k full (causal), deterministic=True: skipped: flex_attention has no deterministic" in notes
    )


def test_attention_bench_interleaves_rounds_and_keeps_failures(monkeypatch):
    """`bench_interleaved` (GPU timing, here with a stand-in for `do_bench`): every round times each implementation
    once, in the row's order; from the second round a slow call gets at least `min_calls` samples; the median is
    over every sample; an implementation that raises is an error entry, left out of the later rounds."""
    import triton

    from benchmarks import attention as bench

    calls = []
    call_ms = {"fast": 1.0, "slow": 60.0}

    def fake_do_bench(fn, warmup, rep, return_mode):
        assert return_mode == "all"
        name = fn()
        calls.append((name, rep))
        n = max(1, int(rep / call_ms[name]))
        return [call_ms[name]] * n

    def broken():
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(bench, "DEVICE", "cuda")
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    steps = {"fast": lambda: "fast", "broken": broken, "slow": lambda: "slow"}
    medians, errors = bench.bench_interleaved(steps, rounds=3, min_calls=10, rep=150)
    assert [name for name, _ in calls] == ["fast", "slow"] * 3
    assert [rep for name, rep in calls if name == "slow"] == [150, 600.0, 600.0]  # 2 samples, then 10 per round
    assert errors == {"broken": "RuntimeError: no kernel image"}
    assert medians == {"fast": 1.0, "broken": None, "slow": 60.0}


def test_grpo_step_flops_by_hand():
    """The FLOP model of the trainer-step report, on a config small enough to count by hand."""
    from benchmarks.trainer_step import grpo_step_flops
    from hf_gptoss_rl.model_builders import gptoss_20b_config

    config = gptoss_20b_config(
        num_hidden_layers=2, hidden_size=8, intermediate_size=4, head_dim=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2, sliding_window=3, vocab_size=10,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"]
    s, prompt = 5, 1
    # per token and layer, multiply-adds: q 8x8, k and v 8x4 each, o 8x8, router 8x3, 2 experts of 8x8 + 4x8
    macs = 64 + 2 * 32 + 64 + 24 + 2 * (64 + 32)
    pairs = (1 + 2 + 3 + 3 + 3) + (1 + 2 + 3 + 4 + 5)  # window of 3 keys, then causal
    f = grpo_step_flops(config, s, prompt)
    assert f["linear"] == 2 * 2 * macs * 2 * s  # 2 FLOPs per multiply-add, forward + input gradient, 2 layers
    assert f["attention"] == 3.5 * 2 * 2 * pairs * 2 * 4  # QK^T and PV, head_dim 2, 4 heads; backward 2.5x
    assert f["lm_head"] == 2 * 2 * 8 * 10 * (s - prompt)
    assert f["total"] == f["linear"] + f["attention"] + f["lm_head"]
