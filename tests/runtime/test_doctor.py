"""``aiolayer doctor`` across two "hosts" (network namespaces joined by a veth pair): the healthy pair
passes every check, and each seeded misconfiguration is flagged by the name of its check, with a fix.

One set of processes serves every case (starting a Mooncake node takes seconds): P in namespace A, and
in B one D node per misconfiguration, plus a peer that speaks another protocol version. The doctor
runs in A, as on P's host: every case's doctor at once, each test then reads its own output.
``netns.two_hosts`` deletes the namespaces and kills what ran in them on exit, also on failure.
"""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from aiolayer.harness import netns

from aiolayer.harness.procs import free_port
from helpers_node import SMALL_SHAPE, node_env, shape_args

needs_netns = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")
pytestmark = pytest.mark.timeout(120)

START_LIMIT_S = 40.0
DOCTOR_LIMIT_S = 30.0
# An aiolayer of another protocol version: every request is answered with a Nack of its version.
OTHER_PROTOCOL_PEER = """
import sys, msgspec, zmq
sock = zmq.Context().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://" + sys.argv[1])
print('{"control": "tcp://%s:%d"}' % (sys.argv[1], port), flush=True)
nack = msgspec.msgpack.encode({"type": "nack", "v": 2, "code": "version",
                               "reason": "protocol version 1 unsupported; this side speaks 2"})
while True:
    frames = sock.recv_multipart()
    sock.send_multipart(frames[:-1] + [nack])
"""
# A node of another aiolayer release (the version it reports is all that differs).
OTHER_VERSION_NODE = ("import sys, aiolayer.version; aiolayer.version.__version__ = '9.9.9'; "
                      "from aiolayer.cli import main; sys.exit(main(sys.argv[1:]))")


@dataclass
class Lab:
    hosts: netns.Hosts
    controls: dict[str, str]


def _node(hosts: netns.Host, host: netns.Host, *flags: str, env: dict | None = None,
          code: str = "") -> subprocess.Popen:
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "aiolayer"]
    argv = [*head, "node", *shape_args(SMALL_SHAPE), *flags]
    return hosts.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                       env=env or node_env())


def _controls(procs: dict[str, subprocess.Popen]) -> dict[str, str]:
    """Each process's control endpoint, from its JSON line (all started at once, read as they come)."""
    out: dict[str, str] = {}
    end = time.monotonic() + START_LIMIT_S
    while len(out) < len(procs):
        waiting = {p.stdout: name for name, p in procs.items() if name not in out}
        ready, _, _ = select.select(list(waiting), [], [], max(0.0, end - time.monotonic()))
        assert ready, f"not ready within {START_LIMIT_S} s: {sorted(waiting.values())}"
        for stream in ready:
            line = stream.readline()
            assert line, f"{waiting[stream]} exited: {procs[waiting[stream]].poll()}"
            out[waiting[stream]] = json.loads(line)["control"]
    return out


@pytest.fixture(scope="module")
def lab():
    with netns.two_hosts() as hosts:
        a, b = hosts.a.address, hosts.b.address
        no_force_tcp = {k: v for k, v in node_env().items() if k != "MC_FORCE_TCP"}
        procs = {
            "p": _node(hosts, hosts.a, "--bind-host", a),
            "d": _node(hosts, hosts.b, "--bind-host", b),
            "d_loopback": _node(hosts, hosts.b, "--bind-host", "0.0.0.0", "--advertise-host", "127.0.0.1"),
            "d_block_size": _node(hosts, hosts.b, "--bind-host", b, "--block-size", "32"),
            "d_head_dim": _node(hosts, hosts.b, "--bind-host", b, "--head-dim", "32"),
            "d_no_force_tcp": _node(hosts, hosts.b, "--bind-host", b, env=no_force_tcp),
            "d_other_version": _node(hosts, hosts.b, "--bind-host", b, code=OTHER_VERSION_NODE),
            "d_other_protocol": hosts.popen(hosts.b, [sys.executable, "-c", OTHER_PROTOCOL_PEER, b],
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                            env=node_env()),
        }
        controls = _controls(procs)
        # it tells peers 127.0.0.1; whoever runs the doctor knows which machine D is
        controls["d_loopback"] = controls["d_loopback"].replace("127.0.0.1", b)
        controls["wrong_port"] = f"tcp://{b}:{free_port()}"   # nothing listens there
        yield Lab(hosts, controls)


