"""A P (prefill) rank of ``aiolayer bench scale``, run as
``python -m aiolayer.bench.scenarios.scale.rank RANK CONFIG``.

It fills a paged KV cache with its local heads of the global seeded KV (``model.kv_layer``), starts
its own Runtime (Mooncake over TCP), freezes its start-up heap out of the garbage collector's passes
as vLLM's engine core and GPU workers do after warm-up (unless ``gc_freeze`` is off), prints
``SCALE {"kind": "ready", "control": ...}``, reads the path of its plan (a msgspec JSON list of
``PlanItem``) from stdin, begins ONE step with every transfer, marks every layer ready at once, waits
for every outcome (bounded by ``wait_s``) and prints a ``summary`` line (with the process's and the
loop thread's CPU seconds during the stream).
Then, once D verified, lines "METHOD PATH" (PATH: D's layouts): for each it pushes the same spans
with Mooncake alone that way (``raw.METHODS``) and prints a ``raw`` line.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import msgspec

from aiolayer import Runtime, TransferSpec
from aiolayer.config import NodeConfig, Timeouts
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol.plan import HeadGeometry

from .model import PlanItem, ScaleConfig, kv_layer, rank_heads, request_blocks
from .raw import METHODS, RawLayout, raw_batches

# layout_fetch: every transfer asks D for its layout at once; on a loaded host D answers 2,000 of them slowly
P_TIMEOUTS = Timeouts(control_call=5.0, layout_fetch=60.0, layer_write=60.0, done_delivery=30.0, quarantine=60.0)


# --- a P rank (child process) -----------------------------------------------------------------------

def _say(**msg) -> None:
    sys.stdout.write("SCALE " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def rank_main(rank: int, cfg: ScaleConfig) -> int:
    """Fill the local heads, start the runtime, say ready; read the plan path; stream; report."""
    t0 = time.perf_counter()
    heads = rank_heads(cfg.kv_heads, cfg.p_tp, rank)
    shape = cfg.shape(len(heads), cfg.total_blocks)
    cache = PagedKVCache(shape)
    for layer in range(cfg.num_layers):
        cache.blocks[layer] = kv_layer(cfg, heads, range(cfg.total_blocks), layer)
    rt = Runtime(NodeConfig(engine_id=f"scale-p{rank}"), P_TIMEOUTS).start()
    try:
        rt.register_kv_memory(cache.k_base, cache.v_base, shape.block_bytes, shape.num_blocks, kv_heads=len(heads),
                          geometry=HeadGeometry(cfg.block_size, cfg.head_bytes, cfg.layout))
        if cfg.gc_freeze:   # vLLM's engine core and GPU workers freeze theirs after warm-up (freeze_gc_heap)
            gc.collect()
            gc.freeze()   # else every full pass walks the interpreter's and libraries' start-up objects again
        _say(kind="ready", rank=rank, control=rt.control_endpoint, setup_s=round(time.perf_counter() - t0, 3))
        line = sys.stdin.readline().strip()
        if not line:
            return 2   # the driver went away
        items = msgspec.json.decode(Path(line).read_bytes(), type=list[PlanItem])
        specs = [TransferSpec.from_registration(it, src_blocks=request_blocks(cfg, it.request), peer=it.peer,
                                                route=it.route) for it in items]
        _say(kind="summary", rank=rank, **_stream(rt, cfg, specs, rank))
        batches = None
        while line := sys.stdin.readline().strip():   # "METHOD PATH-OF-D's-LAYOUTS": raw Mooncake, same spans
            method, path = line.split(" ", 1)
            if batches is None:
                layouts = msgspec.json.decode(Path(path).read_bytes(), type=list[RawLayout])
                batches = raw_batches(cfg, items, {x.d_rank: x for x in layouts}, cache.k_base, cache.v_base,
                                      len(heads))
            engine = rt.backend._engine   # noqa: SLF001 - raw Mooncake through the runtime's own engine
            _say(kind="raw", rank=rank, method=method, **METHODS[method][0](engine, batches))
    finally:
        rt.stop()
    return 0


def _stream(rt: Runtime, cfg: ScaleConfig, specs: list[TransferSpec], rank: int) -> dict:
    """One step with every transfer, every layer ready at once; every outcome, bounded by wait_s."""
    backend = rt.backend
    loop_clock = time.pthread_getcpuclockid(rt.loop_thread.ident)
    gc_s = _GcClock()
    cpu0, loop0 = time.process_time(), time.clock_gettime(loop_clock)
    t_begin = time.perf_counter()
    with rt.begin_step(specs) as step:
        for layer in range(cfg.num_layers):
            step.layer_ready(layer)
    outcomes: dict = {}
    peak_active = peak_writes = 0
    last_note = t_begin
    while len(outcomes) < len(specs) and time.perf_counter() - t_begin < cfg.wait_s:
        time.sleep(0.02)
        outcomes.update((o.transfer_id, o) for o in rt.pop_outcomes())
        peak_active = max(peak_active, rt.sender.active)   # an internal counter, read for the report
        writes = _writes_in_flight(backend)
        peak_writes = max(peak_writes, writes)
        if time.perf_counter() - last_note > 1.0:
            last_note = time.perf_counter()
            _say(kind="progress", rank=rank, done=len(outcomes), total=len(specs), writes=writes)
    cpu_s, loop_cpu_s = time.process_time() - cpu0, time.clock_gettime(loop_clock) - loop0
    gc_s.stop()
    failed = {tid: o.reason for tid, o in outcomes.items() if not o.ok}
    return {"specs": len(specs), "ok": len(outcomes) - len(failed), "failed": len(failed),
            "lost": len(specs) - len(outcomes), "bytes": sum(o.bytes for o in outcomes.values()),
            "t_begin": t_begin, "t_end": max((o.finished_s for o in outcomes.values()), default=t_begin),
            "peak_active": peak_active, "peak_backend_writes": peak_writes,
            "writes_submitted": getattr(backend, "runs_submitted", 0),
            "peak_runs_per_target": getattr(backend, "peak_runs_per_target", None),
            "backend_writes": getattr(backend, "writes_started", None),   # write calls (groups of runs)
            "done_batches": rt.sender.dones.batches,   # frames that carried several DONEs to one D
            "dones_batched": rt.sender.dones.batched,  # the DONEs they carried (the rest went alone)
            "layout_batches": rt.layouts.batches,      # LayoutBatch frames (a pass's layout requests to one D)
            "layouts_batched": rt.layouts.batched,     # the layout requests they carried
            "cpu_s": round(cpu_s, 3), "loop_cpu_s": round(loop_cpu_s, 3), "gc_s": round(gc_s.seconds, 3),
            "gc_collections": gc_s.collections,
            "finished": {tid: o.finished_s for tid, o in outcomes.items()},
            "reasons": dict(list(failed.items())[:20])}


class _GcClock:
    """CPU seconds (of the collecting thread) the cyclic garbage collector ran, and its collections by
    generation: allocation-heavy paths pay it."""

    def __init__(self) -> None:
        self.seconds, self._t0, self.collections = 0.0, 0.0, [0, 0, 0]
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._t0
            self.collections[info["generation"]] += 1

    def stop(self) -> None:
        gc.callbacks.remove(self._tick)


def _writes_in_flight(backend) -> int:
    value = getattr(backend, "inflight", None)   # Mooncake: submitted runs not yet settled
    return int(value) if value is not None else len(getattr(backend, "_inflight", ()))


if __name__ == "__main__":
    sys.exit(rank_main(int(sys.argv[1]), msgspec.json.decode(Path(sys.argv[2]).read_bytes(), type=ScaleConfig)))
