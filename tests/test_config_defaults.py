"""Each setting is defined once: the flat `AgenticGRPOConfig` fields that configure a component take their defaults
from it, and one builder per component (`trl_ext.trainer_args`) carries every such field to it.

The components: `WeightSyncConfig` (its dataclass defaults), `SGLangEngine` and `AgentLoop` (their keyword
defaults, written in `trl_ext.rollout.settings`) and harmony's `render_prompt` (`reasoning_effort`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
from pathlib import Path

import pytest

from hf_gptoss_rl.harmony import render_prompt
from trl_ext import AgenticGRPOConfig
from trl_ext.rollout import AgentLoop, SGLangEngine
from trl_ext.trainer_args import agent_loop_kwargs, harmony_kwargs, sglang_engine_kwargs, weight_sync_config
from trl_ext.weight_sync import WeightSyncConfig

REPO = Path(__file__).resolve().parents[1]
MODEL_CONFIG = object()  # what the trainer passes: the policy's config, written next to disk-synced weights


def build(component: str, args) -> dict:
    """The keywords `component` receives from the config, as the trainer builds it."""
    if component == "weight_sync":
        return dataclasses.asdict(weight_sync_config(args, MODEL_CONFIG)) | {"model_config": MODEL_CONFIG}
    return {"sglang": sglang_engine_kwargs, "agent_loop": agent_loop_kwargs, "harmony": harmony_kwargs}[component](args)


def component_defaults(component: str) -> dict:
    """What each component uses when a keyword is not given."""
    if component == "weight_sync":
        return {f.name: f.default for f in dataclasses.fields(WeightSyncConfig)}
    function = {"sglang": SGLangEngine.__init__, "agent_loop": AgentLoop.__init__, "harmony": render_prompt}[component]
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


# (flat field, component, the component's keyword, a value other than the default, what the component then gets)
MAPPING = [
    ("weight_sync_mode", "weight_sync", "mode", "tensor", "tensor"),
    ("weight_sync_verify", "weight_sync", "verify", ["logprobs"], ("version", "logprobs")),
    ("weight_sync_checkpoint", "weight_sync", "checkpoint_path", "/served/ckpt", "/served/ckpt"),
    ("weight_sync_pause_mode", "weight_sync", "pause_mode", "none", None),
    ("weight_sync_dir", "weight_sync", "weight_dir", "/shared/weights", "/shared/weights"),
    ("weight_sync_bucket_mb", "weight_sync", "bucket_bytes", 3, 3 << 20),
    ("weight_sync_master_address", "weight_sync", "dist_master_address", "10.1.2.3", "10.1.2.3"),
    ("weight_sync_master_port", "weight_sync", "dist_master_port", 29511, 29511),
    ("weight_sync_probe_atol", "weight_sync", "probe_atol", 0.25, 0.25),
    ("weight_sync_probe_rtol", "weight_sync", "probe_rtol", 0.125, 0.125),
    ("weight_sync_probe_margin", "weight_sync", "probe_margin", 5.5, 5.5),
    ("sglang_urls", "sglang", "base_urls", ["http://b:2", "http://c:3"], ["http://b:2", "http://c:3"]),
    ("sglang_api_key", "sglang", "api_key", "secret", "secret"),
    ("sglang_timeout_s", "sglang", "timeout_s", 11.0, 11.0),
    ("sglang_retry_deadline_s", "sglang", "retry_deadline_s", 12.0, 12.0),
    ("sglang_ready_timeout_s", "sglang", "ready_timeout_s", 13.0, 13.0),
    ("sglang_log_every_s", "sglang", "log_every_s", 14.0, 14.0),
    ("rollout_concurrency", "sglang", "max_concurrency", 7, 7),
    ("rollout_concurrency", "agent_loop", "max_concurrency", 7, 7),
    ("max_turns", "agent_loop", "max_turns", 5, 5),
    ("max_completion_length", "agent_loop", "max_completion_tokens", 40, 40),
    ("max_tool_output_chars", "agent_loop", "max_tool_output_chars", 100, 100),
    ("tool_timeout_s", "agent_loop", "tool_timeout_s", 2.5, 2.5),
    ("reasoning_effort", "harmony", "reasoning_effort", "high", "high"),
]
# Component keywords whose value is not a flat default: the policy's config, the output folder, TRL's field (whose
# default is TRL's; `AgentLoop`'s own is for standalone use), the required URLs, the key (from the environment).
NOT_DEFAULTS = {
    ("weight_sync", "model_config"),
    ("weight_sync", "weight_dir"),
    ("agent_loop", "max_completion_tokens"),
    ("sglang", "base_urls"),
}
# flat fields of the components that reach something else than the built component
ELSEWHERE = {"weight_sync_lora"}  # what the trainer pushes (merged weights or the adapter): test_sglang_client


def sglang_args(config_class=AgenticGRPOConfig, **overrides):
    kwargs = dict(output_dir="/tmp/out", use_cpu=True, bf16=False, report_to="none", max_completion_length=64)
    kwargs |= dict(rollout_backend="sglang", sglang_urls=["http://a:1"])
    return config_class(**(kwargs | overrides))


def default_mismatches(config_class) -> list[str]:
    """Every component keyword whose value, built from a config left at its defaults, differs from the component's
    own default."""
    args = sglang_args(config_class)
    found = []
    for component in sorted({c for _, c, *_ in MAPPING}):
        defaults, built = component_defaults(component), build(component, args)
        for key in sorted(set(built) & set(defaults)):
            if (component, key) not in NOT_DEFAULTS and built[key] != defaults[key]:
                found.append(f"{component}.{key}: from the config {built[key]!r}, the component's {defaults[key]!r}")
    return found


def test_flat_defaults_are_the_components_defaults(monkeypatch):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    assert default_mismatches(AgenticGRPOConfig) == []
    # the derived ones: the disk sync's folder under output_dir, the turn limit when TRL's is unset
    args = sglang_args()
    assert weight_sync_config(args, None).weight_dir == os.path.join("/tmp/out", "rollout_weights")
    assert args.max_tool_calling_iterations is None and args.max_turns == component_defaults("agent_loop")["max_turns"]


@pytest.mark.parametrize(
    ("field", "value", "component_key"),
    [
        ("weight_sync_probe_margin", 4.0, "weight_sync.probe_margin"),
        ("weight_sync_bucket_mb", 512, "weight_sync.bucket_bytes"),
        ("sglang_retry_deadline_s", 60.0, "sglang.retry_deadline_s"),
        ("rollout_concurrency", 32, "agent_loop.max_concurrency"),
        ("reasoning_effort", "low", "harmony.reasoning_effort"),
    ],
)
def test_a_changed_flat_default_is_caught(monkeypatch, field, value, component_key):
    """Positive control: a config whose default drifted from its component's is reported, naming the keyword."""
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    annotation = next(f.type for f in dataclasses.fields(AgenticGRPOConfig) if f.name == field)
    drifted = dataclasses.make_dataclass(
        "Drifted", [(field, annotation, dataclasses.field(default=value))], bases=(AgenticGRPOConfig,)
    )
    found = default_mismatches(drifted)
    assert [f.split(":")[0] for f in found if f.startswith(component_key)] == [component_key], found