CASES = {   # name -> D's process, and the doctor's own flags
    "healthy": ("d", ()),
    "d-advertises-loopback": ("d_loopback", ("--no-transfer",)),
    "block-size": ("d_block_size", ("--no-transfer",)),
    "head-dim": ("d_head_dim", ("--no-transfer",)),
    "mc-force-tcp": ("d_no_force_tcp", ("--no-transfer",)),
    "aiolayer-version": ("d_other_version", ("--no-transfer",)),
    "protocol-version": ("d_other_protocol", ("--no-transfer",)),
}


@dataclass
class Run:
    rc: int
    out: str
    seconds: float


@pytest.fixture(scope="module")
def runs(lab, tmp_path_factory) -> dict[str, Run]:
    """Every case's doctor, all run at once in A (each its own process): name -> its exit and output."""
    config = tmp_path_factory.mktemp("doctor") / "p.json"
    config.write_text(json.dumps({"kv_connector_extra_config": {
        "control_port": int(lab.controls["p"].rsplit(":", 1)[1]),
        "transport": {"bind_host": lab.hosts.a.address, "advertise_hots": "x"}}}))
    argv = {name: ["--p-control", lab.controls["p"], "--d-control", lab.controls[d], *flags]
            for name, (d, flags) in CASES.items()}
    argv["wrong-port"] = ["--p-control", lab.controls["p"], "--d-control", lab.controls["wrong_port"]]
    argv["unknown-key"] = ["--p-config", str(config), "--d-control", lab.controls["d"], "--no-transfer"]
    started = time.monotonic()
    procs = {name: lab.hosts.popen(lab.hosts.a, [sys.executable, "-m", "aiolayer", "doctor", "--timeout", "1",
                                                 *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=node_env())
             for name, args in argv.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=DOCTOR_LIMIT_S)
        assert "Traceback" not in stderr, f"{name}: {stderr}"
        out[name] = Run(proc.returncode, stdout, time.monotonic() - started)
    return out


def result(runs: dict[str, Run], name: str) -> Run:
    run = runs[name]
    print(run.out)   # shown with the failure
    return run


def failed(out: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^FAIL  (.{18})", out, re.M)}


@needs_netns
def test_a_healthy_pair_across_hosts_passes_every_check(runs):
    run = result(runs, "healthy")
    assert run.rc == 0 and failed(run.out) == set(), run.out
    assert re.search(r"^OK    data path .* MB/s\), control round trip .* verified byte for byte$", run.out, re.M)
    assert "all checks passed" in run.out


@needs_netns
def test_blocks_of_other_sizes_pass_the_layout_check(runs):
    """P's blocks of 16 tokens, D's of 32: the runtime copies them token by token (rows per token)."""
    run = result(runs, "block-size")
    assert run.rc == 0 and failed(run.out) == set(), run.out
    assert re.search(r"^OK    layout .* P 16 and D 32 \(copied token by token\) tokens/block", run.out, re.M), run.out


@needs_netns
@pytest.mark.parametrize("name, check, needle", [
    ("d-advertises-loopback", "advertise D", "D advertises control at 127.0.0.1, Mooncake session at 127.0.0.1"),
    ("head-dim", "layout", "head_bytes: P "),
    ("mc-force-tcp", "mooncake transport", "MC_FORCE_TCP is set on P only"),
    ("aiolayer-version", "version", "P runs aiolayer 0.1.0, D runs 9.9.9"),
    ("protocol-version", "protocol", "protocol version 2 unsupported; this side speaks 1"),
], ids=["d-advertises-loopback", "head-dim", "mc-force-tcp", "aiolayer-version", "protocol-version"])
def test_a_seeded_misconfiguration_is_flagged_by_name_with_a_fix(runs, name, check, needle):
    run = result(runs, name)
    assert run.rc == 1 and failed(run.out) == {check}, run.out
    line = re.search(rf"^FAIL  {re.escape(check)} .*\n      fix: .+$", run.out, re.M)
    assert line and needle in line.group(0), run.out


@needs_netns
def test_a_wrong_control_port_is_unreachable_within_the_deadline(lab, runs):
    run = result(runs, "wrong-port")
    assert run.rc == 1 and failed(run.out) == {"reach D"}, run.out
    assert f"FAIL  reach D            {lab.controls['wrong_port']}: nothing listens at" in run.out
    assert run.seconds < DOCTOR_LIMIT_S


def test_a_silent_endpoint_says_why_it_is_silent():
    """The control call only times out; the doctor tells a typo in the host name, a port nobody listens
    on and a listener that never speaks the protocol apart, each within its deadline."""
    with socket.socket() as silent, socket.socket() as closed:
        silent.bind(("127.0.0.1", 0))
        silent.listen()   # accepts, never answers
        closed.bind(("127.0.0.1", 0))   # bound, not listening: a connect is refused
        runs = [subprocess.run([sys.executable, "-m", "aiolayer", "doctor", "--timeout", "1", "--no-transfer",
                                "--p-control", p, "--d-control", d], capture_output=True, text=True,
                               timeout=DOCTOR_LIMIT_S, env=node_env())
                for p, d in [(f"tcp://127.0.0.1:{closed.getsockname()[1]}", "tcp://no-such-host.invalid:5555"),
                             (f"tcp://127.0.0.1:{silent.getsockname()[1]}", "tcp://no-such-host.invalid:5555")]]
    print(runs[0].stdout, runs[1].stdout)
    assert all(run.returncode == 1 and "Traceback" not in run.stderr for run in runs)
    assert re.search(r"^FAIL  reach P .*nothing listens at 127.0.0.1:\d+ \(connection refused\)", runs[0].stdout, re.M)
    assert re.search(r"^FAIL  reach D .*cannot resolve the host name 'no-such-host.invalid'", runs[0].stdout, re.M)
    assert re.search(r"^FAIL  reach P .*no answer within 1 s, although a TCP connect to 127.0.0.1:\d+ succeeded: "
                     r"not an aiolayer control socket", runs[1].stdout, re.M)


@needs_netns
def test_an_unknown_config_key_is_refused_by_name(lab, runs):
    run = result(runs, "unknown-key")
    assert run.rc == 1 and failed(run.out) == {"config P"}, run.out
    assert re.search(r"^FAIL  config P .*advertise_hots.*\n      fix: remove or correct that key", run.out, re.M)
    assert f"OK    reach P            {lab.controls['p']}" in run.out   # the endpoint came from the config


def test_doctor_help_does_not_import_torch():
    code = ("import sys\nfrom aiolayer.cli import main\ntry:\n    main(['doctor', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=node_env())
    assert done.returncode == 0, done.stderr
    assert "--d-control" in done.stdout and done.stdout.strip().splitlines()[-1] == "False", done.stdout


def test_vllms_own_fields_in_a_kv_transfer_config_are_read_as_vllm_reads_them(tmp_path):
    """A file holding the whole kv_transfer_config: its kv_port and kv_ip name the control endpoint where
    the extra config does not, and a kv_port the extra config's control_port contradicts is the FAIL
    vLLM's own start would be (it passed, and the doctor dialled the port vLLM never opens)."""
    from aiolayer.doctor_checks import endpoint_from_config, load_config

    given = tmp_path / "p.json"
    given.write_text(json.dumps({"kv_port": 5600, "kv_ip": "10.0.0.2", "kv_connector_extra_config": {}}))
    assert endpoint_from_config(*load_config(str(given))) == "tcp://10.0.0.2:5600"
    conflict = tmp_path / "conflict.json"
    conflict.write_text(json.dumps({"kv_port": free_port(), "kv_connector_extra_config": {"control_port": 5700}}))
    done = subprocess.run([sys.executable, "-m", "aiolayer", "doctor", "--p-config", str(conflict), "--timeout",
                           "0.5", "--no-transfer"], capture_output=True, text=True, timeout=60, env=node_env())
    assert done.returncode == 1 and re.search(r"^FAIL  config P .*control_port=5700 conflicts with "
                                              r"kv_transfer_config kv_port=", done.stdout, re.M), done.stdout


def test_a_config_whose_transport_is_not_an_object_is_a_failed_check_not_a_crash(tmp_path):
    """``"transport": ["x"]`` crashed the doctor (AttributeError) before the config check could say why."""
    from aiolayer.doctor_checks import endpoint_from_config

    assert endpoint_from_config({"transport": ["x"], "control_port": 5600}) == "tcp://127.0.0.1:5600"
    assert endpoint_from_config({"transport": {"bind_host": 7}, "control_port": 5600}) == ""
    assert endpoint_from_config({"control_port": 5600}, ["not", "an", "object"]) == "tcp://127.0.0.1:5600"
    given = tmp_path / "d.json"
    given.write_text(json.dumps({"transport": ["x"], "control_port": free_port(), "backend": "memory"}))
    done = subprocess.run([sys.executable, "-m", "aiolayer", "doctor", "--d-config", str(given), "--p-control",
                           "tcp://127.0.0.1:1", "--timeout", "0.5", "--no-transfer"], capture_output=True,
                          text=True, timeout=60, env=node_env())
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1 and re.search(r"^FAIL  config D .*transport", done.stdout, re.M), done.stdout
