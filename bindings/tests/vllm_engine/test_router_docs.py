"""docs/router.md's ``vllm serve`` lines, through vLLM 0.32's own argument parser: each
publishes vLLM's KV events (ZMQ, with a replay socket) on the endpoints the documented
``kvtier-router`` line subscribes to, with the block size the router is given. (The router
line itself and the ``curl`` lines run in router/tests/service/docs.rs.)"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import MODEL  # noqa: E402


def test_the_docs_vllm_serve_lines_publish_where_the_router_subscribes(tmp_path):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = Path(__file__).resolve().parents[3]
    lines = (root / "docs" / "router.md").read_text().splitlines()
    serves = [ln for ln in lines if ln.startswith("vllm serve ")]
    (router,) = [ln for ln in lines if ln.startswith("kvtier-router ")]
    assert len(serves) == 2
    rargv = shlex.split(router)
    subs = [dict(kv.split("=", 1) for kv in rargv[i + 1].split(",")) for i, a in enumerate(rargv)
            if a == "--instance"]
    page = int(rargv[rargv.index("--page-size") + 1])
    (tmp_path / "config.json").write_text(json.dumps(MODEL))  # the model swapped for a local config
    for line, sub in zip(serves, subs):
        argv = shlex.split(line)
        at = argv.index("--port")
        port_arg = argv[at + 1]
        engine_argv = argv[3:at] + argv[at + 2:]  # --port is the HTTP server's, not the engine's
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", str(tmp_path), *engine_argv]))
        ev = args.kv_events_config
        assert ev.enable_kv_cache_events and ev.publisher == "zmq"
        port = lambda ep: ep.rsplit(":", 1)[1]  # noqa: E731
        assert port(ev.endpoint) == port(sub["events"]) and port(ev.replay_endpoint) == port(sub["replay"])
        assert args.block_size == page
        assert sub["url"].endswith(":" + port_arg)