def test_every_mapped_field_reaches_its_component(monkeypatch):
    """Each flat field, set alone to a value other than its default, arrives at its keyword and changes no other."""
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    baseline = {component: build(component, sglang_args()) for _, component, *_ in MAPPING}
    wrong = []
    for field, component, key, value, expected in MAPPING:
        built = build(component, sglang_args(**{field: value}))
        changed = sorted(k for k in built if built[k] != baseline[component][k])
        if built.get(key) != expected or changed != [key]:
            wrong.append(f"{field}={value!r}: {component}.{key} got {built.get(key)!r}, changed {changed}")
    assert not wrong, "\n".join(wrong)


def test_every_component_field_is_mapped():
    """A new `weight_sync_*` / `sglang_*` field must be carried by a builder (and listed above)."""
    flat = {f.name for f in dataclasses.fields(AgenticGRPOConfig) if f.name.startswith(("weight_sync_", "sglang_"))}
    assert flat - ELSEWHERE == {field for field, *_ in MAPPING if field.startswith(("weight_sync_", "sglang_"))}


def _literal(node: ast.AST) -> bool:
    """A value written out (`64`, `1 << 30`, `"medium"`), not a name; None ("unset") is not a duplicated value."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return all(_literal(child) for child in ast.iter_child_nodes(node) if not isinstance(child, ast.operator))
    return False


def written_defaults(path: Path, owner: str, names: set[str]) -> dict[str, str]:
    """{name: source} of the defaults written as literals, of the fields (a class `owner`'s `field(default=...)`
    or plain assignments) or keywords (of `owner`'s `__init__`, or of the function `owner`) named in `names`."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == owner)
    found = {}
    if isinstance(node, ast.ClassDef) and not any(
        isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body
    ):
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and stmt.target.id in names and stmt.value is not None:
                value = stmt.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                if value is not None and _literal(value):
                    found[stmt.target.id] = ast.unparse(value)
        return found
    if isinstance(node, ast.ClassDef):
        node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    arguments = node.args
    positional = arguments.posonlyargs + arguments.args
    pairs = list(zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults))
    pairs += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None]
    return {a.arg: ast.unparse(d) for a, d in pairs if a.arg in names and _literal(d)}


