"""The driver: starts D and P as two processes, sends each prompt through them the way a router
would, and compares D's greedy tokens with a local run of the same model in this process.

Per request (the steps of examples/README.md):
  1. D allocates blocks and registers them (``rt.receive``) -> a ``Registration``;
  2. P runs the prompt, handing each layer over as it is written (``begin_step``/``layer_ready``/``end``);
  3. D waits for the transfer's result (``pop_received``) and decodes from the received blocks only.

    python -m examples.hf_engine [--max-tokens N] [--zero-received]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: python examples/hf_engine/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.hf_engine.engine import BLOCK_SIZE, build_model, local_greedy, weights_crc

REPO_ROOT = Path(__file__).resolve().parents[2]
# Mooncake over TCP on one host (docs/mooncake.md); set before the engine exists, so in the child's env
MC_ENV = {"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "WARNING"}
START_TIMEOUT_S = 90.0     # import torch + transformers, build the model, start Mooncake
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def sample_prompts(vocab_size: int = 512) -> list[list[int]]:
    """Token ids (no tokenizer needed): shorter than a block, exactly one, several and not aligned."""
    rng = random.Random(1)
    return [[rng.randrange(4, vocab_size) for _ in range(n)] for n in (7, BLOCK_SIZE, 2 * BLOCK_SIZE + 9)]


class Child:
    """One engine process speaking JSON lines; stderr goes to a file (a full pipe would freeze it)."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.stderr = tempfile.TemporaryFile(prefix=f"hf-engine-{module.rsplit('.', 1)[-1]}-")
        env = {**os.environ, **MC_ENV, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env, cwd=str(REPO_ROOT), start_new_session=True)
        self._buf = b""

    def read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"{self.module}: no reply within {timeout} s\n{self.stderr_text()}")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{self.module} exited ({self.proc.wait()})\n{self.stderr_text()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.module}: {reply['error']}\n{self.stderr_text()}")
        return reply

    def call(self, cmd: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> int:
        """``quit`` (the runtime stops cleanly), then SIGTERM, then SIGKILL of the process group."""
        try:
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
            try:
                return self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.wait(STOP_TIMEOUT_S)

    def stderr_text(self, limit: int = 6000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-limit:]


class Cluster:
    """D and P processes for the length of a ``with`` block; stopped whatever happens."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._ids = 0

    def __enter__(self) -> "Cluster":
        try:
            self.d = self._spawn("examples.hf_engine.decode")
            self.p = self._spawn("examples.hf_engine.prefill")
            self.d_info, self.p_info = self.d.read(START_TIMEOUT_S), self.p.read(START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _spawn(self, module: str) -> Child:
        child = Child(module)
        self.children.append(child)
        return child

    def __exit__(self, *exc) -> None:
        self.exit_codes = [child.stop() for child in self.children]

    def generate(self, prompt: list[int], max_tokens: int, zero_received: bool = False) -> dict:
        """One request through D and P; returns D's tokens and what each side said."""
        self._ids += 1
        tid = f"req-{self._ids}"
        reg = self.d.call({"op": "receive", "transfer_id": tid, "num_tokens": len(prompt)})["registration"]
        p = self.p.call({"op": "prefill", "prompt": prompt, "registration": reg})
        d = self.d.call({"op": "decode", "transfer_id": tid, "first_token": p["first_token"],
                         "max_tokens": max_tokens, "zero_received": zero_received})
        return {"transfer_id": tid, "tokens": d["tokens"], "p": p, "d": d}


def run_example(prompts: list[list[int]], max_tokens: int, zero_received: bool = False) -> list[dict]:
    """Every prompt through P and D, next to the local reference run."""
    model = build_model()
    with Cluster() as cluster:
        for info in (cluster.d_info, cluster.p_info):
            assert info["weights_crc"] == weights_crc(model), "P, D and the local run must hold the same weights"
        rows = [cluster.generate(prompt, max_tokens, zero_received) for prompt in prompts]
    for row, prompt in zip(rows, prompts):
        row["local"] = local_greedy(model, prompt, max_tokens)
        row["prompt_tokens"] = len(prompt)
    return rows


def report(rows: list[dict]) -> str:
    lines = [f"{'request':8} {'prompt':>6} {'blocks P->D':>20} {'bytes':>7} {'fwd ms':>7} {'exposed':>8} "
             f"{'dec ms':>7}  ok  same"]
    for r in rows:
        p, d = r["p"], r["d"]
        moves = ",".join(f"{s}->{t}" for s, t in zip(p["src_blocks"], d.get("dst_blocks", [])))
        lines.append(f"{r['transfer_id']:8} {r['prompt_tokens']:>6} {moves:>20} {p['bytes']:>7} "
                     f"{p['forward_ms']:>7.1f} {p['exposed_ms']:>8.1f} {d.get('decode_ms', 0):>7.1f}  "
                     f"{'yes' if d['received']['ok'] else 'NO ':3} {'yes' if r['tokens'] == r['local'] else 'NO'}")
        lines.append(f"{'':8} D:     {r['tokens']}\n{'':8} local: {r['local']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Prefill on P, decode on D from the KV aiolayer moved; "
                                             "compare with a local run.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--zero-received", action="store_true",
                    help="wipe the received blocks before decoding (the tokens should then differ)")
    args = ap.parse_args(argv)
    rows = run_example(sample_prompts(), args.max_tokens, args.zero_received)
    print(report(rows))
    same = all(r["tokens"] == r["local"] and r["d"]["received"]["ok"] for r in rows)
    print(f"\nD's tokens {'equal' if same else 'DIFFER from'} the local run's for {len(rows)} prompts"
          + (" (received KV zeroed)" if args.zero_received else ""))
    return 0 if same != args.zero_received else 1


if __name__ == "__main__":
    raise SystemExit(main())
