"""docs/vllm.md is what runs: its ``vllm serve`` line parsed by vLLM's own argument parser
into vLLM's ``KVTransferConfig`` and built through vLLM's factories into a working engine;
the short names of kvtier's ``vllm.general_plugins`` entry point; the page's Python
snippets (also run by bindings/tests/test_docs_snippets.py in the main venv)."""

from __future__ import annotations

import copy
import pathlib
import re
import shlex
import uuid

import pytest
from harness import BLOCK, Engine, model_dir
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from kvtier.vllm import KvtierFreqDepthPolicy, KvtierSecondaryTier

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def documented_serve_line() -> list:
    text = DOC.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm serve ")]
    assert len(lines) == 1, "docs/vllm.md shows one launch command"
    return shlex.split(lines[0])


def parse(argv, model_path: str, monkeypatch) -> "EngineArgs":
    """``vllm serve MODEL ARGS`` through vLLM's own parser (``EngineArgs.add_cli_args``),
    with the model swapped for a local config (no hub here). vLLM's parser builds default
    configs that ask the platform for its device type, which a CPU box with vLLM's CUDA
    build does not report: the test says "cpu", as DeviceConfig("cpu") does elsewhere."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    assert argv[:2] == ["vllm", "serve"] and not argv[2].startswith("-")
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", model_path, *argv[3:]]))


def small(kv, tmp_path):
    """The documented config with its sizes made to fit a test box (and a fresh engine id)."""
    kv = copy.deepcopy(kv)
    ex = kv.kv_connector_extra_config
    ex["cpu_bytes_to_use"] = 1 << 22
    for t in ex["secondary_tiers"]:
        t["segment_bytes"], t["ssd_dir"], t["name"] = "64MB", str(tmp_path / "ssd"), uuid.uuid4().hex
    kv.engine_id = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    return kv


def test_the_documented_launch_command_builds_a_working_engine(tmp_path, monkeypatch):
    args = parse(documented_serve_line(), model_dir(str(tmp_path)), monkeypatch)
    kv = args.kv_transfer_config
    assert kv.kv_connector == "OffloadingConnector" and kv.kv_role == "kv_both"
    assert kv.kv_connector_extra_config["secondary_tiers"][0]["module_path"] == "kvtier.vllm"
    cfg = small(kv, tmp_path)
    e = Engine(str(tmp_path), [], kv_config=cfg)
    try:
        assert isinstance(e.tier, KvtierSecondaryTier) and e.bpc == 64 // BLOCK
        assert isinstance(e.manager.primary_tier._policy, KvtierFreqDepthPolicy)
        prompt = list(range(300, 300 + 4 * 64 + 5))
        e.add("a", prompt)
        e.run()
        assert e.tier.counters.chunks_stored == 4
    finally:
        e.close()
    e2 = Engine(str(tmp_path), [], kv_config=fresh_engine_id(cfg))
    try:
        e2.add("b", prompt)
        e2.run()
        assert e2.finished["b"].external_tokens == 4 * 64 and e2.finished["b"].gpu_ok
    finally:
        e2.close()


def fresh_engine_id(kv):
    kv = copy.deepcopy(kv)
    kv.engine_id = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    return kv


def test_short_names_from_the_entry_point(tmp_path):
    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvtier.vllm import plugin

    load_general_plugins()
    plugin.register()  # vLLM may load plugins again: no double-registration error
    assert SecondaryTierFactory.get_tier_class({"type": "kvtier"}) is KvtierSecondaryTier
    assert CachePolicyFactory.get_cache_policy_cls("kvtier-freq-depth") is KvtierFreqDepthPolicy
    e = Engine(str(tmp_path), [{"type": "kvtier", "segment_bytes": "64MB"}], policy="kvtier-lru")
    try:
        assert isinstance(e.tier, KvtierSecondaryTier)
    finally:
        e.close()


FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("i", range(len(FENCE.findall(DOC.read_text(encoding="utf-8")))))
def test_doc_snippets_run_with_vllm_installed(i):
    code = FENCE.findall(DOC.read_text(encoding="utf-8"))[i]
    exec(compile(code, f"docs/vllm.md snippet {i}", "exec"), {"__name__": "__snippet__"})