def duplicated_defaults() -> list[str]:
    """Literal defaults outside their one owner (`WeightSyncConfig`, `trl_ext.rollout.settings`, harmony's
    constants): in the flat fields, and in the keyword defaults of `SGLangEngine`, `AgentLoop` and `render_prompt`."""
    flat = {field for field, *_ in MAPPING}
    where = [
        ("trl_ext/config.py", "AgenticGRPOConfig", flat),
        ("trl_ext/rollout/sglang.py", "SGLangEngine", {k for _, c, k, *_ in MAPPING if c == "sglang"}),
        ("trl_ext/rollout/agent_loop.py", "AgentLoop", {k for _, c, k, *_ in MAPPING if c == "agent_loop"}),
        ("hf_gptoss_rl/harmony.py", "render_prompt", {"reasoning_effort"}),
    ]
    found = []
    for path, owner, names in where:
        for name, source in written_defaults(REPO / path, owner, names - {key for _, key in NOT_DEFAULTS}).items():
            found.append(f"{path}: {owner}.{name} = {source}")
    return found


def test_no_default_is_written_twice():
    found = duplicated_defaults()
    assert not found, "write these defaults once, where the component owns them:\n  " + "\n  ".join(found)


def test_a_written_out_default_is_caught(tmp_path, monkeypatch):
    """Positive control: the scan reports a literal default, in a field (plain and with `field(...)`, a computed
    one too) and in a keyword."""
    source = (
        "@dataclass\nclass AgenticGRPOConfig:\n"
        "    weight_sync_bucket_mb: int = field(default=1 << 10, metadata={})\n"
        "    sglang_timeout_s: float = 600.0\n"
        "    weight_sync_probe_atol: float = field(default=WeightSyncConfig.probe_atol)\n"
        "    sglang_api_key: str | None = field(default=None)\n"
        "class AgentLoop:\n"
        "    def __init__(self, engine, tools=None, *, max_turns=MAX_TURNS, tool_timeout_s=30.0):\n"
        "        pass\n"
    )
    (tmp_path / "config.py").write_text(source)
    fields = written_defaults(tmp_path / "config.py", "AgenticGRPOConfig", {field for field, *_ in MAPPING})
    assert fields == {"weight_sync_bucket_mb": "1 << 10", "sglang_timeout_s": "600.0"}
    keywords = written_defaults(tmp_path / "config.py", "AgentLoop", {"max_turns", "tool_timeout_s"})
    assert keywords == {"tool_timeout_s": "30.0"}


def documented_default_mismatches(doc: str) -> tuple[int, list[str]]:
    """(how many "name (`type`, defaults to `X`)" the docstring holds, those whose X is not the field's default)."""
    fields = {f.name: f for f in dataclasses.fields(AgenticGRPOConfig)}
    stated = re.findall(r"(\w+) \(`[^`]+`, (?:\*optional\*, )?defaults to `([^`]+)`\)", doc)
    wrong = []
    for name, text in stated:
        field = fields[name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if ast.literal_eval(text) != default:
            wrong.append(f"{name}: documented {text}, default {default!r}")
    return len(stated), wrong


def test_documented_defaults_match():
    """The config's docstring states defaults (for TRL-style help); each is the field's default."""
    doc = inspect.getdoc(AgenticGRPOConfig)
    count, wrong = documented_default_mismatches(doc)
    assert count >= 25 and not wrong, wrong
    # positive control: a stale number in the text is reported
    stale = doc.replace(
        "weight_sync_bucket_mb (`int`, defaults to `1024`)", "weight_sync_bucket_mb (`int`, defaults to `512`)"
    )
    assert documented_default_mismatches(stale)[1] == ["weight_sync_bucket_mb: documented 512, default 1024"]
