"""Deprecated location of the benchmark helpers: they live in `hf_gptoss_rl.testing`; import them from there.

Kept only until `benchmarks/learning_run.py` and its tests import `hf_gptoss_rl.testing` directly.
"""

from hf_gptoss_rl.testing import (  # noqa: F401
    DIRECT_KERNEL_ATTENTION,
    SINK_DROPPING_ATTENTION,
    build_random_gptoss,
    direct_sink_kernel_attention,
    eager_attention_without_sinks,
    environment,
    flash_attention_4_available,
    fmt,
    register_sink_dropping_attention,
    set_project_attention,
    setup_project_attention,
)
from hf_gptoss_rl.attention import import_kernel_sources as _import_kernel_sources  # noqa: F401
