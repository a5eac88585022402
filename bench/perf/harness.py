"""One benchmark set-up and one request of any mode: the same shape, the same seeded bytes, the same D.

D is an ``aiolayer node`` child process (or in-process for the memory backend); P is this process:
an aiolayer ``Runtime``, a paged KV cache for one request, the simulated forward and, when the modes
need them, a Mooncake engine of its own (threaded, raw_mooncake), a TCP sink process (raw_tcp) and a
copy target (memcpy). Every request's bytes are distinct (salted by the request) and are checked at
the receiver by CRC32 per layer's K and V against what was meant to be written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import time

import numpy as np

from aiolayer.backends.mooncake_poll import POLL_TICK_S
from aiolayer.config import KVShape, NodeConfig, Timeouts
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import merge_runs, run_addresses, use_layerwise
from aiolayer.transport import Transport
from aiolayer.harness.node import NodeProcess

from .forward import RequestKV, SimulatedForward, expected_crcs, seeded_kv
from .raw import (MOONCAKE_VARIANTS, ComputeLoad, TcpSinkProcess, busy_seconds, chunk_crcs, memcpy,
                  mooncake_forward_paced, mooncake_paced, timed)

AIO_MODES = ("layerwise", "bulk", "auto", "checked")
LIMIT_MODES = ("raw_mooncake", "raw_tcp", "memcpy")
MODES = ("layerwise", "bulk", "auto", "checked", "threaded", *LIMIT_MODES)
NEEDS_MOONCAKE = ("threaded", "raw_mooncake")
TCP_STREAMS = (1, 4)
_RAW_SALT = 1 << 32    # raw variants' bytes never repeat an earlier request's bytes in D's reused blocks


class Harness:
    def __init__(self, p_shape: KVShape, d_shape: KVShape, args, modes, device_cpus: set[int] | None = None) -> None:
        self.p_shape, self.d_shape, self.args, self.modes = p_shape, d_shape, args, list(modes)
        self.device_cpus = device_cpus   # the forward's "accelerator" CPUs; the caller runs on the host ones
        self.node = self.runtime = self.direct = self.threaded = self.sink = None
        self.step = 0
        self._layout: m.LayoutReply | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify")
        self._layer_period = (args.layer_ms + 1.0) / 1e3   # refined by every layer-wise request

    def __enter__(self) -> "Harness":
        try:
            self._open()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _open(self) -> None:
        from aiolayer import DecodeNode, Runtime

        args, p = self.args, self.p_shape
        bind_host = getattr(args, "bind_host", "")
        if getattr(args, "d_control", ""):   # --two-hosts' P side: D runs in the other namespace
            self.d_control = args.d_control
        elif args.backend == "mooncake":
            self.node = NodeProcess(self.d_shape, backend="mooncake").start()
            self.d_control = self.node.control
        else:
            self.node = DecodeNode(self.d_shape, NodeConfig(engine_id="bench-d", backend="memory")).start()
            self.d_control = self.node.control_endpoint
        transport = {"transport": Transport(bind_host=bind_host)} if bind_host else {}
        self.runtime = Runtime(NodeConfig(engine_id="bench-p", backend=args.backend, **transport), Timeouts()).start()
        self.cache = PagedKVCache(p)
        self.runtime.register_kv_memory(self.cache.k_base, self.cache.v_base, p.block_bytes, p.num_blocks,
                                        host_memory=True)
        self.forward = SimulatedForward(self.cache, args.layer_ms, cpus=self.device_cpus)
        self.base_kv = seeded_kv(p.num_layers, p.num_blocks, p.block_bytes, args.seed)
        self.kv_buf = np.zeros_like(self.base_kv)
        if any(mode in self.modes for mode in NEEDS_MOONCAKE):
            from .threaded import DirectEngine, ThreadedConnector

            self.direct = DirectEngine(bind_host or "127.0.0.1")
            self.direct.register(self.cache.buffer.ctypes.data, self.cache.buffer.nbytes)
            if "threaded" in self.modes:
                self.threaded = ThreadedConnector(self.direct, "bench-p-threaded", self.cache.k_base,
                                                  self.cache.v_base, p.block_bytes)
        if "raw_tcp" in self.modes:
            self.sink = TcpSinkProcess(max(TCP_STREAMS))
            self.sink.prepare(self.cache.buffer.nbytes)
        if "memcpy" in self.modes:
            self.copy_dst = np.zeros_like(self.cache.buffer)

    def __exit__(self, *exc) -> None:
        interrupted: BaseException | None = None
        for close in (getattr(getattr(self, "forward", None), "close", None), getattr(self.threaded, "close", None),
                      getattr(self.sink, "close", None), getattr(self.runtime, "stop", None),
                      getattr(self.direct, "close", None), getattr(self.node, "stop", None), self._pool.shutdown):
            if close is not None:
                try:
                    close()
                except Exception as error:  # noqa: BLE001 - go on closing the rest
                    print(f"bench clean-up: {error!r}", file=sys.stderr)
                except (KeyboardInterrupt, SystemExit) as stop:   # a second Ctrl-C: the rest still stop first
                    interrupted = interrupted or stop
        if interrupted is not None:
            raise interrupted

    # --- one request ---------------------------------------------------------------------------

    def run_request(self, mode: str) -> dict:
        self.step += 1
        if mode in AIO_MODES or mode == "threaded":
            return self._prefill_request(mode)
        return {"raw_mooncake": self._raw_mooncake, "raw_tcp": self._raw_tcp, "memcpy": self._memcpy}[mode]()

    def _kv(self, index: int) -> RequestKV:
        return RequestKV(self.base_kv, index, out=self.kv_buf)

    def _new_transfer(self, mode: str) -> tuple[str, m.AllocReply]:
        tid = f"bench-{mode}-{self.step}"
        alloc = self.runtime.request(self.d_control, m.AllocRequest(
            transfer_id=tid, num_blocks=self.p_shape.num_blocks, contiguous=not self.args.scatter))
        return tid, alloc

    def _verify(self, tid: str, kv: RequestKV) -> bool:
        """D's per-layer CRC32s of K and V == those of the bytes the request meant to write.

        D's bytes can only have come from P's cache, so this also checks what the forward wrote. D
        computes its CRCs (in its process) while P computes the expected ones.
        """
        fut = self._pool.submit(self.runtime.request, self.d_control, m.VerifyRequest(transfer_id=tid), 60)
        expect_k, expect_v = expected_crcs(kv)
        reply = fut.result(90)
        return reply.crc_k == expect_k and reply.crc_v == expect_v

    def _release(self, tid: str) -> None:
        try:
            self.runtime.request(self.d_control, m.ReleaseRequest(transfer_id=tid))
        except Exception as exc:  # noqa: BLE001 - a failed release is reported, the run goes on
            print(f"release of {tid} failed: {exc}", file=sys.stderr)

    def _prefill_request(self, mode: str) -> dict:
        from aiolayer import TransferSpec

        tid, alloc = self._new_transfer(mode)
        src = list(range(self.p_shape.num_blocks))
        kv = self._kv(self.step)
        layerwise = mode != "auto" or use_layerwise(self.args.prompt_tokens, self.args.auto_min_tokens)
        spec = TransferSpec.from_registration(alloc, src_blocks=src, peer=self.d_control, layerwise=layerwise)
        # "checked": layer-wise with the end-to-end integrity check on every transfer; the other modes
        # without it, so that their rows are the transfer alone and the difference is its cost
        self.runtime.set_integrity_sample(1.0 if mode == "checked" else 0.0)
        if mode == "threaded":
            connector, cpu_clock = self.threaded, self.threaded.sender_cpu_s
        else:
            connector, cpu_clock = self.runtime, self._loop_cpu_s
        cpu0 = cpu_clock()
        timing = self.forward.run(connector, [spec], kv, src, "after" if mode == "bulk" else "per_layer")
        outcome = connector.wait_outcome(tid, timeout=120)
        cpu = cpu_clock() - cpu0
        verified = outcome.ok and self._verify(tid, kv)
        self._release(tid)
        sample = prefill_sample(outcome, timing, verified, cpu)
        if mode == "layerwise":  # the pace raw_mooncake's per_layer_paced variant replays
            self._layer_period = (timing["t_forward_end"] - timing["t0"]) / self.p_shape.num_layers
        if mode == "auto":
            sample["choice"] = "layerwise" if layerwise else "bulk"
        return sample

    def _loop_cpu_s(self) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(self.runtime.loop_thread.ident))

    # --- the limits ----------------------------------------------------------------------------

    def _d_layout(self, alloc: m.AllocReply) -> m.LayoutReply:
        if self._layout is None:
            self._layout = self.runtime.request(self.d_control, m.LayoutRequest(
                requester="bench-raw", transfer_id=alloc.transfer_id, token=alloc.token))
        return self._layout

    def _fill(self, variant: int) -> RequestKV:
        kv = self._kv(_RAW_SALT + self.step * 8 + variant)
        np.copyto(self.cache.blocks, kv.data)
        return kv

    def _raw_mooncake(self) -> dict:
        tid, alloc = self._new_transfer("raw_mooncake")
        layout, bb = self._d_layout(alloc), self.p_shape.block_bytes
        runs = merge_runs(range(self.p_shape.num_blocks), alloc.block_ids)
        src, dst, lens = [], [], []
        k_base, v_base = self.cache.k_base, self.cache.v_base
        for layer in range(self.p_shape.num_layers):
            for mine, theirs in ((k_base[layer], layout.layers[layer].k_base),
                                 (v_base[layer], layout.layers[layer].v_base)):
                s, d, n = run_addresses(runs, mine, theirs, bb)
                src += s.tolist()
                dst += d.tolist()
                lens += n.tolist()
        engine, session, layers = self.direct.engine, layout.session, self.p_shape.num_layers
        plan = [(name, True, False, lambda _kv, fn=fn: fn(engine, session, src, dst, lens))
                for name, fn in MOONCAKE_VARIANTS.items()]
        if self.args.raw_under_compute:   # diagnostics, not ceilings
            runs, blocks = (src, dst, lens), list(range(self.p_shape.num_blocks))
            plan += [
                ("submit_poll+compute", False, True,
                 lambda _kv: MOONCAKE_VARIANTS["submit_poll"](engine, session, src, dst, lens)),
                ("per_layer_paced", False, True,
                 lambda _kv: mooncake_paced(engine, session, runs, layers, self._layer_period)),
                # the forward rewrites, as it goes, the same bytes _fill put in the cache
                ("per_layer_1ms", False, False,
                 lambda kv: mooncake_forward_paced(engine, session, runs, layers, self.forward, kv, blocks,
                                                   POLL_TICK_S)),
            ]
        variants, verified = {}, True
        for k, (name, ceiling, loaded, push) in enumerate(plan):
            kv = self._fill(k)
            with ComputeLoad(self.device_cpus) if loaded else contextlib.nullcontext():
                secs, cpu, busy = timed(push, kv)
            secs = busy if busy is not None else secs     # paced: only the time writes were in flight
            verified = self._verify(tid, kv) and verified
            variants[name] = {"s": secs, "cpu_s": cpu, "ceiling": ceiling}
        self.runtime.request(self.d_control, m.Done(transfer_id=tid, sender="bench-raw", incarnation=alloc.incarnation,
                                                     layers=self.p_shape.num_layers, bytes=int(sum(lens)),
                                                     token=alloc.token))
        self._release(tid)
        return limit_sample(variants, verified, int(sum(lens)))

    def _raw_tcp(self) -> dict:
        chunk, variants, verified = self.p_shape.layer_bytes, {}, True
        for k, streams in enumerate(TCP_STREAMS):
            kv = self._fill(k)
            cpu0 = time.process_time()
            secs, crcs = self.sink.push(self.cache.buffer, chunk, streams)
            cpu = time.process_time() - cpu0
            verified = crcs == chunk_crcs(kv.data, chunk) and verified
            variants[f"{streams}_stream{'s' if streams > 1 else ''}"] = {"s": secs, "cpu_s": cpu, "ceiling": True}
        return limit_sample(variants, verified, self.cache.buffer.nbytes)

    def _memcpy(self) -> dict:
        kv = self._fill(0)
        secs, cpu, _ = timed(memcpy, self.copy_dst, self.cache.buffer)
        verified = chunk_crcs(self.copy_dst, self.p_shape.layer_bytes) == chunk_crcs(kv.data, self.p_shape.layer_bytes)
        return limit_sample({"numpy_copyto": {"s": secs, "cpu_s": cpu, "ceiling": True}}, verified,
                            self.cache.buffer.nbytes)


# --- samples -----------------------------------------------------------------------------------------

def prefill_sample(outcome, timing: dict, verified: bool, cpu_s: float) -> dict:
    t0 = timing["t0"]
    busy = busy_seconds([(lt.submitted_s, lt.landed_s) for lt in outcome.layers])
    return {
        "ok": outcome.ok, "reason": outcome.reason, "verified": verified, "bytes": outcome.bytes,
        "ttft_ms": (outcome.finished_s - t0) * 1e3,
        "exposed_ms": (outcome.finished_s - timing["t_forward_end"]) * 1e3,
        "forward_ms": (timing["t_forward_end"] - t0) * 1e3,
        "forward_cpu_ms": timing["forward_cpu_s"] * 1e3,
        "transfer_ms": busy * 1e3,
        "gbps": outcome.bytes / busy / 1e9 if busy > 0 else 0.0,
        "cpu_s": cpu_s,
        "handoff_ns": timing["handoff_ns"],
        "floor_ns": timing["floor_ns"],
        "layers": [[lt.layer, lt.handed_s - t0, lt.submitted_s - t0, lt.landed_s - t0] for lt in outcome.layers],
        "phases": timing["phases"],
        "done_s": outcome.finished_s - t0,
    }


def limit_sample(variants: dict, verified: bool, nbytes: int) -> dict:
    return {"ok": True, "reason": "", "verified": verified, "bytes": nbytes, "variants": variants}
